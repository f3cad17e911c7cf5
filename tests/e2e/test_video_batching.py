"""Batched video diffusion: ``runtime.max_batch_size`` > 1 runs same-shape video requests as one
denoising loop (each row its own prompt, negative prompt and seed), and every request gets the
frames it gets alone, up to float rounding. Checked for the tiny ``TextToVideoSDPipeline``
(``omni-make-model tiny-video``) and the tiny ``WanPipeline`` (``tiny-wan``, two experts, UniPC
with a multistep history) at the engine — including a request cancelled or timed out mid-batch —
and through a real cluster (broker, generate worker, gateway as processes) on ``POST /v1/videos``,
where the worker's own counters show that two requests ran as one batch.
"""

from __future__ import annotations

import time

import numpy as np
import openai
import pytest
import torch

from omnirelay.deploy.builders.video import build_tiny_text_to_video
from omnirelay.deploy.builders.wan import build_tiny_wan
from omnirelay.video_params import VideoParams
from omnirelay.workers.generate.image import load_pipeline
from omnirelay.workers.generate.video import GenerateVideoEngine, VideoTask, WholeCallVideoRunner

from media_support import batched_pipeline, pipeline_cluster, run_engine, tiny_model_dir, wait_for_video
from media_support import decode_frames
from repo_paths import REPO_ROOT

PIPELINE_YAML = REPO_ROOT / "deploy" / "pipelines" / "text_to_video.yaml"
PROMPTS = ("a red fox sitting in the snow at dawn", "a paper boat drifting down a rainy street")
# The client warns that OpenAI's hosted video API will be retired; the API shape is what we serve.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return tiny_model_dir(tmp_path_factory, "tiny-video", build_tiny_text_to_video)


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return tiny_model_dir(tmp_path_factory, "tiny-wan", build_tiny_wan)


def _run(engine: GenerateVideoEngine, *tasks: VideoTask, max_steps: int = 200):
    """Step the engine dry: ({request id: frames}, {request id: fps}, failures)."""
    frames, fps, failed = {}, {}, []
    for out in run_engine(engine, *tasks, max_steps=max_steps):
        failed += out.failed
        for video in out.videos:
            frames[video.request_id], fps[video.request_id] = decode_frames(video.data, video.mime)
    return frames, fps, failed


def _task(request_id: str, params: VideoParams, deadline: float | None = None) -> VideoTask:
    return VideoTask(request_id, params, time.time() + 300 if deadline is None else deadline)


def _assert_same_frames(batched: list[np.ndarray], single: list[np.ndarray]) -> None:
    assert len(batched) == len(single)
    diff = np.abs(np.stack(batched).astype(np.int16) - np.stack(single))
    assert diff.max() <= 1, f"batched frames differ from single ones by up to {diff.max()}"


def _singles(pipe, params: dict[str, VideoParams]) -> dict[str, list[np.ndarray]]:
    """Each request alone (a batch of one: the pipeline's own call, as tests/e2e/test_videos.py checks)."""
    frames = {}
    for request_id, p in params.items():
        engine = GenerateVideoEngine(pipe, encoder="webp")
        got, _, failed = _run(engine, _task(request_id, p))
        assert not failed and engine.stats["batches_of_1"] == 1
        frames.update(got)
    return frames


# ------------------------------------------------------------------------------------ TextToVideoSD


@pytest.fixture(scope="module")
def video_pipe(tiny_video):
    return load_pipeline(tiny_video)


def test_text_to_video_batch_equals_single_runs_and_keeps_other_shapes_apart(video_pipe):
    shared = dict(width=64, height=48, num_frames=10, num_inference_steps=3, guidance_scale=7.5)
    params = {"a": VideoParams(prompt=PROMPTS[0], seed=3, negative_prompt="blurry", fps=5, **shared),
              "b": VideoParams(prompt=PROMPTS[1], seed=4, fps=8, **shared)}     # fps is the mux's only
    other = VideoParams(prompt=PROMPTS[0], seed=3, **{**shared, "width": 32})     # another size: its own batch
    single = _singles(video_pipe, params)
    assert np.abs(np.stack(single["a"]).astype(int) - np.stack(single["b"])).mean() > 1   # they really differ

    engine = GenerateVideoEngine(video_pipe, max_batch_size=4, encoder="webp")
    frames, fps, failed = _run(engine, _task("a", params["a"]), _task("c", other), _task("b", params["b"]))
    assert not failed and set(frames) == {"a", "b", "c"}
    assert engine.stats["batches"] == 2 and engine.stats["batches_of_2"] == engine.stats["batches_of_1"] == 1
    # one loop for a and b: prompt + 3 steps + 2 decode slices, then c's on its own; one mux per video
    assert engine.stats["denoise_steps"] == 6 and engine.stats["decode_steps"] == 4 and engine.stats["mux_steps"] == 3
    assert (fps["a"], fps["b"]) == (5, 8) and frames["c"][0].shape == (48, 32, 3)
    for request_id in params:
        _assert_same_frames(frames[request_id], single[request_id])


