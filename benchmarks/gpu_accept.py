"""The Python stages of ``benchmarks/gpu_accept.sh`` (the device acceptance check); see that script.

Each subcommand is one stage, run by the script in its own process group under its own time bound,
and writes what it found as JSON to ``--json`` (rewritten as it goes, so a stage cut off by its
bound still leaves what it had measured):

* ``install`` — which of the packages omnirelay needs the Python lacks (``benchmarks/gpu_wheels.txt``
  names them with their import names), installed from the carried wheels into a private folder
  (``pip install --no-index --target``, never touching the network, the Python's own packages or
  torch), then the project itself (``--no-deps``) unless this tree is already importable;
* ``models`` — the models the later stages serve, built offline by the project's builders;
* ``parity`` — the tiny Qwen2 / Qwen3 / Qwen3-MoE through the real prefill and decode engines on
  ``--device``, against transformers on the same device: float32 greedy tokens exactly equal;
  bfloat16 each greedy token within ``TIE`` of transformers' own argmax and at least half the
  answers exact (the tolerance of ``tests/engine/test_bf16.py``); the KV handed over the
  shared-memory connector layer by layer equal to the whole export;
* ``serve`` — ``omni-serve`` on the tiny model, one chat through the OpenAI-compatible endpoint,
  then SIGTERM and a check that its process group is empty;
* ``summary`` — the stages' table (printed) and the summary JSON.

Engine helpers come from ``tests/support`` (and the bf16 tolerance from ``tests/engine``) through
the path this module adds, not from an installed package.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
FAMILIES = ("qwen2", "qwen3", "qwen3-moe")


def _write(path: pathlib.Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------------------------- install

def _wanted() -> list[tuple[str, str]]:
    """(requirement, import name) per line of gpu_wheels.txt."""
    rows = []
    for line in (REPO / "benchmarks" / "gpu_wheels.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement, module = line.split()
            rows.append((requirement, module))
    return rows


def _pip(args: list[str]) -> None:
    # PIP_CONFIG_FILE=/dev/null: no configured index or find-links either; only the carried wheels.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-compile", "--quiet", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def install(args) -> int:
    import importlib.util

    result: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    missing = [req for req, module in _wanted() if module != "-" and importlib.util.find_spec(module) is None]
    result["missing"] = missing
    wheels = args.wheels.resolve()
    if missing:
        if not wheels.is_dir():
            result["error"] = (f"missing {', '.join(missing)} and no wheels at {wheels}: run "
                               "benchmarks/gpu_wheels.sh first and carry its folder")
            _write(args.json, result)
            print(result["error"], file=sys.stderr)
            return 1
        _pip(["--find-links", str(wheels), "--target", str(args.site / "deps"), *missing])
    spec = importlib.util.find_spec("omnirelay")
    here = spec is not None and spec.origin is not None and pathlib.Path(spec.origin).resolve().is_relative_to(REPO)
    result["project"] = "already importable from this tree" if here else "installed --no-deps"
    if not here:
        # Built from a copy of the sources (the tree stays as it is), in an isolated build environment
        # fed from the carried wheels when they hold setuptools, else with this Python's setuptools.
        src = args.site / "src"
        src.mkdir(parents=True)
        for name in ("pyproject.toml", "README.md", "omnirelay", "broker", "workers", "connectors", "gateway",
                     "deploy"):
            subprocess.run(["cp", "-r", str(REPO / name), str(src / name)], check=True)
        isolation = (["--find-links", str(wheels)] if any(wheels.glob("setuptools-*.whl"))
                     else ["--no-build-isolation"])
        _pip(["--no-deps", *isolation, "--target", str(args.site / "project"), str(src)])
    result["ok"] = True
    _write(args.json, result)
    print(f"install: missing before: {', '.join(missing) or 'nothing'}; project {result['project']}")
    return 0


# ---------------------------------------------------------------------------------------------- models

def models(args) -> int:
    from omnirelay.deploy.builders.llm import default_model_dir
    from omnirelay.deploy.builders.qwen3 import cached_qwen3

    paths = {"qwen2": str(default_model_dir()), "qwen3": str(cached_qwen3(moe=False)),
             "qwen3-moe": str(cached_qwen3(moe=True))}
    if args.shape:
        # omni-make-model shape-qwen2.5-0.5b DIR: Qwen2.5-0.5B's geometry, random bf16 weights
        subprocess.run([sys.executable, "-m", "omnirelay.deploy.builders.llm", "shape-qwen2.5-0.5b", str(args.shape)],
                       check=True)
        paths["shape"] = str(args.shape)
    _write(args.json, paths)
    print("\n".join(f"{name}={path}" for name, path in paths.items()))
    return 0


# ---------------------------------------------------------------------------------------------- parity

def _hf_reference(path: str, dtype, device: str, prompts: list[list[int]], answers: list[list[int]]) -> dict:
    """transformers on ``device``: how many of our answers equal its greedy ones, and the largest
    shortfall of one of our tokens' logit below its argmax (teacher-forced over prompt + answer)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    gaps, exact = [], 0
    with torch.no_grad():
        for ids, answer in zip(prompts, answers):
            logits = hf(torch.tensor([ids + answer[:-1]], device=device)).logits[0, len(ids) - 1:].float()
            chosen = logits.gather(1, torch.tensor(answer, device=device)[:, None])[:, 0]
            gaps.append(float((logits.max(-1).values - chosen).max()))
            n = len(answer)
            gen = hf.generate(torch.tensor([ids], device=device), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            exact += gen[0, len(ids):].tolist() == answer
    del hf
    return {"exact": exact, "max_gap": round(max(gaps), 4)}


def _one_family(path: str, dtype, device: str, shm_dir: str, tokens: int, num_prompts: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    import engine_support
    from engine_support import QUESTIONS, chat_ids, run_decode, run_prefill
    from omnirelay.connectors import create_connector
    from omnirelay.request_params import TextParams
    from omnirelay.workers.kv.export import import_kv
    from omnirelay.workers.llm.decode import DecodeEngine
    from omnirelay.workers.llm.model_runner import local_runner
    from omnirelay.workers.llm.models.llama import LlamaModel
    from omnirelay.workers.llm.prefill import PrefillEngine

    engine_support.GREEDY = TextParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    os.makedirs(shm_dir)
    conn = create_connector("shared_memory", {"shm_dir": shm_dir})
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:num_prompts]]
    model = LlamaModel(path, dtype=dtype, device=device)
    engines = []

    def prefill(mode: str):
        engine = PrefillEngine(local_runner(model, block_size=16, budget_bytes=64 << 20), conn, max_model_len=2048,
                               max_batched_tokens=64, kv_transfer=mode)
        engines.append(engine)
        start = time.perf_counter()
        out = run_prefill(engine, prompts)
        return out, engine, (time.perf_counter() - start) * 1e3

    try:
        whole, _, whole_ms = prefill("whole")
        kv_whole = {k: import_kv(conn, r.outputs.kv_key, r.outputs.kv_handle, timeout=10) for k, r in whole.items()}
        layer, engine, layer_ms = prefill("layerwise")
        layerwise = engine.stats["kv_layerwise_handoffs"] == len(prompts)
        first_same = all(layer[k].token == whole[k].token for k in layer)
        decode = DecodeEngine(local_runner(model, block_size=16, budget_bytes=64 << 20), conn, max_num_seqs=16,
                              max_model_len=2048, transfer_timeout_s=10)
        engines.append(decode)
        start = time.perf_counter()
        outputs = run_decode(decode, prompts, layer)
        decode_ms = (time.perf_counter() - start) * 1e3
        again, _, _ = prefill("layerwise")   # a fresh pool, no prefix hit: the same steps as the whole run
        same_kv = all(torch.equal(import_kv(conn, r.outputs.kv_key, r.outputs.kv_handle, timeout=10), kv_whole[k])
                      for k, r in again.items())
    finally:
        for e in engines:
            e.close()
        conn.close()
    answers = [outputs[f"r{i}"] for i in range(len(prompts))]
    del model
    started = time.perf_counter()
    ref = _hf_reference(path, dtype, device, prompts, answers)
    ref["transformers_s"] = round(time.perf_counter() - started, 1)
    return {"prompts": len(prompts), "tokens": tokens, "layerwise_handoffs": layerwise, "first_tokens_same": first_same,
            "kv_layerwise_equals_whole": same_kv, **ref, "prefill_ms_whole": round(whole_ms, 1),
            "prefill_ms_layerwise": round(layer_ms, 1), "decode_ms": round(decode_ms, 1)}


