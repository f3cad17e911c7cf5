"""Z-Image end to end: the tiny ``ZImagePipeline`` (``omni-make-model tiny-zimage``), the generate
engine over it (family defaults, sizes, batching) and ``POST /v1/images/generations`` through the
official ``openai`` client against a real cluster (broker, one generate worker batching up to 2
images, gateway as separate processes).
"""

from __future__ import annotations

import io
import time

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from omnirelay.deploy.builders.zimage import build_tiny_zimage
from omnirelay.dit_families import family_of_dir
from omnirelay.errors import BadRequest
from omnirelay.image_params import ImageParams
from omnirelay.workers.generate.image import GenerateImageEngine, ImageTask, WholeCallRunner, encode_png
from omnirelay.workers.generate.zimage import StepwiseZImageRunner

from media_fixtures import client_fixture, pipeline_file, pipeline_fixture, tiny_model_fixture
from media_support import batched_pipeline, generate_images, pipeline_cluster, run_image_engine

MODEL = "tiny-zimage"
PIPELINE_YAML = pipeline_file("text_to_image")
PROMPT = "a red fox sitting in the snow at dawn"


tiny_zimage = tiny_model_fixture(MODEL, build_tiny_zimage, one_thread=True)
pipe = pipeline_fixture("tiny_zimage")


def _run(engine: GenerateImageEngine, *tasks: ImageTask, max_steps: int = 100):
    return run_image_engine(engine, *tasks, max_steps=max_steps)


def _task(request_id: str, prompt: str = PROMPT, **params) -> ImageTask:
    params.setdefault("seed", 3)
    params.setdefault("num_inference_steps", 3)
    params.setdefault("guidance_scale", 0.0)
    params.setdefault("width", 64)
    params.setdefault("height", 64)
    return ImageTask(request_id, ImageParams(prompt, **params), time.time() + 120)


