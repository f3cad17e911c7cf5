"""Wan end to end: the tiny ``WanPipeline`` (``omni-make-model tiny-wan``: two experts, UMT5, the
causal 3D VAE), the video engine over it (family sizes and frame counts) and ``POST /v1/videos``
through the official ``openai`` client against a real cluster (broker, one generate worker,
gateway as separate processes) to a playable MP4 (or WebP without PyAV).
"""

from __future__ import annotations

import time

import numpy as np
import openai
import pytest
import torch

from omnirelay.model_kind import model_kind
from omnirelay.deploy.builders.wan import build_tiny_wan
from omnirelay.dit_families import family_of_dir
from omnirelay.errors import BadRequest
from omnirelay.video_params import VideoParams, is_video_pipeline
from omnirelay.workers.generate.video import GenerateVideoEngine, VideoTask, WholeCallVideoRunner, to_uint8
from omnirelay.workers.generate.wan import StepwiseWanRunner

from media_fixtures import client_fixture, cluster_fixture, pipeline_file, pipeline_fixture, tiny_model_fixture
from media_support import create_video, wait_for_video
from media_support import decode_frames

MODEL = "tiny-wan"
PIPELINE_YAML = pipeline_file("text_to_video")
PROMPT = "a red fox sitting in the snow at dawn"


tiny_wan = tiny_model_fixture(MODEL, build_tiny_wan, one_thread=True)
pipe = pipeline_fixture("tiny_wan")


def _params(**kwargs) -> VideoParams:
    fields = dict(prompt=PROMPT, width=64, height=48, num_frames=9, seed=3, num_inference_steps=3,
                  guidance_scale=4.0, fps=16)
    return VideoParams(**{**fields, **kwargs})


def test_tiny_wan_is_a_wan_2_2_directory_served_as_video(tiny_wan, pipe):
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    assert isinstance(pipe, WanPipeline) and isinstance(pipe.vae, AutoencoderKLWan)
    assert isinstance(pipe.transformer, WanTransformer3DModel) and isinstance(pipe.transformer_2, WanTransformer3DModel)
    assert isinstance(pipe.text_encoder, UMT5EncoderModel) and pipe.config.boundary_ratio == 0.875
    assert is_video_pipeline(tiny_wan) and model_kind(tiny_wan) == "text-to-video"
    family = family_of_dir(tiny_wan)
    assert (family.size_multiple, family.frame_step, family.default_fps) == (16, 4, 16)
    assert family.native_size == (416, 240)   # the tiny directory states its own (Wan's is 832x480)
    assert family.round_frames(64) == 65 and family.round_frames(1) == 1
    with pytest.raises(BadRequest) as info:
        family.check_frames(8)
    assert info.value.param == "num_frames"


def test_engine_equals_the_pipeline_call_and_refuses_what_wan_cannot_make(pipe):
    assert isinstance(GenerateVideoEngine(pipe, encoder="webp").runner, StepwiseWanRunner)
    # two passes per guided step, as WanPipeline.__call__ makes them: its output bit for bit
    engine = GenerateVideoEngine(pipe, encoder="webp", runner=StepwiseWanRunner(pipe, cfg_one_pass=False))
    for bad, param in (({"width": 72}, "size"), ({"num_frames": 8}, "num_frames")):
        with pytest.raises(BadRequest) as info:
            engine.add(VideoTask("bad", _params(**bad), time.time() + 60))
        assert info.value.param == param
    engine.add(VideoTask("a", _params(negative_prompt="blurry"), time.time() + 120))
    frames, progress = None, []
    for _ in range(10):
        out = engine.step()
        assert not out.failed
        progress += [p.percent for p in out.progress]
        if out.videos:
            [video] = out.videos
            frames, _ = decode_frames(video.data, video.mime)   # lossless WebP: the frames themselves
            break
    assert frames is not None and not engine.has_work
    reference = pipe(PROMPT, negative_prompt="blurry", width=64, height=48, num_frames=9, num_inference_steps=3,
                     guidance_scale=4.0, generator=torch.Generator().manual_seed(3), output_type="np").frames[0]
    assert np.array_equal(np.stack(frames), np.stack(to_uint8(np.asarray(reference))))
    # one engine step per phase and denoising step (prompt, 3 steps, decode, mux), progress after each
    assert engine.stats["denoise_steps"] == 3 and len(progress) == 5 and progress == sorted(progress)
    # the whole-call runner makes the same frames in one step
    whole = GenerateVideoEngine(pipe, runner=WholeCallVideoRunner(pipe), encoder="webp")
    whole.add(VideoTask("w", _params(negative_prompt="blurry"), time.time() + 120))
    videos = [v for _ in range(3) for v in whole.step().videos]
    assert np.array_equal(np.stack(decode_frames(videos[0].data, videos[0].mime)[0]), np.stack(frames))


