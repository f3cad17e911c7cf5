#!/usr/bin/env bash
# Fetch, here where pip reaches the package index, the wheels benchmarks/gpu_accept.sh installs on a
# device machine that has no network: what benchmarks/gpu_wheels.txt names, and what they require,
# for the device's Python (CPython 3.12, manylinux x86_64) and, by default, for this host's python3 too
# (the rehearsal of the device's situation in a fresh venv here). Never torch: the device has its own.
#
#   bash benchmarks/gpu_wheels.sh [--python 3.12 [--python 3.11 ...]] [--dest .gpu-wheels]
#
# The folder is git-ignored; a device call carries it (run's carry: [".gpu-wheels"]), so it must stay
# well under the 64 MiB a call carries with the working tree: the script fails above 32 MiB.
set -eu -o pipefail
cd "$(dirname "$0")/.."
DEST=.gpu-wheels
VERSIONS=()
while [ $# -gt 0 ]; do
    case $1 in
        --python) VERSIONS+=("$2"); shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        *) echo "usage: $0 [--python X.Y ...] [--dest DIR]" >&2; exit 2 ;;
    esac
done
if [ ${#VERSIONS[@]} = 0 ]; then
    VERSIONS=(3.12 "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')")
fi
mapfile -t REQS < <(sed -e 's/#.*//' benchmarks/gpu_wheels.txt | awk 'NF {print $1}')
# manylinux tags from glibc 2.17 to 2.35: what both the device (Ubuntu 24.04, glibc 2.39) and this host load
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 17 24 26 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p "$DEST"
for v in $(printf '%s\n' "${VERSIONS[@]}" | sort -u); do
    echo "gpu_wheels: CPython $v → $DEST"
    python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: --implementation cp \
        --python-version "$v" "${PLATFORMS[@]}" -d "$DEST" "${REQS[@]}"
done
if ls "$DEST" | grep -Eq '^(torch|nvidia|triton)[-_]'; then
    echo "gpu_wheels: a requirement pulled torch or CUDA wheels into $DEST; the device has its own" >&2
    exit 1
fi
size=$(du -sm "$DEST" | cut -f1)
echo "gpu_wheels: $(ls "$DEST" | wc -l) wheels, ${size} MiB in $DEST"
if [ "$size" -gt 32 ]; then
    echo "gpu_wheels: over 32 MiB: a device call carries at most 64 MiB with the working tree" >&2
    exit 1
fi
