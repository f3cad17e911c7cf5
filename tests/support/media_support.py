"""What the media end-to-end and fault tests set up alike: a tiny model built once per test module,
a cluster (broker, workers, gateway) serving one pipeline file, a kill -9 of the busiest worker, the
wait for a video job to end; for the Omni tests, image and audio request parts and transformers'
greedy thinker as the reference.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pathlib
import time
import wave
from typing import Callable, Iterator

import numpy as np
import pytest
import yaml
from PIL import Image

from cluster import Cluster


def tiny_model_dir(tmp_path_factory, name: str, build: Callable) -> str:
    """``build(DIR, seed=0)`` into a fresh temporary ``models/name``; the directory's path."""
    return str(build(tmp_path_factory.mktemp("models") / name, seed=0))


def batched_pipeline(pipeline: str | pathlib.Path, directory: pathlib.Path, max_batch_size: int) -> str:
    """A copy of the pipeline file ``pipeline`` in ``directory`` whose first stage batches up to
    ``max_batch_size`` requests; its path."""
    stages = yaml.safe_load(pathlib.Path(pipeline).read_text())
    stages["stages"][0]["runtime"]["max_batch_size"] = max_batch_size
    path = directory / f"{pathlib.Path(pipeline).stem}_batch{max_batch_size}.yaml"
    path.write_text(yaml.safe_dump(stages))
    return str(path)


@contextlib.contextmanager
def pipeline_cluster(model: str, log_dir: str, model_name: str, pipeline: str, roles: tuple[str, ...],
                     start_timeout: float | None = None) -> Iterator[Cluster]:
    """A broker, one worker per entry of ``roles`` and a gateway, all on ``pipeline``, healthy and with
    every worker registered; stopped (every process it started) on exit. ``start_timeout`` replaces
    the default waits for a pipeline slow to load."""
    waits = {} if start_timeout is None else {"timeout": start_timeout}
    with Cluster(model=model, log_dir=log_dir, model_name=model_name) as cluster:
        cluster.start_broker()
        for role in roles:
            cluster.start_worker(role, "--stage-configs-path", pipeline)
        cluster.start_gateway("--stage-configs-path", pipeline)
        cluster.wait_healthy(**waits)
        cluster.wait_for_workers(len(roles), **waits)
        yield cluster


def openai_client(cluster, timeout: float):
    """The official client on ``cluster``'s gateway; no retries, so a test sees every failure."""
    import openai

    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def run_engine(engine, *tasks, max_steps: int) -> list:
    """Add ``tasks`` and step the generate engine (image or video) until it has no work: every step's
    output, in order. The engine must hold nothing after."""
    for task in tasks:
        engine.add(task)
    outputs = []
    for _ in range(max_steps):
        if not engine.has_work:
            break
        outputs.append(engine.step())
    assert not engine.has_work and not engine.num_requests
    return outputs


def decode_params(params, kind: type | None = None):
    """``params`` (a params struct, or a raw map of ``kind``) through the bus codec: what a worker
    receives, decoded and checked; ``msgspec.ValidationError`` for what the bus refuses."""
    import msgspec

    if kind is None:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=type(params))
    raw = {**params, "type": msgspec.inspect.type_info(kind).tag} if isinstance(params, dict) else params
    return msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=kind)


def run_image_engine(engine, *tasks, max_steps: int):
    """:func:`run_engine` on an image engine: (every image made, every failure)."""
    outputs = run_engine(engine, *tasks, max_steps=max_steps)
    return [image for out in outputs for image in out.images], [failure for out in outputs for failure in out.failed]


def kill_busiest_worker(cluster: Cluster, killed: dict, role: str | None = None, wait_s: float = 10.0) -> None:
    """kill -9 the worker (of ``role``, if given) holding the most tasks by the broker's own record
    (``assigned``: set at dispatch, so no heartbeat lag), asking the cluster again (each answer is
    a round trip, no sleep) for up to ``wait_s`` until one holds any; record its tasks under
    ``killed["busy"]`` and the process under ``killed["proc"]``."""
    deadline = time.monotonic() + wait_s
    while True:
        workers = [w for w in cluster.workers() if role is None or w["role"] == role]
        busiest = max(workers, key=lambda w: (w["assigned"], w["running"] + w["waiting"]))
        if busiest["assigned"] or time.monotonic() > deadline:
            break
    killed["busy"] = busiest["assigned"]
    killed["proc"] = next(proc for proc in cluster.procs if proc.pid == busiest["pid"])
    killed["proc"].kill9()


def assert_the_kill_was_recovered(cluster: Cluster, killed: dict, retries_before: int, what: str) -> None:
    """After :func:`kill_busiest_worker` under load: the victim is dead, the broker noticed the death
    itself, and at least one request in flight was re-dispatched (broker) or resubmitted (gateway)."""
    assert not killed["proc"].alive()
    logs = cluster.logs()
    assert "missed heartbeats; dropping it" in logs
    retried = cluster.broker_counters().get("stage_retries", 0) - retries_before
    resubmitted = logs.count("resubmitting")
    print(f"kill -9 {what}: {retried} stage(s) re-dispatched by the broker, {resubmitted} resubmitted by the gateway")
    assert retried + resubmitted >= 1, "the kill hit no request in flight"


