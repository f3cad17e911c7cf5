"""Images end to end: the tiny diffusers pipeline, the generate engine and role, and
``POST /v1/images/generations`` through the official ``openai`` client against a real cluster
(broker, one generate worker, gateway as separate processes).
"""

from __future__ import annotations

import base64
import io
import json
import pathlib
import time

import msgspec
import numpy as np
import openai
import pytest
import requests
import torch
from PIL import Image

from omnirelay.broker import protocol as p
from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image
from omnirelay.errors import BadRequest, Unprocessable
from omnirelay.image_params import ImageParams
from omnirelay.request_params import RequestParams, TextParams
from omnirelay.workers.generate.image import GenerateImageEngine, ImageTask, WholeCallRunner, encode_png
from omnirelay.workers.generate.image_role import GenerateImageRole

from cluster import settled_workers
from media_fixtures import client_fixture, cluster_fixture, pipeline_file, pipeline_fixture, tiny_model_fixture
from media_support import decode_params, generate_images, run_image_engine

MODEL = "tiny-sd"
PIPELINE_YAML = pipeline_file("text_to_image")
PROMPT = "a red fox sitting in the snow at dawn"


tiny_sd = tiny_model_fixture(MODEL, build_tiny_text_to_image)
pipe = pipeline_fixture("tiny_sd")


def _run(engine: GenerateImageEngine, *tasks: ImageTask, max_steps: int = 500):
    return run_image_engine(engine, *tasks, max_steps=max_steps)


def _task(request_id: str, deadline: float | None = None, **params) -> ImageTask:
    params.setdefault("seed", 3)
    params.setdefault("num_inference_steps", 4)
    return ImageTask(request_id, ImageParams(PROMPT, **params), deadline or time.time() + 120)


def _png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image


# ------------------------------------------------------------------------------------ the model


def test_tiny_pipeline_is_an_ordinary_diffusers_directory(tiny_sd, pipe, tmp_path):
    from diffusers import DiffusionPipeline
    from transformers import CLIPTokenizer

    assert type(pipe).__name__ == "StableDiffusionPipeline"
    tokenizer = CLIPTokenizer.from_pretrained(str(pathlib.Path(tiny_sd) / "tokenizer"))
    ids = tokenizer("A photograph of a red fox, Zebra 42!")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a photograph of a red fox , zebra 4 2 !"
    assert len(ids) < 20   # merges learned from the corpus apply ("photograph" is one or two tokens)
    vocab = json.loads((pathlib.Path(tiny_sd) / "tokenizer" / "vocab.json").read_text())
    assert vocab["<|endoftext|>"] == len(vocab) - 1 == pipe.text_encoder.config.vocab_size - 1

    # Deterministic by seed: a rebuild writes the same weights; the native output is 64×64.
    again = build_tiny_text_to_image(tmp_path / "again", seed=0)
    for weights in sorted(pathlib.Path(tiny_sd).rglob("*.safetensors")):
        assert (again / weights.relative_to(tiny_sd)).read_bytes() == weights.read_bytes(), weights
    reloaded = DiffusionPipeline.from_pretrained(str(again), local_files_only=True)
    reloaded.set_progress_bar_config(disable=True)
    image = reloaded(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32))
    assert pixels.std() > 20, "a random-weight VAE should still spread pixels over the range"
    with pytest.raises(FileExistsError):
        build_tiny_text_to_image(again, seed=0)


