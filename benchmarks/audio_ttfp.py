"""Time to first audio of spoken chat answers, streamed vs sequential hand-off between the stages
(issue #25): answer length × concurrency, on one or more omni models served by omni-serve.

For each model and each hand-off mode the script writes the model's bundled pipeline with decode's
``runtime.stream_chunk_tokens`` set (``streamed``: the pipeline default, 4; ``sequential``: 0, the
talker starts after the thinker's last token), starts ``python -m omnirelay.deploy.serve MODEL
--stage-configs-path THAT`` on a loopback port, and for each answer length L and concurrency C sends
C streamed chats at once (``modalities: ["text", "audio"]``, pcm16, greedy, ``ignore_eos`` and
``min_tokens = max_tokens = L``, one seed per request) after one unmeasured warm-up, timed by
omni-bench's client: audio TTFP (to the first ``delta.audio.data``), end to end, and audio RTF (time
to the last audio chunk over seconds of audio). One server at a time; each is stopped (its process
group) before the next starts. ``--max-audio-tokens`` caps the talker's codes (default: the
server's budget in proportion to the answer), to bound a sweep's time on a small host.

Usage::

    python benchmarks/audio_ttfp.py --model qwen3=/tmp/m/tiny-qwen3-omni --model omni=/tmp/m/tiny-omni \\
        --lengths 16,64,256 --concurrency 1,8 --json /tmp/ttfp.json

Prints one markdown table (medians; p90 of TTFP) to paste into BENCHMARKS.md, with the load
average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

from omnirelay.bench.client import Target, send_request
from omnirelay.bench.datasets import Prompt
from omnirelay.bench.metrics import percentile
from omnirelay.bench.runner import new_session
from omnirelay.model_kind import ModelKind, model_kind

PIPELINES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "pipelines"
PIPELINE_OF_KIND = {ModelKind.QWEN3_OMNI: "qwen3_omni.yaml", ModelKind.OMNI: "omni.yaml"}
QUESTION = "Tell me, in a few sentences, what you see from the harbor at dawn."


def pipeline_file(model_dir: str, chunk_tokens: int, work: pathlib.Path, generate_batch: int = 0) -> str:
    """The model's bundled pipeline with decode's ``stream_chunk_tokens`` and (``generate_batch`` > 0)
    the generate stage's ``max_batch_size``: how many answers one generate worker holds at once."""
    source = PIPELINES / PIPELINE_OF_KIND[model_kind(model_dir)]
    spec = yaml.safe_load(source.read_text())
    for stage in spec["stages"]:
        if stage["role"] == "decode":
            stage.setdefault("runtime", {})["stream_chunk_tokens"] = chunk_tokens
        if stage["role"] == "generate" and generate_batch:
            stage.setdefault("runtime", {})["max_batch_size"] = generate_batch
    path = work / f"{pathlib.Path(model_dir).name}-{chunk_tokens}-{generate_batch}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


class Server:
    """One omni-serve, in its own process group, output to a file."""

    def __init__(self, model_dir: str, pipeline: str, log_path: pathlib.Path, timeout: float = 600.0):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "omnirelay.deploy.serve", model_dir, "--port", "0",
                                      "--served-model-name", "m", "--stage-configs-path", pipeline,
                                      "--log-level", "WARNING"],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            match = re.search(r"omni-serve ready: (http://\S+)", log_path.read_text())
            if match:
                self.url = match.group(1)
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("omni-serve did not become ready:\n" + log_path.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


async def wave(url: str, length: int, concurrency: int, max_audio_tokens: int, seed: int) -> list:
    """``concurrency`` spoken chats at once; their results."""
    extra = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "pcm16"},
             "min_tokens": length, "seed": seed}
    if max_audio_tokens:
        extra["max_audio_tokens"] = max_audio_tokens
    target = Target(url=url + "/v1/chat/completions", model="m", endpoint_type="chat", ignore_eos=True,
                    extra_body=extra)
    async with new_session(1800.0) as session:
        return await asyncio.gather(*(send_request(session, target, Prompt(QUESTION, None, length))
                                      for _ in range(concurrency)))


def row(results: list) -> dict:
    done = [r for r in results if r.success and r.audio_ttfp is not None]
    if not done:
        return {"failed": len(results), "errors": sorted({r.error for r in results})[:3]}
    ttfp = [r.audio_ttfp for r in done]
    e2e = [r.latency for r in done]
    return {"failed": len(results) - len(done), "ttfp_p50": statistics.median(ttfp), "ttfp_p90": percentile(ttfp, 90),
            "e2e_p50": statistics.median(e2e), "ttfp_over_e2e": statistics.median(t / e for t, e in zip(ttfp, e2e)),
            "rtf_p50": statistics.median(r.audio_rtf for r in done if r.audio_rtf is not None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--lengths", default="16,64,256")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--modes", default="streamed,sequential")
    parser.add_argument("--stream-chunk-tokens", type=int, default=4)
    parser.add_argument("--max-audio-tokens", type=int, default=0)
    parser.add_argument("--generate-batch", default="0",
                        help="comma-separated generate-stage max_batch_size values to compare, each on its own "
                             "server (0: the pipeline's own)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    chunk_of = {"streamed": args.stream_chunk_tokens, "sequential": 0}
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="audio-ttfp-") as tmp:
        work = pathlib.Path(tmp)
        runs = [(spec, mode, int(batch)) for spec in args.model for mode in args.modes.split(",")
                for batch in args.generate_batch.split(",")]
        for spec, mode, batch in runs:
            name, _, model_dir = spec.partition("=")
            server = Server(model_dir, pipeline_file(model_dir, chunk_of[mode], work, batch),
                            work / f"{name}-{mode}-{batch}.log")
            try:
                asyncio.run(wave(server.url, lengths[0], 1, args.max_audio_tokens, seed=999))   # warm-up
                for length in lengths:
                    for concurrency in levels:
                        figures = row(asyncio.run(wave(server.url, length, concurrency, args.max_audio_tokens,
                                                       seed=length * 100 + concurrency)))
                        rows.append({"model": name, "mode": mode, "generate_batch": batch or "pipeline",
                                     "length": length, "concurrency": concurrency, **figures})
                        print(json.dumps(rows[-1]), flush=True)
            finally:
                server.stop()
    load_after = os.getloadavg()
    print(f"\nload average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f}; {os.cpu_count()} CPUs")
    print("\n| model | hand-off | generate batch | answer tokens | concurrency | audio TTFP p50 (s) | TTFP p90 (s) "
          "| E2E p50 (s) | TTFP / E2E | audio RTF p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['model']} | {r['mode']} | {r['generate_batch']} | {r['length']} | {r['concurrency']} |"
        if "ttfp_p50" not in r:
            print(f"{head} failed: {r['errors']} |")
            continue
        print(f"{head} {r['ttfp_p50']:.2f} | "
              f"{r['ttfp_p90']:.2f} | {r['e2e_p50']:.2f} | {r['ttfp_over_e2e']:.2f} | {r['rtf_p50']:.3f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"load_before": load_before, "load_after": load_after,
                                                       "rows": rows}, indent=1))
    return 0 if all("ttfp_p50" in r and not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