def test_max_batch_size_caps_the_batch_and_the_default_is_one(video_pipe):
    p = VideoParams(prompt=PROMPTS[0], width=32, height=32, num_frames=2, num_inference_steps=1, seed=1)
    engine = GenerateVideoEngine(video_pipe, max_batch_size=2, encoder="webp")
    frames, _, failed = _run(engine, *(_task(f"r{i}", p) for i in range(3)))
    assert not failed and len(frames) == 3 and engine.stats["batches_of_2"] == engine.stats["batches_of_1"] == 1
    default = GenerateVideoEngine(video_pipe, encoder="webp")
    _run(default, *(_task(f"r{i}", p) for i in range(2)))
    assert default.max_batch_size == 1 and default.stats["batches_of_1"] == 2
    with pytest.raises(ValueError):
        GenerateVideoEngine(video_pipe, max_batch_size=0)


# ------------------------------------------------------------------------------------ Wan


@pytest.fixture(scope="module")
def wan_pipe(tiny_wan):
    return load_pipeline(tiny_wan)


def _wan_params(prompt: str, seed: int, **kwargs) -> VideoParams:
    fields = dict(width=64, height=48, num_frames=9, num_inference_steps=4, guidance_scale=4.0, fps=16)
    return VideoParams(prompt=prompt, seed=seed, **{**fields, **kwargs})


def test_wan_batch_equals_single_runs(wan_pipe):
    params = {"a": _wan_params(PROMPTS[0], 3, negative_prompt="blurry"), "b": _wan_params(PROMPTS[1], 4)}
    single = _singles(wan_pipe, params)
    assert np.abs(np.stack(single["a"]).astype(int) - np.stack(single["b"])).mean() > 1
    engine = GenerateVideoEngine(wan_pipe, max_batch_size=2, encoder="webp")
    frames, _, failed = _run(engine, *(_task(rid, p) for rid, p in params.items()))
    assert not failed and engine.stats["batches_of_2"] == 1 and engine.stats["denoise_steps"] == 4
    for request_id in params:
        _assert_same_frames(frames[request_id], single[request_id])
    # the whole-call runner batches through the pipeline's own lists of prompts and generators
    whole = GenerateVideoEngine(wan_pipe, max_batch_size=2, runner=WholeCallVideoRunner(wan_pipe), encoder="webp")
    frames, _, failed = _run(whole, *(_task(rid, p) for rid, p in params.items()))
    assert not failed and whole.stats["batches_of_2"] == 1
    for request_id in params:
        _assert_same_frames(frames[request_id], single[request_id])