IMAGE_EXTRA_FIELDS = ("seed", "num_inference_steps", "guidance_scale", "negative_prompt")
VIDEO_EXTRA_FIELDS = ("seed", "num_inference_steps", "guidance_scale", "negative_prompt", "fps", "num_frames")


def generate_images(client, model: str, prompt: str, **kwargs) -> list[bytes]:
    """``POST /v1/images/generations`` through the client (our fields beyond OpenAI's in the extra
    body); the PNG files of the response."""
    extra = {k: kwargs.pop(k) for k in IMAGE_EXTRA_FIELDS if k in kwargs}
    response = client.images.generate(model=model, prompt=prompt, extra_body=extra, **kwargs)
    assert response.output_format == "png"
    return [base64.b64decode(item.b64_json) for item in response.data]



def create_video(client, model: str, prompt: str, **kwargs):
    """``POST /v1/videos`` through the client; our fields beyond OpenAI's go in the extra body."""
    extra = {k: kwargs.pop(k) for k in VIDEO_EXTRA_FIELDS if k in kwargs}
    return client.videos.create(model=model, prompt=prompt, extra_body=extra, **kwargs)


def wait_for_video(client, video_id: str, timeout: float, poll_s: float = 0.1, seen: set | None = None):
    """The video job once it has ended (completed, failed or cancelled); fails the test after ``timeout``.
    Every (status, progress) polled on the way is added to ``seen``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if seen is not None:
            seen.add((video.status, video.progress))
        if video.status in ("completed", "failed", "cancelled"):
            return video
        time.sleep(poll_s)
    pytest.fail(f"video {video_id} did not finish: {video}")


# ----------------------------------------------------------------------- Omni requests and reference


def random_png(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of ``size`` (width, height) random pixels drawn from ``seed``."""
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def wav_bytes(pcm: np.ndarray, rate: int = 16000) -> bytes:
    """Mono 16-bit int PCM as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(pcm.tobytes())
    return out.getvalue()


def wav_samples(data: bytes, rate: int) -> np.ndarray:
    """The samples of a WAV file that must be mono 16-bit PCM at ``rate`` Hz."""
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, rate)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def image_part(png: bytes) -> dict:
    """A chat content part carrying ``png`` inline, as the OpenAI API takes it."""
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def audio_part(wav: bytes) -> dict:
    """A chat content part carrying the WAV file ``wav`` inline, as the OpenAI API takes it."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def thinker_reference(model_dir: str, thinker_class: type, feature_lengths: Callable, max_new_tokens: int):
    """transformers' greedy ``thinker_class`` on the tiny Omni in ``model_dir``, its inputs built by
    transformers' own preprocessors and token-count rules (``feature_lengths``: the model's audio
    feature-length rule). Returns ``generate(content, png=None, pcm=None)``: the new token ids for one
    user message of ``content`` parts, with the image (PNG bytes) and the 16 kHz int16 audio its
    placeholders stand for; ``generate.tokenizer`` is the model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    thinker = thinker_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    features = WhisperFeatureExtractor.from_pretrained(model_dir)

    def generate(content: list, png: bytes | None = None, pcm: np.ndarray | None = None) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        kwargs = {}
        if png is not None:
            image = images(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
            n = int(image["image_grid_thw"][0].prod()) // images.merge_size ** 2
            text = text.replace(tokenizer.image_token, tokenizer.image_token * n)
            kwargs.update(pixel_values=image["pixel_values"], image_grid_thw=image["image_grid_thw"])
        if pcm is not None:
            audio = features([pcm.astype(np.float32) / 32768.0], sampling_rate=16000, return_attention_mask=True,
                             padding="max_length", return_tensors="pt")
            n = int(feature_lengths(audio["attention_mask"].sum(-1))[0])
            text = text.replace(tokenizer.audio_token, tokenizer.audio_token * n)
            kwargs.update(input_features=audio["input_features"], feature_attention_mask=audio["attention_mask"])
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            out = thinker.generate(**ids, **kwargs, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids["input_ids"].shape[1]:].tolist()

    generate.tokenizer = tokenizer
    return generate

def decode_frames(data: bytes, mime: str) -> tuple[list[np.ndarray], float]:
    """(RGB frames, frames per second) of an MP4 (PyAV) or animated WebP (Pillow)."""
    if mime == "video/mp4":
        import av
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate)
            return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)], fps
    assert mime == "image/webp"
    image = Image.open(io.BytesIO(data))
    frames = []
    for k in range(image.n_frames):
        image.seek(k)
        frames.append(np.asarray(image.convert("RGB")))
    return frames, 1000 / image.info["duration"]