def test_omni_make_model_tiny_sd(tmp_path, capsys):
    from omnirelay.deploy.builders.stable_diffusion import is_complete
    from omnirelay.deploy.builders.llm import main

    assert main(["tiny-sd", str(tmp_path / "sd"), "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "sd") and is_complete(tmp_path / "sd")
    assert main(["tiny-sd", str(tmp_path / "sd")]) == 2   # exists: refused without --force


# ------------------------------------------------------------------------------------ the engine


def test_engine_equals_the_pipeline_call_and_steps_one_denoising_step_at_a_time(pipe):
    engine = GenerateImageEngine(pipe, max_batch_size=1)
    task = _task("r1", n=2, negative_prompt="blurry", width=96, height=48, seed=11)
    images, failed = _run(engine, task)
    assert not failed
    assert [(i.request_id, i.index, i.finished) for i in images] == [("r1", 0, False), ("r1", 1, True)]
    # batch 1: per image one encode, 4 denoising steps and one decode step
    assert engine.stats["denoise_steps"] == 8 and engine.stats["encode_steps"] == engine.stats["decode_steps"] == 2
    for image in images:
        reference = pipe(PROMPT, negative_prompt="blurry", width=96, height=48, num_inference_steps=4,
                         generator=torch.Generator().manual_seed(11 + image.index)).images[0]
        assert image.png == encode_png(reference)
        assert _png(image.png).size == (96, 48)
    assert images[0].png != images[1].png


def test_batching_admits_compatible_items_and_matches_the_whole_call_runner(pipe):
    stepwise = GenerateImageEngine(pipe, max_batch_size=4)
    tasks = [_task("a", n=2, seed=1), _task("b", n=1, seed=5, width=32, height=32), _task("c", n=1, seed=9)]
    images, failed = _run(stepwise, *tasks)
    assert not failed and stepwise.stats["batches"] == 2   # a0, a1, c0 together; then b0 (other size)
    whole = GenerateImageEngine(pipe, max_batch_size=4, runner=WholeCallRunner(pipe))
    images_whole, _ = _run(whole, *tasks)
    key = lambda i: (i.request_id, i.index)   # noqa: E731
    assert {key(i): i.png for i in images} == {key(i): i.png for i in images_whole}
    assert {key(i) for i in images if i.finished} == {("a", 1), ("b", 0), ("c", 0)}


def test_cancel_deadline_and_sizes_the_model_cannot_make(pipe):
    clock = [1000.0]
    engine = GenerateImageEngine(pipe, max_batch_size=4, clock=lambda: clock[0])
    engine.add(_task("keep", deadline=2000, n=1, num_inference_steps=6))
    engine.add(_task("drop", deadline=2000, n=2, num_inference_steps=6))
    engine.add(_task("late", deadline=1001, n=1, num_inference_steps=6, width=16, height=16))
    for _ in range(3):        # encode + two denoising steps of the batch keep0, drop0, drop1
        engine.step()
    assert len(engine.batch.items) == 3
    engine.cancel("drop")
    assert [it.request_id for it in engine.batch.items] == ["keep"] and engine.batch.latents.shape[0] == 1
    clock[0] = 1500.0
    images, failed = _run(engine)
    assert [(i.request_id, i.finished) for i in images] == [("keep", True)]
    assert [(f.request_id, f.error_type) for f in failed] == [("late", "deadline_exceeded")]
    engine.cancel("unknown")  # ignored
    engine.add(ImageTask("dup", ImageParams(PROMPT, seed=0), 2000))
    with pytest.raises(ValueError):
        engine.add(ImageTask("dup", ImageParams(PROMPT, seed=0), 2000))
    with pytest.raises(ValueError):
        engine.add(ImageTask("unseeded", ImageParams(PROMPT), 2000))
    engine.vae_scale_factor = 16   # as if the VAE had one more level: 24 pixels is no longer a whole latent
    with pytest.raises(BadRequest):
        engine.add(ImageTask("odd", ImageParams(PROMPT, width=24, height=32, seed=0), 2000))
    engine.cancel("dup")
    assert not engine.has_work and not engine.num_requests


def test_image_params_validate_on_both_sides():
    assert decode_params(ImageParams("x", n=2, seed=1)) == ImageParams("x", n=2, seed=1)
    with pytest.raises(BadRequest, match="'n'"):
        ImageParams("x", n=11)
    for bad in ({"prompt": ""}, {"prompt": "x", "n": 0}, {"prompt": "x", "n": 11}, {"prompt": "x", "width": 65,
                "height": 64}, {"prompt": "x", "width": 64}, {"prompt": "x", "num_inference_steps": 1000},
                {"prompt": "x", "guidance_scale": float("nan")}, {"prompt": "x", "n": True}, {"prompt": 3},
                {"prompt": "x", "surprise": 1}, {"n": 1}, ["prompt"]):
        with pytest.raises(msgspec.ValidationError):
            decode_params(bad, ImageParams)


def test_role_adapter_reports_media_then_done_and_refuses_bad_tasks(pipe):
    role = GenerateImageRole("gen-1", GenerateImageEngine(pipe))

    def task(request_id: str, params: RequestParams) -> p.Task:
        return p.Task(request_id=request_id, stage="generate", model=MODEL, prompt_token_ids=[], params=params,
                      inputs=None, reply_to="tcp://127.0.0.1:1", deadline=time.time() + 60, attempt=2)

    [(dest, failure)] = role.accept(task("bad", TextParams()))   # not what it serves
    assert dest == "" and isinstance(failure, p.StageFailed) and failure.error_type == "bad_request"
    assert failure.attempt == 2
    assert role.accept(task("ok", ImageParams(PROMPT, n=2, num_inference_steps=2, seed=4))) == []
    out = []
    while role.engine.has_work:
        out += role.step()
    kinds = [(dest, type(msg).__name__) for dest, msg in out]
    assert kinds == [("tcp://127.0.0.1:1", "MediaResult"), ("tcp://127.0.0.1:1", "MediaResult"), ("", "StageDone")]
    media = [msg for _, msg in out[:2]]
    assert [(m.index, m.finish, m.mime) for m in media] == [(0, False, "image/png"), (1, True, "image/png")]
    assert _png(base64.b64decode(media[0].data)).size == (64, 64)
    assert p.decode(p.encode(media[1])) == media[1]
    assert out[2][1].finished and out[2][1].attempt == 2 and out[2][1].stage == "generate"


# ------------------------------------------------------------------------------------ end to end


cluster = cluster_fixture("tiny_sd", MODEL, PIPELINE_YAML, "images-cluster")
client = client_fixture()


def _generate(client, **kwargs) -> list[bytes]:
    return generate_images(client, kwargs.pop("model", MODEL), kwargs.pop("prompt", PROMPT), **kwargs)


def test_images_generate_returns_pngs_of_the_requested_size(client, cluster, pipe):
    assert MODEL in [m.id for m in client.models.list().data]
    [png] = _generate(client, size="96x64", seed=21, num_inference_steps=3, negative_prompt="blurry")
    assert _png(png).size == (96, 64)
    # the same image diffusers makes from the same directory and seed
    reference = pipe(PROMPT, negative_prompt="blurry", width=96, height=64, num_inference_steps=3,
                     generator=torch.Generator().manual_seed(21)).images[0]
    assert png == encode_png(reference)
    [native] = _generate(client, num_inference_steps=2)
    assert _png(native).size == (64, 64)   # no size: the model's native resolution


def test_same_seed_same_image_and_n_gives_different_images(client):
    first = _generate(client, seed=7, num_inference_steps=3, size="64x64")
    second = _generate(client, seed=7, num_inference_steps=3, size="64x64")
    assert first == second
    pair = _generate(client, seed=7, num_inference_steps=3, size="64x64", n=2)
    assert len(pair) == 2 and pair[0] != pair[1] and pair[0] == first[0]
    assert _generate(client, seed=8, num_inference_steps=3, size="64x64") != first


@pytest.mark.parametrize("kwargs, status, param", [
    ({"size": "65x64"}, 400, "size"),
    ({"size": "big"}, 400, "size"),
    ({"size": "4096x4096"}, 400, "size"),
    ({"n": 0}, 400, "n"),
    ({"n": 11}, 400, "n"),
    ({"prompt": ""}, 400, "prompt"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"response_format": "url"}, 422, "response_format"),
    ({"num_inference_steps": 0.5}, 400, "num_inference_steps"),
])
def test_bad_requests_get_openai_errors(client, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        _generate(client, **{"num_inference_steps": 2, **kwargs})
    assert info.value.status_code == status
    error = info.value.body["error"] if "error" in info.value.body else info.value.body
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_image_model_refuses_chat_and_other_requests_still_work(client, cluster):
    response = requests.post(cluster.url + "/v1/chat/completions", timeout=30,
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 422 and response.json()["error"]["param"] == "model"
    assert len(_generate(client, num_inference_steps=1, seed=1)) == 1
    assert requests.get(cluster.url + "/health", timeout=10).status_code == 200


def test_client_that_leaves_cancels_the_generation_upstream(client, cluster):
    before = requests.get(cluster.url + "/cluster", timeout=10).json()["broker"].get("cancellations", 0)
    impatient = client.with_options(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        _generate(impatient, n=10, num_inference_steps=150, seed=3)   # ~15 s of work
    # Settled: the cancel reached the worker and a heartbeat since says it holds nothing.
    [worker] = settled_workers(cluster.url)
    assert worker["running"] + worker["waiting"] == 0, worker
    assert requests.get(cluster.url + "/cluster", timeout=10).json()["broker"].get("cancellations", 0) > before
    assert worker["stats"].get("images_generated", 0) < 40   # the 10 abandoned images were not all made (none yet: no key)
    assert len(_generate(client, num_inference_steps=1, seed=2)) == 1


def test_parse_rejects_unsupported_formats_before_submitting():
    from omnirelay.gateway.routes.images import parse_image_request

    with pytest.raises(Unprocessable):
        parse_image_request({"prompt": "x", "output_format": "jpeg"})
    with pytest.raises(Unprocessable):
        parse_image_request({"prompt": "x", "stream": True})
    with pytest.raises(BadRequest):
        parse_image_request({"prompt": "x", "response_format": "gif"})
    parsed = parse_image_request({"prompt": "x", "size": "auto", "user": "u1", "quality": "high"})
    assert (parsed.model, parsed.params.width, parsed.params.height) == (None, 0, 0)
