"""Video jobs keep their own deadline (gateway/routes/videos.py): a job runs up to its video timeout
while it makes progress, fails after a stall without any, and the error names where it was. The
real ``VideoStream`` fed the worker's wire messages (progress reports, chunks) on a real event loop."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from omnirelay.broker import protocol as p
from omnirelay.errors import DeadlineExceeded
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.deploy.serve import PASSED_TO_GATEWAY
from omnirelay.gateway.routes.videos import VideoJob, VideoStream
from omnirelay.video_params import PROGRESS_MIME, VideoParams

PARAMS = VideoParams(prompt="a fox", width=64, height=48, num_frames=6, seed=3, num_inference_steps=3)


def progress(percent: int) -> p.MediaResult:
    return p.MediaResult("v", -1, PROGRESS_MIME, str(percent))


def chunk(index: int, finish: bool) -> p.MediaResult:
    return p.MediaResult("v", index, "video/mp4", base64.b64encode(b"part%d" % index).decode(), finish=finish)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_job_that_keeps_progressing_outlives_the_stall_bound():
    async def scenario() -> bytes:
        job = VideoJob("v", "tiny-video", PARAMS, "1", 0)
        stream = VideoStream("v", time.time() + 3600, job, stall_s=0.5)
        waiting = asyncio.ensure_future(stream.wait())
        for percent in range(0, 100, 5):      # 20 reports 0.1 s apart: 2 s, four stall bounds
            await asyncio.sleep(0.1)
            assert not waiting.done()
            stream.on_media(progress(percent))
        stream.on_media(chunk(0, False))
        stream.on_media(chunk(1, True))
        return await waiting

    assert run(scenario()) == b"part0part1"


def test_a_stalled_job_fails_naming_its_stage_and_progress():
    async def scenario(job: VideoJob, feed) -> DeadlineExceeded:
        stream = VideoStream("v", time.time() + 3600, job, stall_s=0.3, stage="generate")
        feed(stream)
        with pytest.raises(DeadlineExceeded) as caught:
            await stream.wait()
        return caught.value

    error = run(scenario(VideoJob("v", "m", PARAMS, "1", 0), lambda s: s.on_media(progress(77))))
    assert error.stage == "generate" and "in stage generate (denoising, 77 %)" in error.message
    assert "no progress for 0.3 s (--video-stall-timeout)" in error.message
    error = run(scenario(VideoJob("v", "m", PARAMS, "1", 0), lambda s: s.on_media(chunk(0, False))))
    assert "in stage generate (sending the file" in error.message
    # The job's error carries it (OpenAI's {code, message}).
    job = VideoJob("v", "m", PARAMS, "1", 0)
    job.finish("failed", time.time(), 60, error)
    assert job.error["code"] == "deadline_exceeded" and "sending the file" in job.error["message"]


def test_a_queued_job_waits_its_turn_under_the_video_timeout_alone():
    async def scenario() -> tuple[bool, DeadlineExceeded]:
        stream = VideoStream("v", time.time() + 1.0, VideoJob("v", "m", PARAMS, "1", 0), stall_s=0.1)
        waiting = asyncio.ensure_future(stream.wait())
        await asyncio.sleep(0.5)            # five stall bounds in the broker's queue: still waiting
        alive = not waiting.done()
        with pytest.raises(DeadlineExceeded) as caught:
            await waiting
        return alive, caught.value

    alive, error = run(scenario())
    assert alive and error.stage == "" and "video timeout" in error.message and "queued" in error.message


def test_the_video_timeout_ends_a_job_that_still_progresses():
    async def scenario() -> DeadlineExceeded:
        job = VideoJob("v", "m", PARAMS, "1", 0)
        stream = VideoStream("v", time.time() + 0.5, job, stall_s=3600)

        async def feed():
            for percent in range(100):
                stream.on_media(progress(percent))
                await asyncio.sleep(0.05)

        feeder = asyncio.ensure_future(feed())
        try:
            with pytest.raises(DeadlineExceeded) as caught:
                await stream.wait()
        finally:
            feeder.cancel()
        return caught.value

    error = run(scenario())
    assert "video timeout" in error.message and "in stage generate (denoising" in error.message


def test_the_video_timeout_is_a_gateway_setting_hours_by_default(tmp_path):
    model = ServedModel(name="m", path=str(tmp_path))
    assert GatewayConfig(models=(model,)).video_timeout_s >= 3600
    with pytest.raises(ValueError, match="video_timeout_s"):
        GatewayConfig(models=(model,), video_timeout_s=0)
    with pytest.raises(ValueError, match="video_stall_timeout_s"):
        GatewayConfig(models=(model,), video_stall_timeout_s=-1)
    # omni-serve hands them on
    assert "video_timeout_s" in PASSED_TO_GATEWAY and "video_stall_timeout_s" in PASSED_TO_GATEWAY
