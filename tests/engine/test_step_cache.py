"""Wan's denoising loop on the tiny pipeline (``omni-make-model tiny-wan``): a guided step's two
branches as one batched forward, and step caching (``tea_cache``, ``static``) with its caches per
CFG branch and per batch (omnirelay/workers/generate/step_cache.py)."""

from __future__ import annotations

import copy
import time

import msgspec
import pytest
import torch

from omnirelay.deploy.builders.wan import build_tiny_wan
from omnirelay.errors import InvalidParam, Unprocessable
from omnirelay.step_cache_params import StepCacheSpec, parse_flag, spec_from
from omnirelay.video_params import VideoParams
from omnirelay.workers.generate.video import GenerateVideoEngine, JobPhase, VideoTask, WholeCallVideoRunner
from omnirelay.workers.generate.wan import StepwiseWanRunner

from media_fixtures import pipeline_fixture, tiny_model_fixture

tiny_wan = tiny_model_fixture("tiny-wan", build_tiny_wan, one_thread=True)
pipe = pipeline_fixture("tiny_wan")
STEPS = 6


def _params(seed: int = 3, cache: StepCacheSpec | None = None, steps: int = STEPS) -> VideoParams:
    return VideoParams(prompt="a red fox in the snow", negative_prompt="blurry", width=64, height=48, num_frames=9,
                       seed=seed, num_inference_steps=steps, guidance_scale=4.0, fps=16, cache=cache)


def _denoise(engine: GenerateVideoEngine, request_id: str, params: VideoParams) -> list[torch.Tensor]:
    """Run one request to the end of its denoising loop; the latents after each step (first: the
    initial noise). Whatever the engine still held is finished first."""
    while engine.has_work:
        engine.step()
    engine.add(VideoTask(request_id, params, time.time() + 300))
    latents = []
    while True:
        out = engine.step()
        assert not out.failed
        latents.append(engine.job.latents.clone())
        if engine.job.phase is JobPhase.DECODE:
            return latents


def _engine(pipe, one_pass: bool = True, **kwargs) -> GenerateVideoEngine:
    return GenerateVideoEngine(pipe, encoder="webp", runner=StepwiseWanRunner(pipe, cfg_one_pass=one_pass), **kwargs)


def test_cfg_in_one_pass_equals_two_passes_within_rounding(pipe):
    two = _denoise(_engine(pipe, one_pass=False), "two", _params())
    one = _denoise(_engine(pipe, one_pass=True), "one", _params())
    assert len(one) == len(two) == STEPS + 1
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(one, two))   # really another computation


def test_static_mask_computes_the_named_steps_and_their_latents_equal_the_plain_loop(pipe):
    plain = _denoise(_engine(pipe), "plain", _params())
    engine = _engine(pipe)
    cached = _denoise(engine, "static", _params(cache=StepCacheSpec("static", steps=(0, 1, 2))))
    # steps 0-2 computed (and the last one, always): bitwise the plain loop's up to the first skip
    assert all(torch.equal(a, b) for a, b in zip(plain[:4], cached[:4]))
    assert not torch.equal(plain[4], cached[4])
    # two branches per step: steps 0, 1, 2 and 5 computed, 3 and 4 skipped
    assert (engine.stats["cache_computed_steps"], engine.stats["cache_skipped_steps"]) == (8, 4)
    # steps 0-1 run the high-noise expert, 2-5 the low-noise one: its first step computes, whatever
    # the mask says, as the other expert's residual is not its own
    switch = _engine(pipe)
    _denoise(switch, "switch", _params(cache=StepCacheSpec("static", steps=(0,))))
    assert (switch.stats["cache_computed_steps"], switch.stats["cache_skipped_steps"]) == (6, 6)
    every = _engine(pipe)
    assert all(torch.equal(a, b) for a, b in zip(plain, _denoise(every, "all", _params(cache=StepCacheSpec(
        "static", interval=1)))))
    assert every.stats["cache_skipped_steps"] == 0


def test_a_skipped_step_reuses_each_branchs_own_residual(pipe):
    engine = _engine(pipe)
    engine.add(VideoTask("a", _params(cache=StepCacheSpec("static", steps=(0,))), time.time() + 300))
    engine.step()   # prompt
    engine.step()   # step 0, computed
    job = engine.job
    cond, uncond = (branch.residual.clone() for branch in job.step_cache.branches)
    assert not torch.allclose(cond, uncond)   # the negative prompt's branch has a residual of its own
    latents, scheduler, t = job.latents.clone(), copy.deepcopy(job.scheduler), job.scheduler.timesteps[1]
    engine.step()   # step 1, skipped: each branch is its input plus its own residual
    inputs = latents.to(cond.dtype)
    noise = (inputs + uncond) + 4.0 * ((inputs + cond) - (inputs + uncond))
    assert torch.equal(job.latents, scheduler.step(noise, t, latents, return_dict=False)[0])


