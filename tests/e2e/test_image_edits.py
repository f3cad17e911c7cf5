"""``POST /v1/images/edits``: the engine's edit runner against diffusers' own image-to-image and
inpainting pipelines built from the same tiny Stable Diffusion directory, and the route through the
official ``openai`` client against a real cluster (broker, one generate worker, gateway)."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import openai
import pytest
import requests
import torch
from PIL import Image

from omnirelay.deploy.builders.stable_diffusion import build_tiny_text_to_image
from omnirelay.errors import BadRequest, Unprocessable
from omnirelay.gateway.config import ServedModel
from omnirelay.gateway.routes.image_edits import prepare_edit
from omnirelay.gateway.routes.images import ImageModel
from omnirelay.image_params import ImageParams
from omnirelay.workers.generate.image import GenerateImageEngine, ImageTask, encode_png

from media_fixtures import pipeline_file, pipeline_fixture, tiny_model_fixture
from media_support import openai_client, pipeline_cluster

MODEL = "tiny-sd"
PIPELINE_YAML = pipeline_file("text_to_image")
PROMPT = "a blue bird on a branch"


tiny_sd = tiny_model_fixture(MODEL, build_tiny_text_to_image)
pipe = pipeline_fixture("tiny_sd")


def _picture(width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.default_rng(5)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def _mask(width: int = 64, height: int = 48) -> Image.Image:
    """RGBA, transparent (edit) on the left half."""
    alpha = np.full((height, width), 255, dtype=np.uint8)
    alpha[:, : width // 2] = 0
    return Image.fromarray(np.dstack([np.zeros((height, width, 3), np.uint8), alpha]), "RGBA")


def _bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _b64(image: Image.Image) -> str:
    return base64.b64encode(_bytes(image)).decode()


def _edit(engine: GenerateImageEngine, **params) -> bytes:
    engine.add(ImageTask("edit-1", ImageParams(PROMPT, seed=4, num_inference_steps=4, **params), time.time() + 120))
    outputs = []
    while engine.has_work:
        out = engine.step()
        assert not out.failed, out.failed
        outputs += out.images
    [output] = outputs
    return output.png


def test_edit_equals_diffusers_img2img_and_inpaint_on_the_same_components(pipe):
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting
    picture, mask = _picture(), _mask().getchannel("A").point(lambda a: 255 if a == 0 else 0)
    engine = GenerateImageEngine(pipe)
    img2img = _edit(engine, width=64, height=48, image=_b64(picture), strength=0.6)
    reference = AutoPipelineForImage2Image.from_pipe(pipe)(
        PROMPT, image=picture, strength=0.6, num_inference_steps=4, generator=torch.Generator().manual_seed(4)).images[0]
    assert img2img == encode_png(reference)
    inpaint = _edit(engine, width=64, height=48, image=_b64(picture), mask=_b64(mask))
    reference = AutoPipelineForInpainting.from_pipe(pipe)(
        PROMPT, image=picture, mask_image=mask, width=64, height=48, strength=1.0, num_inference_steps=4,
        generator=torch.Generator().manual_seed(4)).images[0]
    assert inpaint == encode_png(reference)
    assert inpaint != img2img


def test_edits_and_generations_never_share_a_batch(pipe):
    engine = GenerateImageEngine(pipe, max_batch_size=4)
    engine.add(ImageTask("gen", ImageParams(PROMPT, seed=1, num_inference_steps=2, width=64, height=48),
                         time.time() + 120))
    engine.add(ImageTask("edit", ImageParams(PROMPT, seed=1, num_inference_steps=2, width=64, height=48,
                                             image=_b64(_picture())), time.time() + 120))
    batch = engine._admit()
    assert [it.request_id for it in batch.items] == ["gen"] and [it.request_id for it in engine.waiting] == ["edit"]


def test_prepare_edit_checks_the_uploads(tiny_sd):
    model = ImageModel(ServedModel(MODEL, tiny_sd, stages=("generate",)))
    image = _bytes(_picture(100, 70))
    params = prepare_edit(model, {"prompt": PROMPT}, {"image": image})
    assert (params.width, params.height) == (96, 64)           # the input's size, down to multiples of 8
    params = prepare_edit(model, {"prompt": PROMPT, "size": "64x48"}, {"image": image, "mask": _bytes(_mask(100, 70))})
    mask = Image.open(io.BytesIO(base64.b64decode(params.mask)))
    assert mask.size == (64, 48) and mask.mode == "L" and np.asarray(mask)[:, 0].min() == 255
    cases = [({"image": b"not an image"}, BadRequest, "image"),
             ({"image": image, "mask": _bytes(_mask(50, 50))}, BadRequest, "mask"),
             ({"image": image, "mask": _bytes(_picture(100, 70))}, BadRequest, "mask"),    # no alpha
             ({"mask": _bytes(_mask(100, 70))}, BadRequest, "image"),
             ({"image": _bytes(_picture(4, 4))}, BadRequest, "image")]
    for files, error, param in cases:
        with pytest.raises(error) as info:
            prepare_edit(model, {"prompt": PROMPT}, files)
        assert info.value.param == param, files.keys()
    with pytest.raises(BadRequest) as info:
        prepare_edit(model, {"prompt": PROMPT, "strength": 1.5}, {"image": image})
    assert info.value.param == "strength"
    model.pipeline_class = "ZImagePipeline"
    with pytest.raises(Unprocessable) as info:
        prepare_edit(model, {"prompt": PROMPT}, {"image": image})
    assert info.value.param == "model"


@pytest.fixture(scope="module")
def client(tiny_sd, tmp_path_factory):
    with pipeline_cluster(tiny_sd, str(tmp_path_factory.mktemp("edits-cluster")), MODEL, PIPELINE_YAML,
                          ("generate",)) as cluster:
        yield openai_client(cluster, timeout=120), cluster


def test_edits_through_the_openai_client(client):
    client, cluster = client
    picture = _bytes(_picture())
    extra = {"seed": 9, "num_inference_steps": 3}

    def edit(**kwargs) -> bytes:
        response = client.images.edit(model=MODEL, prompt=PROMPT, extra_body=extra, **kwargs)
        [item] = response.data
        return base64.b64decode(item.b64_json)

    plain = edit(image=("in.png", picture, "image/png"))
    assert Image.open(io.BytesIO(plain)).size == (64, 48)
    assert edit(image=("in.png", picture, "image/png")) == plain          # same seed, same edit
    masked = edit(image=("in.png", picture, "image/png"), mask=("mask.png", _bytes(_mask()), "image/png"),
                  size="64x64")
    assert Image.open(io.BytesIO(masked)).size == (64, 64)
    jpeg = edit(image=("in.jpg", _bytes(_picture(), "JPEG"), "image/jpeg"))
    assert Image.open(io.BytesIO(jpeg)).size == (64, 48)
    with pytest.raises(openai.BadRequestError) as info:
        edit(image=("in.txt", b"plain text", "text/plain"))
    assert info.value.body["param"] == "image" if "param" in info.value.body else info.value.body["error"]["param"] == "image"
    with pytest.raises(openai.BadRequestError):
        edit(image=("in.png", picture, "image/png"), mask=("mask.png", _bytes(_mask(32, 32)), "image/png"))
    # A JSON body is not an upload; the worker still serves generations after every refusal.
    r = requests.post(cluster.url + "/v1/images/edits", json={"prompt": PROMPT}, timeout=30)
    assert r.status_code == 400
    assert len(client.images.generate(model=MODEL, prompt=PROMPT, size="64x64",
                                      extra_body={"num_inference_steps": 2, "seed": 1}).data) == 1
