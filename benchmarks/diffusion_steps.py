"""Diffusion denoising on the tiny Wan pipeline: step caching, CFG in one pass, and the default job.

Three measurements, each against the plain loop on the same tiny model and the same seeds:

``cache``    one guided Wan request of ``--steps`` (40+) steps through :class:`GenerateVideoEngine`:
             after a 2-step warm-up, the plain loop, ``static`` (``--static-interval``) and
             ``tea_cache`` (each ``--thresh``);
             the wall time of the denoising loop (prompt encoding and the VAE excluded: the cache
             touches neither), the speed-up, the transformer branch-steps computed / skipped, and
             the PSNR of the decoded clip against the plain loop's (uint8 frames, peak 255).
``cfg``      one guided denoising step as one batched forward (B = 2 × rows) vs two forwards, at
             ``--size`` × ``--frames``; median of ``--repeats``.
``default``  ``POST /v1/videos`` with only a prompt through ``omni-serve`` (one generate worker with
             its default flags) on the tiny Wan directory: seconds from the POST to ``completed``,
             and the size the server chose. ``--size`` asks for a size instead (Wan's 832x480: the
             old default) with ``--steps`` steps; its full-length time is then extrapolated from
             the measured per-step time (reported as such).

Usage::

    python benchmarks/diffusion_steps.py cache [--steps 40] [--size 128x96] [--frames 17] [--threads 1]
    python benchmarks/diffusion_steps.py cfg [--size 416x240] [--frames 65] [--repeats 3]
    python benchmarks/diffusion_steps.py default [--size 832x480 --steps 2]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from servers import HttpServer, free_port   # noqa: E402

PROMPT = "a red fox sitting in the snow at dawn"


def _pipe(tmp: str):
    from omnirelay.deploy.builders.wan import build_tiny_wan
    from omnirelay.workers.generate.image import load_pipeline

    return load_pipeline(str(build_tiny_wan(pathlib.Path(tmp) / "tiny-wan", seed=0)))


def _params(args, cache=None):
    from omnirelay.video_params import VideoParams

    width, height = (int(v) for v in args.size.split("x"))
    return VideoParams(prompt=PROMPT, negative_prompt="blurry", width=width, height=height, num_frames=args.frames,
                       seed=7, num_inference_steps=args.steps, guidance_scale=5.0, fps=16, cache=cache)


def _run(pipe, params) -> tuple[float, np.ndarray, dict]:
    """(seconds of the denoising loop, the decoded frames, the engine's stats)."""
    from omnirelay.workers.generate.video import GenerateVideoEngine, JobPhase, VideoTask

    engine = GenerateVideoEngine(pipe, encoder="webp")
    engine.add(VideoTask("r", params, time.time() + 3600))
    engine.step()   # prompt
    start = time.perf_counter()
    while engine.job.phase is JobPhase.DENOISE:
        engine.step()
    denoise = time.perf_counter() - start
    engine.step()   # VAE
    frames = np.stack(engine.job.frames[0])
    return denoise, frames, dict(engine.stats)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def bench_cache(args) -> None:
    from omnirelay.step_cache_params import KEYS, StepCacheSpec

    with tempfile.TemporaryDirectory() as tmp:
        pipe = _pipe(tmp)
        _run(pipe, _params(argparse.Namespace(**{**vars(args), "steps": 2})))   # warm-up: first calls are slow
        base_time, base_frames, _ = _run(pipe, _params(args))
        print(f"plain loop: {args.steps} steps in {base_time:.1f} s", flush=True)
        for spec in (StepCacheSpec("static", interval=args.static_interval),
                     *(StepCacheSpec("tea_cache", rel_l1_thresh=thresh) for thresh in args.thresh)):
            elapsed, frames, stats = _run(pipe, _params(args, spec))
            config = {key: getattr(spec, key) for key in KEYS[spec.backend] if getattr(spec, key) not in ((), 0)}
            print(f"{spec.backend:9s} {json.dumps(config)}: "
                  f"{elapsed:.1f} s, {base_time / elapsed:.2f}x, branch-steps computed "
                  f"{stats.get('cache_computed_steps', 0)} skipped {stats.get('cache_skipped_steps', 0)}, "
                  f"PSNR vs plain {_psnr(frames, base_frames):.1f} dB", flush=True)


def bench_cfg(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pipe = _pipe(tmp)
        model = pipe.transformer
        width, height = (int(v) for v in args.size.split("x"))
        latent = torch.randn(1, 16, (args.frames - 1) // 4 + 1, height // 8, width // 8)
        cond, uncond = torch.randn(1, 512, 32), torch.randn(1, 512, 32)
        t = torch.tensor([900.0])
        times: dict[str, list[float]] = {"two passes": [], "one pass": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                start = time.perf_counter()
                model(hidden_states=latent, timestep=t, encoder_hidden_states=cond, return_dict=False)
                model(hidden_states=latent, timestep=t, encoder_hidden_states=uncond, return_dict=False)
                times["two passes"].append(time.perf_counter() - start)
                start = time.perf_counter()
                model(hidden_states=latent.repeat(2, 1, 1, 1, 1), timestep=t.expand(2),
                      encoder_hidden_states=torch.cat([cond, uncond]), return_dict=False)
                times["one pass"].append(time.perf_counter() - start)
        tokens = latent.shape[2] * latent.shape[3] * latent.shape[4] // 4
        for name, values in times.items():
            print(f"{name}: median {statistics.median(values) * 1000:.0f} ms per guided step "
                  f"({args.size}, {args.frames} frames, {tokens} tokens)", flush=True)


def bench_default(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        from omnirelay.deploy.builders.wan import build_tiny_wan

        path = build_tiny_wan(pathlib.Path(tmp) / "tiny-wan", seed=0)
        port = free_port()
        server = HttpServer("omni-serve", [sys.executable, "-m", "omnirelay.deploy.serve", str(path),
                                           "--served-model-name", "tiny-wan", "--host", "127.0.0.1", "--port",
                                           str(port), "--log-level", "WARNING"],
                            port, "tiny-wan", pathlib.Path(tmp) / "serve.log")
        try:
            server.wait_ready(300)
            body = {"model": "tiny-wan", "prompt": PROMPT}
            if args.size:
                body.update(size=args.size, num_inference_steps=args.steps)
            start = time.monotonic()
            job = _post(server.url + "/v1/videos", body)
            while job["status"] not in ("completed", "failed", "cancelled"):
                time.sleep(1.0)
                with urllib.request.urlopen(f"{server.url}/v1/videos/{job['id']}", timeout=30) as reply:
                    job = json.load(reply)
            elapsed = time.monotonic() - start
            print(f"POST /v1/videos {json.dumps(body)}: {job['status']} in {elapsed:.1f} s "
                  f"(size {job['size']}, {job['seconds']} s of video)", flush=True)
            if args.size and job["status"] == "completed":
                print(f"  at 50 steps: about {elapsed + (50 - args.steps) * _step_time(args, path):.0f} s "
                      f"(extrapolated from the measured guided step)", flush=True)
        finally:
            server.stop()


def _step_time(args, path) -> float:
    """Seconds of one guided step (one batched forward) at ``args.size`` and the default 65 frames,
    on one thread as the worker runs."""
    from omnirelay.workers.generate.image import load_pipeline

    torch.set_num_threads(1)
    model = load_pipeline(str(path)).transformer
    width, height = (int(v) for v in args.size.split("x"))
    latent = torch.randn(2, 16, 17, height // 8, width // 8)
    with torch.inference_mode():
        start = time.perf_counter()
        model(hidden_states=latent, timestep=torch.tensor([900.0, 900.0]), encoder_hidden_states=torch.randn(2, 512, 32),
              return_dict=False)
    return time.perf_counter() - start


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("cache", "cfg", "default"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--size", default=None, help="WxH (cache: 128x96, cfg: 416x240, default: the server's)")
    ap.add_argument("--frames", type=int, default=None, help="cache: 17, cfg: 65")
    ap.add_argument("--static-interval", type=int, default=2)
    ap.add_argument("--thresh", type=float, nargs="+", default=[0.2], help="tea_cache's rel_l1_thresh (several: one run each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "cache":
        args.size, args.frames = args.size or "128x96", args.frames or 17
        bench_cache(args)
    elif args.what == "cfg":
        args.size, args.frames = args.size or "416x240", args.frames or 65
        bench_cfg(args)
    else:
        bench_default(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
