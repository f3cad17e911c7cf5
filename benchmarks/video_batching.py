"""Video diffusion throughput without a server: N same-shape requests one at a time vs as one batch.

What is measured (interleaved, ``--repeats`` times; minimum and median reported): the wall time of
:class:`GenerateVideoEngine` stepping N requests (different prompts and seeds, the same size,
frames, steps and guidance) to finished files, with ``max_batch_size=1`` (N denoising loops) and
with ``max_batch_size=N`` (one loop over N rows). Prompt encoding, denoising, VAE decode and the
encoder (lossless WebP, as PyAV may be missing) all count. One warm-up run of each comes first.

Usage::

    python benchmarks/video_batching.py [--model tiny-wan|tiny-video|DIR] [--requests 2] [--size 64x48]
                                        [--frames 9] [--steps 4] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import torch


def _engine_run(pipe, params: list, max_batch_size: int) -> tuple[float, dict]:
    from omnirelay.workers.generate.video import GenerateVideoEngine, VideoTask

    engine = GenerateVideoEngine(pipe, max_batch_size=max_batch_size, encoder="webp")
    for k, p in enumerate(params):
        engine.add(VideoTask(f"r{k}", p, time.time() + 3600))
    start, videos = time.perf_counter(), 0
    while engine.has_work:
        out = engine.step()
        assert not out.failed, out.failed
        videos += len(out.videos)
    elapsed = time.perf_counter() - start
    assert videos == len(params)
    return elapsed, dict(engine.stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-wan", help="tiny-wan, tiny-video (built here) or a diffusers directory")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--size", default="64x48")
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from omnirelay.video_params import VideoParams
    from omnirelay.workers.generate.image import load_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if args.model in ("tiny-wan", "tiny-video"):
            from omnirelay.deploy.builders.video import build_tiny_text_to_video
            from omnirelay.deploy.builders.wan import build_tiny_wan
            path = str(pathlib.Path(tmp) / args.model)
            (build_tiny_wan if args.model == "tiny-wan" else build_tiny_text_to_video)(path, seed=0)
        pipe = load_pipeline(path)
    width, height = (int(x) for x in args.size.split("x"))
    params = [VideoParams(prompt=f"request {k}: a red fox in the snow", width=width, height=height,
                          num_frames=args.frames, num_inference_steps=args.steps, guidance_scale=args.guidance,
                          seed=k) for k in range(args.requests)]
    times: dict[int, list[float]] = {1: [], args.requests: []}
    for repeat in range(args.repeats + 1):            # repeat 0 warms up
        for batch in times:
            elapsed, stats = _engine_run(pipe, params, batch)
            assert stats[f"batches_of_{batch}"] == args.requests // batch, stats
            if repeat:
                times[batch].append(elapsed)
    print(f"{type(pipe).__name__} {args.model}: {args.requests} requests of {args.size}, {args.frames} frames, "
          f"{args.steps} steps, guidance {args.guidance}, {args.threads} thread(s), {args.repeats} repeats")
    for batch, runs in times.items():
        label = "one at a time" if batch == 1 else f"one batch of {batch}"
        print(f"  {label:>16}: min {min(runs):.2f} s, median {statistics.median(runs):.2f} s, "
              f"{args.requests / min(runs):.2f} videos/s")
    print(f"  speed-up (min/min): {min(times[1]) / min(times[args.requests]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
