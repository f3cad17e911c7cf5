"""Child-process entry point for tests/connectors/test_shared_memory_across_processes.py (not a test module).

    python tests/support/shm_child.py exchange <shm_dir>   put "c2p", print {"pid", "handle"}, get "p2c", verify, print "ok"
    python tests/support/shm_child.py hold <shm_dir> <n>   put n keys "orphan-<i>", print {"pid", "handles"}, sleep
    python tests/support/shm_child.py enospc <dir>         put 4 MiB into a (small, full) dir; print how it failed

Every line of stdout is one JSON object, flushed at once, so the parent can follow along.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from connector_peer import same_payload


def make_payload(seed: int) -> dict:
    """Deterministic payload used by both sides of the cross-process tests."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, 6, generator=g)
    return {
        "kv": torch.randn(2, 3, 16, 8, generator=g).to(torch.bfloat16),
        "f8": torch.randn(5, 5, generator=g).to(torch.float8_e4m3fn),
        "strided": base[::2, 1::2],          # non-contiguous
        "transposed": base.t(),
        "ids": torch.randint(0, 50_000, (33,), generator=g, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "big": torch.arange(seed, seed + 300_000, dtype=torch.int32),  # ~1.2 MB
        "blob": bytes(range(256)) * 4,
        "meta": {"seed": seed, "names": ["a", "b"], "none": None},
    }


def _say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    from omnirelay.connectors.shared_memory import SharedMemoryConnector

    mode, shm_dir = argv[0], argv[1]
    if mode == "exchange":
        conn = SharedMemoryConnector({"shm_dir": shm_dir})
        handle = conn.put("c2p", make_payload(1))
        _say({"pid": os.getpid(), "handle": handle})
        got = conn.get("p2c", timeout=20)
        bad = same_payload(got, make_payload(2))
        conn.delete("p2c")
        conn.close()
        _say({"ok": not bad, "bad": bad})
        return 0
    if mode == "hold":
        conn = SharedMemoryConnector({"shm_dir": shm_dir})
        handles = [conn.put(f"orphan-{i}", make_payload(10 + i)) for i in range(int(argv[2]))]
        _say({"pid": os.getpid(), "handles": handles})
        time.sleep(120)  # the parent SIGKILLs us
        return 1
    if mode == "enospc":
        conn = SharedMemoryConnector({"shm_dir": shm_dir})
        try:
            conn.put("too-big", {"x": torch.ones(1 << 20)})  # 4 MiB into a 256 KiB tmpfs
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - any Python exception is the right behaviour
            outcome = f"raised {type(exc).__name__}"
        _say({"outcome": outcome, "left": sorted(os.listdir(shm_dir))})
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
