"""Wan text-to-video driven one unit of work per engine step (the video engine's runner for
``WanPipeline``).

A batch crosses the phases of :class:`~.video.VideoJob` as any stepwise video batch does::

    PROMPT   UMT5 embeddings of every row's prompt (and of its negative prompt under guidance),
             latents (rows, C, (F-1)/4 + 1, H/8, W/8), row i drawn from its own seeded generator,
             a scheduler of the batch's own (UniPC state is per batch)
    DENOISE  one scheduler step per engine step: the high-noise expert (``transformer``) while the
             timestep is at or above ``boundary_ratio`` × the training steps, the low-noise expert
             (``transformer_2``) below it (Wan 2.2 A14B; a Wan 2.1 directory has one expert); under
             guidance the conditional and unconditional branches of all rows run as ONE batched
             forward (``cfg_one_pass``; the pipeline makes two calls), and under a step cache
             (:mod:`.step_cache`) only the branches it computes run, the others reuse their residual
    DECODE   the causal 3D VAE over the whole clip of every row in one step (its temporal cache
             runs from the first frame, so it does not decode slices on its own)
    MUX      the engine's, as for every video

So a Wan batch reports progress after every step, a cancel takes its request's row out at the
next step boundary (:func:`~.video.keep_rows` also cuts the rows of UniPC's history), and the
worker's loop heartbeats in between — where ``WanPipeline.__call__`` would hold the loop for the
whole clip. With ``cfg_one_pass=False`` and no step cache, a batch of one equals ``pipeline(prompt,
negative_prompt=…, height, width, num_frames, num_inference_steps, guidance_scale,
generator=torch.Generator().manual_seed(seed), output_type="np")`` (same operations in the same
order; ``tests/e2e/test_wan.py`` checks it bit for bit); the one-pass default equals it within float
rounding (``tests/engine/test_step_cache.py``), and a larger batch gives each row the frames of its
batch of one up to float rounding (``tests/e2e/test_video_batching.py``).

Scope: text to video with ``expand_timesteps`` off (the A14B and 2.1 checkpoints); the TI2V-5B
layout (per-token timesteps) goes through the pipeline's own call (:func:`.video.runner_for`).
"""

from __future__ import annotations

import torch

from omnirelay.workers.generate.video import JobPhase, VideoJob, keep_rows, to_uint8

MAX_TEXT_TOKENS = 512    # what WanPipeline.__call__ pads prompts to (encode_prompt's own default is 226)