def test_a_request_leaving_a_wan_batch_mid_denoise_leaves_the_others_as_they_were(wan_pipe):
    """A cancel and a deadline cut rows out of the latents and out of UniPC's multistep history;
    the rows left make the frames they make alone."""
    params = {"a": _wan_params(PROMPTS[0], 3, negative_prompt="blurry"), "b": _wan_params(PROMPTS[1], 4)}
    single = _singles(wan_pipe, params)
    clock = [1000.0]
    engine = GenerateVideoEngine(wan_pipe, max_batch_size=4, encoder="webp", clock=lambda: clock[0])
    for task in (_task("gone", _wan_params("a lighthouse in a storm", 5), 5000), _task("a", params["a"], 5000),
                 _task("late", _wan_params("a cat on a windowsill", 6), 1500), _task("b", params["b"], 5000)):
        engine.add(task)
    for _ in range(3):                 # prompt + 2 of 4 denoising steps: UniPC holds a past model output
        assert not engine.step().failed
    job = engine.job
    assert [t.request_id for t in job.tasks] == ["gone", "a", "late", "b"] and job.step_index == 2
    assert any(out is not None and out.shape[0] == 4 for out in job.scheduler.model_outputs)
    assert engine.cancel("gone") and engine.stats["cancelled_running"] == 1
    assert [t.request_id for t in job.tasks] == ["a", "late", "b"] and job.latents.shape[0] == 3
    assert all(out is None or out.shape[0] == 3 for out in job.scheduler.model_outputs)
    clock[0] = 2000.0                  # past late's deadline: it fails at the next step, the others go on
    frames, _, failed = _run(engine)
    assert [(f.request_id, f.error_type) for f in failed] == [("late", "deadline_exceeded")]
    assert set(frames) == {"a", "b"} and engine.stats["denoise_steps"] == 4
    for request_id in params:
        _assert_same_frames(frames[request_id], single[request_id])


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def cluster(tiny_video, tmp_path_factory):
    """A worker batching up to 3 videos: one long video to keep it busy while two more queue up."""
    tmp = tmp_path_factory.mktemp("video-batch-cluster")
    with pipeline_cluster(tiny_video, str(tmp), "tiny-video", batched_pipeline(PIPELINE_YAML, tmp, 3),
                          ("generate",)) as cluster:
        yield cluster


def _create(client, prompt: str, **extra):
    size = extra.pop("size")
    return client.videos.create(model="tiny-video", prompt=prompt, size=size, extra_body=extra)


def _wait(client, video_id: str):
    return wait_for_video(client, video_id, timeout=120.0, poll_s=0.05)


def _wait_for_worker(cluster, condition, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        [worker] = cluster.workers()
        if condition(worker):
            return worker
        assert time.monotonic() < deadline, f"the worker never {what}: {worker}"
        time.sleep(0.1)


@pytest.mark.slow   # three processes and four videos: over a minute on a loaded 2-core host
def test_two_videos_through_the_gateway_run_as_one_batch_and_equal_single_runs(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # The worker denoises a long video of another size (its own batch of one) ...
    blocker = _create(client, PROMPTS[0], size="64x48", num_frames=16, seed=1, num_inference_steps=150)
    _wait_for_worker(cluster, lambda w: w["running"] == 1, "started the long video")
    # ... while two same-shape videos queue behind it; once it is cancelled they are admitted together.
    pair = dict(size="32x32", num_frames=4, num_inference_steps=3, guidance_scale=7.5)
    a = _create(client, PROMPTS[0], seed=7, negative_prompt="blurry", **pair)
    b = _create(client, PROMPTS[1], seed=8, **pair)
    _wait_for_worker(cluster, lambda w: w["running"] == 1 and w["waiting"] == 2, "queued the two videos")
    assert client.videos.delete(blocker.id).deleted
    done = [_wait(client, v.id) for v in (a, b)]
    assert [v.status for v in done] == ["completed", "completed"], [v.error for v in done]
    worker = _wait_for_worker(cluster, lambda w: w["running"] + w["waiting"] == 0, "went idle")
    stats = worker["stats"]
    assert stats["batches_of_2"] == 1 and stats["batches_of_1"] == 1 and stats["batches"] == 2, stats
    assert stats["cancelled_running"] == 1
    batched = {v.id: client.videos.download_content(v.id).read() for v in (a, b)}
    # The same requests one at a time: batches of one on the same worker.
    alone = [_wait(client, _create(client, PROMPTS[0], seed=7, negative_prompt="blurry", **pair).id),
             _wait(client, _create(client, PROMPTS[1], seed=8, **pair).id)]
    assert [v.status for v in alone] == ["completed", "completed"]
    # A heartbeat carries the counters: wait for the one after the two single runs, then check them.
    stats = _wait_for_worker(cluster, lambda w: w["stats"].get("batches", 0) >= 4, "reported the single runs")["stats"]
    assert stats["batches_of_1"] == 3 and stats["batches"] == 4, stats
    for together, single in zip((a, b), alone):
        data = client.videos.download_content(single.id).read()
        if data != batched[together.id]:   # float rounding moved a pixel: the decoded frames stay close
            mime = "video/mp4" if data[4:8] == b"ftyp" else "image/webp"
            x, _ = decode_frames(data, mime)
            y, _ = decode_frames(batched[together.id], mime)
            assert len(x) == len(y) == 4 and np.abs(np.stack(x).astype(int) - np.stack(y)).mean() < 1
    assert batched[a.id] != batched[b.id]