def parity(args) -> int:
    sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO / "tests" / "engine")]
    import torch

    from test_bf16 import TIE, TOKENS   # the bf16 tolerance the engine tests hold the CPU to
    from engine_support import NEW_TOKENS

    paths = json.loads(args.models.read_text())
    result: dict = {"device": args.device, "tie": TIE, "families": {}}
    ok = True
    for case in args.cases.split(","):
        family, name = case.split(":")
        dtype = getattr(torch, name)
        started = time.perf_counter()
        tokens = args.tokens or (NEW_TOKENS if dtype == torch.float32 else TOKENS)
        row = _one_family(paths[family], dtype, args.device, str(args.work / f"shm-{family}-{name}"), tokens,
                          args.prompts)
        row["seconds"] = round(time.perf_counter() - started, 1)
        if dtype == torch.float32:   # float32: exactly transformers' greedy tokens
            row["ok"] = row["exact"] == row["prompts"]
        else:   # bf16: a differing token is a tie at bf16 resolution, and half the answers are exact
            row["ok"] = row["max_gap"] <= TIE and row["exact"] >= row["prompts"] // 2
        row["ok"] = row["ok"] and row["first_tokens_same"] and row["kv_layerwise_equals_whole"] and row[
            "layerwise_handoffs"]
        ok &= row["ok"]
        result["families"][f"{family} {name}"] = row
        _write(args.json, result)
        print(f"{family} {name} on {args.device}: {'ok' if row['ok'] else 'FAILED'} — {row['exact']}/"
              f"{row['prompts']} answers equal transformers' greedy, max logit gap {row['max_gap']}, "
              f"KV layerwise == whole {row['kv_layerwise_equals_whole']}, first tokens same "
              f"{row['first_tokens_same']} ({row['seconds']} s)", flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    result["ok"] = ok
    _write(args.json, result)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------- serve

# The gateway is on loopback: straight there, whatever proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(method: str, url: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with _DIRECT.open(request, timeout=timeout) as response:
        return json.loads(response.read())


class _Stopped(Exception):
    """SIGTERM (the stage's time bound): stop omni-serve and report before exiting."""


def _raise_stopped(signum, frame):
    raise _Stopped(f"signal {signum}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def serve(args) -> int:
    result: dict = {"ok": False}
    signal.signal(signal.SIGTERM, _raise_stopped)
    # Leave the stage's bound (gpu_accept.sh passes it) room to stop omni-serve and report.
    limit = float(os.environ.get("GPU_ACCEPT_STAGE_LIMIT_S", "inf"))
    ready_timeout = min(args.ready_timeout, max(limit - 30, 0.6 * limit))
    log_path = args.work / "omni-serve.log"
    command = [sys.executable, "-m", "omnirelay.deploy.serve", str(args.model), "--port", "0",
               "--kv-cache-bytes", str(256 << 20)]
    grace = 20   # seconds omni-serve gets to stop on SIGTERM
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    if args.pgid_file:   # the script kills this group too, should this stage itself be killed
        with open(args.pgid_file, "a") as f:
            f.write(f"{proc.pid}\n")
    try:
        url = None
        while time.monotonic() - started < ready_timeout and proc.poll() is None:
            match = re.search(r"omni-serve ready: (http://\S+)", log_path.read_text())
            if match:
                url = match.group(1)
                break
            time.sleep(0.2)
        if url is None:
            result["error"] = f"not ready after {time.monotonic() - started:.0f} s (exit {proc.poll()})"
            return 1
        result["ready_s"] = round(time.monotonic() - started, 1)
        model = _http("GET", url + "/v1/models")["data"][0]["id"]
        t0 = time.monotonic()
        reply = _http("POST", url + "/v1/chat/completions",
                      {"model": model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8,
                       "temperature": 0})
        result["chat_s"] = round(time.monotonic() - t0, 2)
        result["completion_tokens"] = reply["usage"]["completion_tokens"]
        result["finish_reason"] = reply["choices"][0]["finish_reason"]
        result["ok"] = result["completion_tokens"] > 0
        print(f"omni-serve ready in {result['ready_s']} s; one chat: {result['completion_tokens']} tokens in "
              f"{result['chat_s']} s ({result['finish_reason']})", flush=True)
    except _Stopped:   # the stage's bound: 5 s until SIGKILL, so a short grace for omni-serve
        result["error"] = "stopped by the stage's time bound"
        grace = 3
    except Exception as exc:   # the stage reports what failed; the log below says why
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second SIGTERM must not cut the stop short
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            result["exit_code"] = proc.wait(grace)
        except subprocess.TimeoutExpired:
            result["exit_code"] = f"killed after {grace} s"
        deadline = time.monotonic() + min(grace, 10)
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        result["processes_left"] = _group_alive(proc.pid)
        if result["processes_left"]:
            os.killpg(proc.pid, signal.SIGKILL)
            result["ok"] = False
        if not result["ok"]:
            print(log_path.read_text()[-4000:], file=sys.stderr)
            print(f"serve: FAILED {result}", file=sys.stderr)
        _write(args.json, result)
    return 0 if result["ok"] else 1


# ---------------------------------------------------------------------------------------------- summary

def _load(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _figures(name: str, data) -> str:
    """A stage's key figures, one short line for the table."""
    if data is None:
        return ""
    if name == "device":
        return f"torch {data['torch']}, CUDA {data['cuda']}, {data['gpus']} GPU(s): {data['device']}"
    if name == "models":
        return ", ".join(data)
    if name == "install":
        return (f"python {data.get('python')}; installed {', '.join(data.get('missing', [])) or 'nothing'}; "
                f"project {data.get('project', '?')}")
    if name == "parity":
        return "; ".join(f"{k}: {v['exact']}/{v['prompts']} exact, gap {v['max_gap']}"
                         f"{'' if v['kv_layerwise_equals_whole'] else ', KV MISMATCH'}"
                         for k, v in data.get("families", {}).items())
    if name == "decode":
        cells = []
        for r in data:
            cell = f"{r['dtype']} b{r['batch']} ctx{r['context']}: {r['step_ms_median']} ms"
            if "gpu_ms_per_step" in r:
                cell += f" (host {r['host_issue_ms_median']}, GPU {r['gpu_ms_per_step']})"
            cells.append(cell)
        return "; ".join(cells)
    if name == "kv-handoff":
        rows = data.get("results", {}).get("shared_memory", [])
        return "; ".join(f"{r['prompt_tokens']} tok ({r['kv_mib']} MiB): TTFT whole {r['whole']['ttft_ms']:.1f} / "
                         f"layerwise {r['layerwise']['ttft_ms']:.1f} ms" for r in rows)
    if name == "serve":
        if not data.get("ok"):
            return data.get("error", "") + (" processes left" if data.get("processes_left") else "")
        return f"ready {data['ready_s']} s, chat {data['chat_s']} s, {data['completion_tokens']} tokens"
    if name == "tp-ep":
        return "; ".join(f"{layout}: decode step {t['decode']['median']} ms, parity "
                         f"{'ok' if data['parity'].get(layout) else 'MISMATCH'}" for layout, t in data["ms"].items())
    return ""


def summary(args) -> int:
    stages = []
    for line in args.stages.read_text().splitlines():
        name, status, rc, seconds, limit, note = (line.split("\t") + [""] * 6)[:6]
        detail = _load(args.work / f"{name}.json")
        stages.append({"name": name, "status": status, "rc": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                       "note": note, "figures": _figures(name, detail), "detail": detail})
    passed = all(s["status"] in ("pass", "skip") for s in stages)
    info = _load(args.work / "device.json") or {}
    out = {"mode": args.mode, "passed": passed, "total_s": args.total_s, "budget_s": args.budget_s, **info,
           "stages": stages}
    args.json.write_text(json.dumps(out, indent=1))
    print(f"\ngpu_accept ({args.mode}, {info.get('device', '?')}, torch {info.get('torch', '?')}): "
          f"{'PASSED' if passed else 'FAILED'} in {args.total_s} s of a {args.budget_s} s budget")
    print("| stage | status | s | limit s | figures |")
    print("|---|---|---:|---:|---|")
    for s in stages:
        figures = s["figures"] or s["note"]
        print(f"| {s['name']} | {s['status']} | {s['seconds']} | {s['limit_s']} | {figures} |")
    print(f"summary: {args.json}")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("install")
    p.add_argument("--wheels", type=pathlib.Path, required=True)
    p.add_argument("--site", type=pathlib.Path, required=True)
    p.add_argument("--json", type=pathlib.Path)
    p = sub.add_parser("models")
    p.add_argument("--shape", type=pathlib.Path, help="also build shape-qwen2.5-0.5b here")
    p.add_argument("--json", type=pathlib.Path, required=True)
    p = sub.add_parser("parity")
    p.add_argument("--models", type=pathlib.Path, required=True, help="the models stage's JSON")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", default=",".join(f"{f}:{d}" for f in FAMILIES for d in ("float32", "bfloat16")),
                   help="family:dtype pairs (default: every family in float32 and bfloat16)")
    p.add_argument("--prompts", type=int, default=6, help="how many of engine_support's questions (at most 6)")
    p.add_argument("--tokens", type=int, default=0,
                   help="greedy tokens per answer (0: engine_support's 16 in float32, test_bf16's 24 in bfloat16)")
    p.add_argument("--work", type=pathlib.Path, required=True)
    p.add_argument("--json", type=pathlib.Path)
    p = sub.add_parser("serve")
    p.add_argument("--model", type=pathlib.Path, required=True)
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--pgid-file", type=pathlib.Path, help="append omni-serve's process group id here")
    p.add_argument("--work", type=pathlib.Path, required=True)
    p.add_argument("--json", type=pathlib.Path)
    p = sub.add_parser("summary")
    p.add_argument("--stages", type=pathlib.Path, required=True, help="one tab-separated line per stage")
    p.add_argument("--work", type=pathlib.Path, required=True, help="where the stages wrote NAME.json")
    p.add_argument("--mode", required=True)
    p.add_argument("--total-s", type=int, required=True)
    p.add_argument("--budget-s", type=int, required=True)
    p.add_argument("--json", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)
    return {"install": install, "models": models, "parity": parity, "serve": serve, "summary": summary}[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