def _pixels(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return np.asarray(image).astype(np.int16)


def test_tiny_zimage_is_an_ordinary_z_image_directory(tiny_zimage, pipe):
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    assert isinstance(pipe, ZImagePipeline)
    assert isinstance(pipe.transformer, ZImageTransformer2DModel) and isinstance(pipe.text_encoder, Qwen3Model)
    family = family_of_dir(tiny_zimage)
    assert family.pipeline_class == "ZImagePipeline" and family.size_multiple == 16
    assert (family.default_steps, family.default_guidance) == (9, 0.0)   # Turbo's few-step recipe
    with pytest.raises(BadRequest) as info:
        family.check_size(72, 64)
    assert info.value.param == "size"


def test_engine_uses_the_family_and_equals_the_pipeline_call(pipe):
    engine = GenerateImageEngine(pipe)
    assert isinstance(engine.runner, StepwiseZImageRunner)
    assert (engine.default_width, engine.default_height, engine.default_steps) == (1024, 1024, 9)
    with pytest.raises(BadRequest) as info:        # a multiple of 8, but not of the 16 the patching takes
        engine.add(_task("bad", width=72))
    assert info.value.param == "size"
    [image], failed = _run(engine, _task("a", width=96, height=64, seed=5, negative_prompt="blurry",
                                         guidance_scale=2.0))
    assert not failed
    reference = pipe(PROMPT, negative_prompt="blurry", width=96, height=64, num_inference_steps=3,
                     guidance_scale=2.0, generator=torch.Generator().manual_seed(5)).images[0]
    assert image.png == encode_png(reference)
    assert Image.open(io.BytesIO(image.png)).size == (96, 64)


def test_batched_images_equal_single_images(pipe):
    prompts = [PROMPT, "an oil painting of a lighthouse on a rocky coast during a storm"]
    single = []
    for i, prompt in enumerate(prompts):
        [image], _ = _run(GenerateImageEngine(pipe, max_batch_size=1), _task(f"s{i}", prompt, seed=10 + i))
        single.append(_pixels(image.png))
    engine = GenerateImageEngine(pipe, max_batch_size=2)
    images, failed = _run(engine, *[_task(f"b{i}", prompt, seed=10 + i) for i, prompt in enumerate(prompts)])
    assert not failed and engine.stats["batches"] == 1 and engine.stats["images_generated"] == 2
    batched = {image.request_id: _pixels(image.png) for image in images}
    for i in range(2):
        # one denoising loop over both rows: equal to each alone up to float rounding (±1 level)
        assert np.abs(batched[f"b{i}"] - single[i]).max() <= 1
    assert np.abs(single[0] - single[1]).mean() > 1     # the two images really differ


def test_a_stepped_batch_equals_the_whole_call_and_steps_once_per_denoising_step(pipe):
    prompts = [PROMPT, "an oil painting of a lighthouse on a rocky coast during a storm"]
    for guidance in (0.0, 2.0):
        tasks = lambda tag: [_task(f"{tag}{i}", prompt, seed=20 + i, guidance_scale=guidance)   # noqa: E731
                             for i, prompt in enumerate(prompts)]
        stepped = GenerateImageEngine(pipe, max_batch_size=2)
        images, failed = _run(stepped, *tasks("s"))
        assert not failed and stepped.stats["denoise_steps"] == 3 and stepped.stats["batches"] == 1
        whole = GenerateImageEngine(pipe, max_batch_size=2, runner=WholeCallRunner(pipe))
        reference, failed = _run(whole, *tasks("w"))
        assert not failed
        assert [image.png for image in images] == [image.png for image in reference]   # byte for byte


def test_a_cancel_takes_a_z_image_row_out_at_the_next_step(pipe):
    engine = GenerateImageEngine(pipe, max_batch_size=2)
    engine.add(_task("stay", seed=1))
    engine.add(_task("go", "an oil painting of a lighthouse", seed=2))
    engine.step()   # encode
    engine.step()   # one denoising step of both rows
    engine.cancel("go")
    assert [it.request_id for it in engine.batch.items] == ["stay"] and engine.batch.latents.shape[0] == 1
    assert len(engine.batch.prompt_embeds) == 1
    images = []
    while engine.has_work:
        images += engine.step().images
    [alone], _ = _run(GenerateImageEngine(pipe), _task("alone", seed=1))
    assert [image.request_id for image in images] == ["stay"]
    assert np.abs(_pixels(images[0].png) - _pixels(alone.png)).max() <= 1   # batch of 2, then 1: rounding


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def cluster(tiny_zimage, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zimage-cluster")
    with pipeline_cluster(tiny_zimage, str(tmp), MODEL, batched_pipeline(PIPELINE_YAML, tmp, 2),
                          ("generate",)) as cluster:
        yield cluster


client = client_fixture()


def _generate(client, **kwargs) -> list[bytes]:
    return generate_images(client, MODEL, kwargs.pop("prompt", PROMPT), **kwargs)


def test_openai_client_gets_z_image_pngs_of_the_asked_size(client, pipe):
    [png] = _generate(client, size="96x64", seed=21, num_inference_steps=2)
    assert Image.open(io.BytesIO(png)).size == (96, 64)
    # Turbo's defaults filled in by the gateway: no guidance unless asked
    reference = pipe(PROMPT, width=96, height=64, num_inference_steps=2, guidance_scale=0.0,
                     generator=torch.Generator().manual_seed(21)).images[0]
    assert png == encode_png(reference)
    pair = _generate(client, size="64x64", seed=4, n=2, num_inference_steps=2)   # one batch of two on the worker
    assert [Image.open(io.BytesIO(x)).size for x in pair] == [(64, 64)] * 2 and pair[0] != pair[1]


@pytest.mark.parametrize("kwargs, param", [
    ({"size": "72x64"}, "size"),                   # multiple of 8, not of the 16 Z-Image patches
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": -3}, "num_inference_steps"),
])
def test_bad_z_image_requests_get_400_with_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _generate(client, **{"num_inference_steps": 2, **kwargs})
    error = info.value.body["error"] if "error" in info.value.body else info.value.body
    assert error["param"] == param and error["message"]
