"""Video end to end: the tiny text-to-video pipeline, the video engine and role (progress, cancel,
chunking), the gateway's job store, and ``/v1/videos`` through the official ``openai`` client
against a real cluster (broker, one generate worker, gateway as separate processes).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pathlib
import socket
import time
import urllib.parse

import msgspec
import numpy as np
import openai
import pytest
import requests
import torch
from PIL import Image

from omnirelay.broker import protocol as p
from omnirelay.deploy.builders.video import build_tiny_text_to_video
from omnirelay.errors import BadRequest, NotFound, Overloaded, Unprocessable
from omnirelay.image_params import ImageParams
from omnirelay.request_params import RequestParams
from omnirelay.video_params import MAX_CHUNK_CHARS, PROGRESS_MIME, VideoParams
from omnirelay.workers.generate.video import GenerateVideoEngine, VideoTask, encode_video, video_encoder
from omnirelay.workers.generate.video_role import GenerateVideoRole

from cluster import settled_workers
from media_fixtures import client_fixture, cluster_fixture, pipeline_file, pipeline_fixture, tiny_model_fixture
from media_support import create_video, decode_frames, decode_params, run_engine, wait_for_video

MODEL = "tiny-video"
PIPELINE_YAML = pipeline_file("text_to_video")
PROMPT = "a red fox sitting in the snow at dawn"
# The client warns that OpenAI's hosted video API will be retired; the API shape is what we serve.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


tiny_video = tiny_model_fixture(MODEL, build_tiny_text_to_video)
pipe = pipeline_fixture("tiny_video")


def _params(**kwargs) -> VideoParams:
    fields = dict(prompt=PROMPT, width=64, height=48, num_frames=6, seed=3, num_inference_steps=3)
    return VideoParams(**{**fields, **kwargs})


def _run(engine: GenerateVideoEngine, *tasks: VideoTask, max_steps: int = 500):
    """(videos, progress reports, failures) of stepping the engine dry."""
    outputs = run_engine(engine, *tasks, max_steps=max_steps)
    videos = [video for out in outputs for video in out.videos]
    progress = [report for out in outputs for report in out.progress]
    return videos, progress, [failure for out in outputs for failure in out.failed]


# ------------------------------------------------------------------------------------ the model


def test_tiny_video_pipeline_loads_offline_and_makes_moving_frames(tiny_video, pipe, tmp_path, capsys):
    from diffusers import DiffusionPipeline
    from omnirelay.deploy.builders.llm import main

    assert type(pipe).__name__ == "TextToVideoSDPipeline"
    video = pipe(PROMPT, num_frames=4, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                 output_type="np").frames[0]
    assert video.shape == (4, 64, 64, 3)            # the native size: an 8×8 latent per frame
    assert video.std() > 0.1, "a random-weight VAE should still spread pixels over the range"
    assert np.abs(video[0] - video[-1]).mean() > 0.01, "frames should differ from each other"
    # omni-make-model tiny-video writes the same weights for the same seed, and refuses to overwrite.
    assert main(["tiny-video", str(tmp_path / "again")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "again")
    for weights in sorted(pathlib.Path(tiny_video).rglob("*.safetensors")):
        assert (tmp_path / "again" / weights.relative_to(tiny_video)).read_bytes() == weights.read_bytes(), weights
    assert main(["tiny-video", str(tmp_path / "again")]) == 2
    reloaded = DiffusionPipeline.from_pretrained(str(tmp_path / "again"), local_files_only=True)
    assert type(reloaded).__name__ == "TextToVideoSDPipeline"


# ------------------------------------------------------------------------------------ the engine


def test_engine_equals_the_pipeline_call_reports_progress_and_is_deterministic(pipe):
    engine = GenerateVideoEngine(pipe, encoder="webp")   # lossless, so frames compare with the pipeline's
    params = _params(num_frames=10, negative_prompt="blurry", fps=5)
    [video], progress, failed = _run(engine, VideoTask("r1", params, time.time() + 120))
    assert not failed and video.mime == "image/webp" and video.frames == 10
    # prompt + 3 denoising steps + 2 decode slices (8 + 2 frames), then the mux
    assert engine.stats["denoise_steps"] == 3 and engine.stats["decode_steps"] == 2
    percents = [u.percent for u in progress]
    assert len(percents) == 6 and percents == sorted(set(percents)) and 0 < percents[0] and percents[-1] < 100
    frames, fps = decode_frames(video.data, video.mime)
    assert len(frames) == 10 and frames[0].shape == (48, 64, 3) and fps == 5
    reference = pipe(PROMPT, negative_prompt="blurry", num_frames=10, width=64, height=48, num_inference_steps=3,
                     generator=torch.Generator().manual_seed(3), output_type="np").frames[0]
    reference = (np.clip(reference, 0, 1) * 255).round()
    assert np.abs(np.stack(frames).astype(np.float64) - reference).max() <= 1   # decode slices vs all at once

    mp4 = GenerateVideoEngine(pipe)
    first, _, _ = _run(mp4, VideoTask("a", params, time.time() + 120))
    again, _, _ = _run(mp4, VideoTask("b", params, time.time() + 120))
    other, _, _ = _run(mp4, VideoTask("c", _params(num_frames=10, negative_prompt="blurry", fps=5, seed=4),
                                      time.time() + 120))
    assert first[0].data == again[0].data != other[0].data
    assert first[0].mime == ("video/mp4" if video_encoder() == "mp4" else "image/webp")


def test_whole_call_runner_makes_the_same_video_in_one_step(pipe):
    from omnirelay.workers.generate.video import WholeCallVideoRunner

    params = _params(num_frames=4, num_inference_steps=2)
    stepwise, _, _ = _run(GenerateVideoEngine(pipe, encoder="webp"), VideoTask("a", params, time.time() + 120))
    engine = GenerateVideoEngine(pipe, runner=WholeCallVideoRunner(pipe), encoder="webp")
    whole, progress, failed = _run(engine, VideoTask("b", params, time.time() + 120))
    assert not failed and engine.stats["prompt_steps"] == engine.stats["mux_steps"] == 1 and len(progress) == 1
    a, b = (decode_frames(v[0].data, v[0].mime)[0] for v in (stepwise, whole))
    assert len(b) == 4 and np.abs(np.stack(a).astype(int) - np.stack(b)).max() <= 1


@pytest.mark.skipif(video_encoder() != "mp4", reason="PyAV is not installed: the worker serves animated WebP")
def test_mp4_encoding_is_h264_of_the_requested_size_and_rate():
    rng = np.random.default_rng(0)
    frames = list((rng.random((5, 32, 48, 3)) * 255).astype(np.uint8))
    data, mime = encode_video(frames, 7, "mp4")
    assert mime == "video/mp4" and data[4:8] == b"ftyp"
    decoded, fps = decode_frames(data, mime)
    assert len(decoded) == 5 and decoded[0].shape == (32, 48, 3) and fps == 7
    assert encode_video(frames, 7, "mp4")[0] == data


@pytest.mark.skipif(video_encoder() != "mp4", reason="PyAV is not installed: the worker serves animated WebP")
def test_the_same_request_gets_the_same_mp4_bytes_every_time(pipe):
    """The serving loop's own encodes, each after a denoising run, as a worker makes them. With x264's
    B-frames on, most of these came out different (an AVX-512 host), although the frames were equal."""
    engine = GenerateVideoEngine(pipe)
    params = _params(num_frames=8, seed=5, num_inference_steps=12, fps=4)
    files = set()
    for attempt in range(6):
        [video], _, failed = _run(engine, VideoTask(f"r{attempt}", params, time.time() + 120))
        assert not failed
        files.add(video.data)
    assert len(files) == 1


def test_cancel_stops_denoising_and_the_next_job_runs(pipe):
    clock = [1000.0]
    engine = GenerateVideoEngine(pipe, clock=lambda: clock[0])
    engine.add(VideoTask("long", _params(num_inference_steps=50), 2000))
    engine.add(VideoTask("next", _params(num_inference_steps=2), 2000))
    engine.add(VideoTask("late", _params(num_inference_steps=2), 1001))
    for _ in range(4):          # prompt + 3 of 50 denoising steps
        engine.step()
    assert [t.request_id for t in engine.job.tasks] == ["long"] and engine.job.step_index == 3
    assert engine.cancel("long") and engine.job is None and not engine.cancel("long")
    clock[0] = 1500.0
    videos, _, failed = _run(engine)
    assert [v.request_id for v in videos] == ["next"]
    assert [(f.request_id, f.error_type) for f in failed] == [("late", "deadline_exceeded")]
    assert engine.stats["denoise_steps"] == 5 and engine.stats["cancelled_running"] == 1
    engine.add(VideoTask("dup", _params(), 2000))
    with pytest.raises(ValueError):
        engine.add(VideoTask("dup", _params(), 2000))
    engine.vae_scale_factor = 16      # as if the VAE had one more level: 48 pixels is no longer whole latents
    with pytest.raises(BadRequest):
        engine.add(VideoTask("odd", _params(width=40), 2000))
    engine.cancel("dup")
    assert not engine.has_work


def test_video_params_validate_on_both_sides():
    """Where the gateway builds them (a 400) and where the bus decodes them (a malformed message)."""
    params = _params(guidance_scale=2)
    assert decode_params(params) == params and decode_params(params).guidance_scale == 2.0
    good = msgspec.to_builtins(params)
    with pytest.raises(BadRequest, match="guidance_scale"):
        _params(guidance_scale=float("inf"))
    for bad in ({**good, "prompt": ""}, {**good, "width": 65}, {**good, "height": 0}, {**good, "num_frames": 0},
                {**good, "num_frames": 241}, {**good, "fps": 0}, {**good, "num_inference_steps": 151},
                {**good, "guidance_scale": float("inf")}, {**good, "seed": -1}, {**good, "seed": True},
                {**good, "surprise": 1}, {k: v for k, v in good.items() if k != "seed"}, ["prompt"]):
        with pytest.raises(msgspec.ValidationError):
            decode_params(bad, VideoParams)


# ------------------------------------------------------------------------------------ role and bus


def _task(request_id: str, params: RequestParams, attempt: int = 0) -> p.Task:
    return p.Task(request_id=request_id, stage="generate", model=MODEL, prompt_token_ids=[], params=params,
                  inputs=None, reply_to="tcp://127.0.0.1:1", deadline=time.time() + 60, attempt=attempt)


def test_role_sends_progress_then_chunks_that_the_gateway_joins(pipe):
    from omnirelay.gateway.routes.videos import VideoJob, VideoStream

    role = GenerateVideoRole("gen-1", GenerateVideoEngine(pipe), chunk_chars=4096)
    [(dest, failure)] = role.accept(_task("bad", ImageParams("a picture")))   # not what it serves
    assert dest == "" and failure.error_type == "bad_request" and "ImageParams" in failure.message
    params = _params(num_frames=16, num_inference_steps=2)
    assert role.accept(_task("ok", params, attempt=2)) == []
    out = []
    while role.engine.has_work:
        out += role.step()
    to_gateway = [msg for dest, msg in out if dest]
    progress = [m for m in to_gateway if m.mime == PROGRESS_MIME]
    chunks = [m for m in to_gateway if m.mime != PROGRESS_MIME]
    assert [int(m.data) for m in progress] == sorted({int(m.data) for m in progress}) and len(progress) >= 3
    assert len(chunks) > 2, "a video over one chunk is split"
    assert [m.index for m in chunks] == list(range(len(chunks))) and [m.finish for m in chunks][-2:] == [False, True]
    assert all(len(m.data) <= 4096 for m in chunks)
    [(dest, done)] = [(d, m) for d, m in out if not d]
    assert isinstance(done, p.StageDone) and done.finished and done.attempt == 2
    assert out[-1][1] is done, "StageDone comes after the last chunk"

    async def join() -> bytes:
        job = VideoJob("ok", MODEL, params, "2", 0)
        stream = VideoStream("ok", time.time() + 10, job)
        for msg in progress + chunks[::-1]:          # chunks out of order, all through the wire codec
            stream.on_media(p.decode(p.encode(msg)))
            stream.on_media(p.decode(p.encode(msg)))   # duplicates are dropped
        assert job.status == "in_progress" and 0 < job.progress < 100
        return await asyncio.wait_for(stream.wait(), 5)

    data = asyncio.run(join())
    assert data == base64.b64decode("".join(m.data for m in chunks))
    frames, _ = decode_frames(data, chunks[0].mime)
    assert len(frames) == 16 and frames[0].shape == (48, 64, 3)

    # A full-size chunk fits one bus message; a video over the worker's limit fails instead of vanishing.
    big = p.MediaResult("x", 0, "video/mp4", "A" * MAX_CHUNK_CHARS, finish=True)
    assert p.decode(p.encode(big)) == big
    small = GenerateVideoRole("gen-2", role.engine, max_video_bytes=100)
    small.accept(_task("huge", params))
    out = []
    while small.engine.has_work:
        out += small.step()
    assert [(type(m).__name__, getattr(m, "error_type", "")) for d, m in out if not d] == \
        [("StageFailed", "payload_too_large")]
    assert not [m for d, m in out if d and m.mime != PROGRESS_MIME]


def test_job_store_is_bounded_and_finished_jobs_expire():
    from omnirelay.gateway.routes.videos import VideoJob, VideoJobs

    clock = [100.0]
    jobs = VideoJobs(max_jobs=2, ttl_s=60, max_bytes=10, clock=lambda: clock[0])
    a, b, c = (VideoJob(name, MODEL, _params(), "1", 100) for name in "abc")
    jobs.add(a)
    jobs.add(b)
    with pytest.raises(Overloaded):
        jobs.add(c)                       # both unfinished: nothing to evict
    a.content = b"12345678"
    a.finish("completed", clock[0], jobs.ttl_s)
    assert a.to_json()["expires_at"] == 160 and a.to_json()["progress"] == 100
    jobs.add(c)                           # evicts the finished a
    with pytest.raises(NotFound):
        jobs.get("a")
    b.content = b"123456"
    c.content = b"123456"                 # 12 bytes held > 10: the oldest content goes
    b.finish("completed", clock[0], jobs.ttl_s)
    c.finish("completed", clock[0] + 1, jobs.ttl_s)
    jobs.purge()
    assert list(jobs.jobs) == ["c"]
    clock[0] = 161.0
    with pytest.raises(NotFound):
        jobs.get("c")                     # past its TTL


def test_parse_video_request_takes_json_and_form_fields():
    from omnirelay.gateway.routes.videos import parse_video_request

    form = parse_video_request({"prompt": "x", "size": "64x48", "seconds": "2", "seed": "7", "guidance_scale": "1.5"})
    assert (form.size, form.seconds, form.fields) == ((64, 48), "2", {"seed": 7, "guidance_scale": 1.5})
    assert parse_video_request({"prompt": "x", "seconds": 4, "fps": 8}).fields == {"fps": 8}
    for bad in ({"prompt": "x", "seed": "seven"}, {"prompt": "x", "seed": 1.5}, {"prompt": "x", "size": "big"},
                {"prompt": "x", "seconds": "0"}, {"prompt": " "}, {}, ["prompt"]):
        with pytest.raises(BadRequest):
            parse_video_request(bad)
    with pytest.raises(Unprocessable):
        parse_video_request({"prompt": "x", "input_reference": "<file>"})


# ------------------------------------------------------------------------------------ end to end


cluster = cluster_fixture("tiny_video", MODEL, PIPELINE_YAML, "videos-cluster")
client = client_fixture()


def _create(client, model: str = MODEL, prompt: str = PROMPT, **kwargs):
    return create_video(client, model, prompt, **kwargs)


def _wait(client, video_id: str, timeout: float = 60.0, seen: set | None = None):
    return wait_for_video(client, video_id, timeout, poll_s=0.05, seen=seen)


def test_video_job_lifecycle_through_the_openai_client(client):
    assert MODEL in [m.id for m in client.models.list().data]
    video = _create(client, size="64x48", seconds="2", fps=4, seed=5, num_inference_steps=12)
    assert (video.object, video.status, video.progress, video.model) == ("video", "queued", 0, MODEL)
    assert (video.size, video.seconds, video.error) == ("64x48", "2", None) and video.created_at > 0
    seen: set = set()
    done = _wait(client, video.id, seen=seen)
    assert done.status == "completed" and done.progress == 100 and done.expires_at > done.completed_at
    assert any(status == "in_progress" and 0 < progress < 100 for status, progress in seen), seen
    content = client.videos.download_content(video.id)
    data = content.read()
    mime = content.response.headers["content-type"]
    frames, fps = decode_frames(data, mime)
    assert len(frames) == 8 and frames[0].shape == (48, 64, 3) and fps == 4    # 2 s at 4 fps
    assert np.stack(frames).std() > 10
    # Same seed, same bytes; the job list has both, newest first.
    again = _wait(client, _create(client, size="64x48", seconds="2", fps=4, seed=5, num_inference_steps=12).id)
    assert client.videos.download_content(again.id).read() == data
    listed = [v.id for v in client.videos.list(limit=2).data]
    assert listed == [again.id, video.id]
    # Deleting a finished video removes it.
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_cancel_mid_run_reaches_the_worker_and_frees_it(client, cluster):
    video = _create(client, size="64x48", num_frames=16, seed=1, num_inference_steps=150)   # ~20 s of work
    deadline = time.monotonic() + 30
    while client.videos.retrieve(video.id).status != "in_progress":
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(video.id)      # nothing to download yet
    assert client.videos.delete(video.id).deleted
    cancelled = client.videos.retrieve(video.id)
    assert cancelled.status == "cancelled" and cancelled.progress < 100
    # The worker's figures travel in heartbeats: read once the cluster says they are final (it has
    # handled the cancel and holds nothing).
    [worker] = settled_workers(cluster.url)
    assert worker["running"] + worker["waiting"] == 0 and worker["stats"].get("cancelled_running", 0) >= 1, worker
    assert worker["stats"]["denoise_steps"] < 150 + 2 * 12, "the cancelled video was not denoised to the end"
    quick = _wait(client, _create(client, size="32x32", num_frames=2, seed=2, num_inference_steps=1).id)
    assert quick.status == "completed"
    assert client.videos.retrieve(video.id).status == "cancelled"


@pytest.mark.parametrize("kwargs, status, param", [
    ({"size": "65x64"}, 400, "size"),
    ({"size": "big"}, 400, "size"),
    ({"size": "4096x4096"}, 400, "size"),
    ({"seconds": "0"}, 400, "seconds"),
    ({"num_frames": 1000}, 400, "num_frames"),
    ({"num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": ""}, 400, "prompt"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_bad_video_requests_get_openai_errors(client, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        _create(client, **{"num_inference_steps": 1, **kwargs})
    assert info.value.status_code == status
    error = info.value.body["error"] if "error" in info.value.body else info.value.body
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("part", [
    b'Content-Disposition: form-data; name="prompt"\r\nBad Header\r\n\r\nclouds\r\n',   # no colon
    b'Content-Disposition: form-data; name="prompt"\r\n\x00: x\r\n\r\nclouds\r\n',     # a NUL name
])
def test_a_malformed_multipart_part_is_a_400(cluster, part):
    body = b"--XyZ\r\n" + part + b"--XyZ--\r\n"
    response = requests.post(cluster.url + "/v1/videos", data=body, timeout=30,
                             headers={"Content-Type": "multipart/form-data; boundary=XyZ"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("malformed form body")


def test_unknown_videos_are_404_and_json_bodies_work_too(client, cluster):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_nope")
    response = requests.post(cluster.url + "/v1/videos", timeout=30, json={
        "prompt": PROMPT, "size": "32x32", "num_frames": 2, "num_inference_steps": 1, "seed": 9})
    assert response.status_code == 200 and response.json()["status"] == "queued"
    assert _wait(client, response.json()["id"]).status == "completed"
    chat = requests.post(cluster.url + "/v1/chat/completions", timeout=30,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 422
    doc = requests.get(cluster.url + "/openapi.json", timeout=10).json()
    assert {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content"} <= set(doc["paths"])
    create = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert create["properties"]["model"]["enum"] == [MODEL]


def test_sync_video_answers_with_the_file_of_the_same_job(client, cluster):
    """POST /v1/videos/sync: the same request as a job, answered with the same bytes, and no job kept."""
    job = _wait(client, _create(client, size="32x32", num_frames=4, seed=11, num_inference_steps=2).id)
    expected = client.videos.download_content(job.id).read()
    response = requests.post(cluster.url + "/v1/videos/sync", timeout=60, data={
        "model": MODEL, "prompt": PROMPT, "size": "32x32", "num_frames": "4", "seed": "11",
        "num_inference_steps": "2"})
    assert response.status_code == 200, response.text
    assert response.content == expected
    assert response.headers["content-type"] in ("video/mp4", "image/webp")
    video_id = response.headers["X-Request-Id"]
    assert video_id.startswith("video_") and video_id in response.headers["Content-Disposition"]
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video_id)
    bad = requests.post(cluster.url + "/v1/videos/sync", timeout=30,
                        json={"model": MODEL, "prompt": PROMPT, "num_inference_steps": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_inference_steps"


def test_sync_video_client_that_leaves_cancels_the_generation(cluster):
    """A client that closes its connection while its video is being denoised stops the worker."""
    [before] = cluster.workers()
    cancelled_before = before["stats"].get("cancelled_running", 0)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "size": "64x48", "num_frames": 16, "seed": 3,
                       "num_inference_steps": 150}).encode()
    host, port = urllib.parse.urlsplit(cluster.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/videos/sync HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while cluster.workers()[0]["running"] == 0:   # leave only once the worker is denoising it
            assert time.monotonic() < deadline, "the video never started"
            time.sleep(0.05)
    [worker] = settled_workers(cluster.url)   # it has handled the cancel and holds nothing
    assert worker["running"] + worker["waiting"] == 0, worker
    assert worker["stats"].get("cancelled_running", 0) > cancelled_before, worker
    assert worker["stats"]["denoise_steps"] - before["stats"].get("denoise_steps", 0) < 150