def test_cancel_stops_a_wan_job_between_denoising_steps(pipe):
    engine = GenerateVideoEngine(pipe, encoder="webp")
    engine.add(VideoTask("long", _params(num_inference_steps=50), time.time() + 120))
    for _ in range(3):
        engine.step()
    assert engine.cancel("long") and not engine.has_work and engine.stats["denoise_steps"] == 2


# ------------------------------------------------------------------------------------ end to end


cluster = cluster_fixture("tiny_wan", MODEL, PIPELINE_YAML, "wan-cluster")
client = client_fixture()


def _create(client, prompt: str = PROMPT, **kwargs):
    return create_video(client, MODEL, prompt, **kwargs)


def _wait(client, video_id: str):
    return wait_for_video(client, video_id, timeout=120.0)


def test_wan_video_job_through_the_openai_client_is_a_playable_file(client):
    # 1 s at Wan's 16 fps is 16 frames, rounded to the 4k + 1 the VAE makes: 17
    video = _create(client, size="64x48", seconds="1", seed=5, num_inference_steps=2)
    done = _wait(client, video.id)
    assert done.status == "completed" and done.progress == 100, done.error
    content = client.videos.download_content(video.id)
    data = content.read()
    frames, fps = decode_frames(data, content.response.headers["content-type"])
    assert len(frames) == 17 and frames[0].shape == (48, 64, 3) and fps == 16
    assert np.stack(frames).std() > 5
    again = _wait(client, _create(client, size="64x48", seconds="1", seed=5, num_inference_steps=2).id)
    assert client.videos.download_content(again.id).read() == data   # same seed, same bytes


@pytest.mark.parametrize("kwargs, param", [
    ({"size": "72x48"}, "size"),                  # multiple of 8, not of the 16 Wan patches
    ({"num_frames": 8}, "num_frames"),            # not 4k + 1
    ({"num_inference_steps": 0}, "num_inference_steps"),
])
def test_bad_wan_requests_get_400_with_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, **{"size": "64x48", "num_frames": 5, "num_inference_steps": 2, **kwargs})
    error = info.value.body["error"] if "error" in info.value.body else info.value.body
    assert error["param"] == param and error["message"]


def test_a_request_asks_for_its_own_step_cache_and_bad_cache_fields_are_named(client):
    extra = {"seed": 5, "num_inference_steps": 4, "cache_backend": "static", "cache_config": '{"steps": [0, 2]}'}
    video = client.videos.create(model=MODEL, prompt=PROMPT, size="64x48", seconds="1", extra_body=extra)
    done = _wait(client, video.id)
    assert done.status == "completed" and done.progress == 100, done.error
    # a dict in extra_body reaches the form as cache_config[key] fields
    extra["cache_config"] = {"interval": 2}
    video = client.videos.create(model=MODEL, prompt=PROMPT, size="64x48", seconds="1", extra_body=extra)
    assert _wait(client, video.id).status == "completed"
    for fields, param, error_class in (
            ({"cache_backend": "static", "cache_config": '{"rel_l1_thresh": 0.1}'}, "cache_config",
             openai.BadRequestError),
            ({"cache_config": '{"interval": 2}'}, "cache_backend", openai.BadRequestError),
            ({"cache_backend": "tea_cache", "cache_config": {"rel_l1_thresh": 0.1, "steps": [1]}}, "cache_config",
             openai.BadRequestError),
            ({"cache_backend": "cache_dit"}, "cache_backend", openai.UnprocessableEntityError)):
        with pytest.raises(error_class) as info:
            client.videos.create(model=MODEL, prompt=PROMPT, size="64x48", seconds="1", extra_body=fields)
        error = info.value.body["error"] if "error" in info.value.body else info.value.body
        assert error["param"] == param and error["message"]