class StepwiseWanRunner:
    """Drives a ``WanPipeline`` one phase or denoising step per call, reproducing its ``__call__``
    over a batch of rows."""

    caches_steps = True      # the engine may give its batches a tea_cache or static StepCache

    def __init__(self, pipe, *, cfg_one_pass: bool = True):
        """``cfg_one_pass``: a guided step's two branches as one batched forward (False: two
        forwards, as ``WanPipeline.__call__`` makes them — bit for bit its output)."""
        self.pipe = pipe
        self.cfg_one_pass = cfg_one_pass
        first = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
        self.device = first.device
        self.dtype = first.dtype
        self.in_channels = int(first.config.in_channels)

    @torch.inference_mode()
    def advance(self, job: VideoJob) -> None:
        """Do the job's next unit of work; moves ``job.phase`` on (to MUX once the clip is decoded)."""
        pipe, params, guided = self.pipe, job.params, job.guided
        if job.phase is JobPhase.PROMPT:
            tasks = job.tasks
            positive, negative = pipe.encode_prompt(
                prompt=[t.params.prompt for t in tasks], negative_prompt=[t.params.negative_prompt for t in tasks],
                do_classifier_free_guidance=guided, num_videos_per_prompt=1, device=self.device,
                max_sequence_length=MAX_TEXT_TOKENS)
            job.prompt_embeds = positive.to(self.dtype)
            job.negative_embeds = negative.to(self.dtype) if guided else None
            job.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            job.scheduler.set_timesteps(params.num_inference_steps, device=self.device)
            job.scheduler.set_begin_index(0)
            job.generators = [torch.Generator().manual_seed(t.params.seed) for t in tasks]
            job.latents = pipe.prepare_latents(len(tasks), self.in_channels, params.height, params.width,
                                               params.num_frames, torch.float32, self.device, job.generators)
            job.phase = JobPhase.DENOISE
        elif job.phase is JobPhase.DENOISE:
            self._denoise(job)
        elif job.phase is JobPhase.DECODE:
            vae = pipe.vae
            latents = job.latents.to(vae.dtype)
            shape = (1, vae.config.z_dim, 1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
            video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
            videos = pipe.video_processor.postprocess_video(video, output_type="np")
            job.frames = [to_uint8(frames) for frames in videos]
            job.phase = JobPhase.MUX
            job.latents = job.prompt_embeds = job.negative_embeds = None   # free them before the encoder runs
        else:
            raise AssertionError(f"runner asked to advance a job in phase {job.phase}")

    def _denoise(self, job: VideoJob) -> None:
        """One scheduler step: the branches the step cache computes run as ONE transformer forward
        (rows × branches, the conditional rows first), the skipped ones reuse their residual; then
        classifier-free guidance and the scheduler step."""
        scheduler, params, cache = job.scheduler, job.params, job.step_cache
        t = scheduler.timesteps[job.step_index]
        model = self._expert(t, scheduler.config.num_train_timesteps)
        latents = job.latents
        inputs = latents.to(self.dtype)
        rows = latents.shape[0]
        embeds = [job.prompt_embeds] + ([job.negative_embeds] if job.guided else [])
        cache.use_model("transformer" if model is self.pipe.transformer else "transformer_2")
        probe = wan_modulated_input(model, inputs, t.expand(rows), job.prompt_embeds) if cache.needs_probe else None
        plan = cache.plan(job.step_index, len(embeds), probe)
        computing = [b for b, computes in enumerate(plan) if computes]
        outputs: list[torch.Tensor | None] = [None] * len(embeds)
        if computing and self.cfg_one_pass:
            batch = len(computing)
            noise = model(hidden_states=inputs.repeat(batch, 1, 1, 1, 1), timestep=t.expand(rows * batch),
                          encoder_hidden_states=torch.cat([embeds[b] for b in computing]), return_dict=False)[0]
            for b, part in zip(computing, noise.chunk(batch)):
                outputs[b] = part
        else:
            for b in computing:
                outputs[b] = model(hidden_states=inputs, timestep=t.expand(rows), encoder_hidden_states=embeds[b],
                                   return_dict=False)[0]
        for b in range(len(embeds)):
            if outputs[b] is None:
                outputs[b] = cache.reuse(b, inputs)
            else:
                cache.record(b, inputs, outputs[b])
        noise = outputs[0]
        if job.guided:
            uncond = outputs[1]
            noise = uncond + params.guidance_scale * (noise - uncond)
        job.latents = scheduler.step(noise, t, latents, return_dict=False)[0]
        job.step_index += 1
        if job.step_index >= len(scheduler.timesteps):
            job.phase = JobPhase.DECODE

    def keep_rows(self, job: VideoJob, rows: list[int]) -> None:
        keep_rows(job, rows)   # UniPC steps the latents as they are: its history's rows are the batch's

    def _expert(self, t: torch.Tensor, train_steps: int):
        """The transformer for timestep ``t``: Wan 2.2 hands over from the high-noise expert to the
        low-noise one at ``boundary_ratio``; without a boundary there is one."""
        pipe = self.pipe
        boundary = pipe.config.boundary_ratio
        if boundary is None or t >= boundary * train_steps:
            return pipe.transformer
        return pipe.transformer_2


def wan_modulated_input(model, hidden_states: torch.Tensor, timestep: torch.Tensor,
                        encoder_hidden_states: torch.Tensor) -> torch.Tensor:
    """TeaCache's probe for Wan: the input of the first block's self-attention as the block
    modulates it by the timestep, ``norm1(patches)·(1 + scale(t)) + shift(t)`` (the patch
    embedding, the condition embedder and one layer norm: a small share of a forward)."""
    tokens = model.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
    _, projection, _, _ = model.condition_embedder(timestep, encoder_hidden_states, None)
    block = model.blocks[0]
    shift, scale = (block.scale_shift_table + projection.unflatten(1, (6, -1)).float()).chunk(6, dim=1)[:2]
    return block.norm1(tokens.float()) * (1 + scale) + shift