def test_a_cached_residual_never_outlives_its_request(pipe):
    spec = StepCacheSpec("static", interval=2)
    engine = _engine(pipe)
    first = _denoise(engine, "a", _params(seed=1, cache=spec))
    second = _denoise(engine, "b", _params(seed=2, cache=spec))
    alone = _denoise(_engine(pipe), "b", _params(seed=2, cache=spec))
    assert all(torch.equal(a, b) for a, b in zip(second, alone))
    assert not torch.equal(first[-1], second[-1])


def test_cancel_cuts_the_cancelled_rows_out_of_every_branch_cache(pipe):
    engine = _engine(pipe, max_batch_size=2)
    spec = StepCacheSpec("static", steps=(0,))
    engine.add(VideoTask("stay", _params(seed=1, cache=spec), time.time() + 300))
    engine.add(VideoTask("go", _params(seed=2, cache=spec), time.time() + 300))
    engine.step()
    engine.step()   # step 0 of both rows
    assert [b.residual.shape[0] for b in engine.job.step_cache.branches] == [2, 2]
    kept = [b.residual[:1].clone() for b in engine.job.step_cache.branches]
    assert engine.cancel("go")
    assert all(torch.equal(b.residual, k) for b, k in zip(engine.job.step_cache.branches, kept))
    engine.step()   # a skipped step of the remaining row runs on its own residuals
    assert engine.job.latents.shape[0] == 1 and not engine.job.latents.isnan().any()


def test_tea_cache_skips_while_the_modulated_input_barely_moves(pipe):
    plain = _denoise(_engine(pipe), "plain", _params(steps=12))
    exact = _engine(pipe)   # a zero threshold computes every step: the plain loop
    assert all(torch.equal(a, b) for a, b in zip(plain, _denoise(exact, "t0", _params(
        steps=12, cache=StepCacheSpec("tea_cache", rel_l1_thresh=0.0)))))
    assert exact.stats["cache_skipped_steps"] == 0
    server_default = _engine(pipe, step_cache=StepCacheSpec("tea_cache", rel_l1_thresh=0.3))
    cached = _denoise(server_default, "t", _params(steps=12))
    skipped = server_default.stats["cache_skipped_steps"]
    assert 0 < skipped < 2 * 12 and server_default.stats["cache_computed_steps"] == 2 * 12 - skipped
    assert not torch.equal(plain[-1], cached[-1])
    # a request's own "none" replaces the server's tea_cache
    _denoise(server_default, "off", _params(steps=12, cache=StepCacheSpec("none")))
    assert server_default.stats["cache_skipped_steps"] == skipped


def test_step_cache_is_refused_where_no_runner_caches(pipe):
    whole = GenerateVideoEngine(pipe, encoder="webp", runner=WholeCallVideoRunner(pipe))
    with pytest.raises(Unprocessable) as info:
        whole.add(VideoTask("x", _params(cache=StepCacheSpec("tea_cache")), time.time() + 60))
    assert info.value.param == "cache_backend"
    with pytest.raises(ValueError):
        GenerateVideoEngine(pipe, encoder="webp", runner=WholeCallVideoRunner(pipe),
                            step_cache=StepCacheSpec("static", interval=2))


def test_cache_fields_are_validated_by_name_and_travel_typed():
    assert spec_from("tea_cache", '{"rel_l1_thresh": 0.1}') == StepCacheSpec("tea_cache", rel_l1_thresh=0.1)
    assert spec_from("static", {"steps": [0, 3]}).computes(3, 6) and not spec_from("static", {"steps": [0, 3]}).computes(2, 6)
    for backend, config, param in (("tea_cache", {"steps": [1]}, "cache_config"), ("static", {}, "cache_config"),
                                   ("fast", None, "cache_backend"), ("tea_cache", "{", "cache_config"),
                                   ("tea_cache", {"rel_l1_thresh": -1}, "cache_config")):
        with pytest.raises(InvalidParam) as info:
            spec_from(backend, config)
        assert info.value.param == param
    with pytest.raises(Unprocessable) as unserved:
        spec_from("cache_dit", None)
    assert unserved.value.param == "cache_backend"
    with pytest.raises(ValueError, match="--cache-backend"):
        parse_flag("static", "")
    assert parse_flag("", "") == StepCacheSpec()
    params = _params(cache=StepCacheSpec("static", steps=(0, 2)))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=VideoParams) == params
