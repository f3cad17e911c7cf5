"""Z-Image text-to-image driven one unit of work per engine step (the image engine's runner for
``ZImagePipeline``).

A batch crosses the phases of :class:`~.image.Batch` as a Stable Diffusion batch does::

    ENCODE   Qwen3 embeddings of every item's prompt (a list: one tensor per prompt, of its own
             length) and, under guidance, of its negative prompt; latents (rows, 16, H/8, W/8), row i
             from its own seeded generator; the batch's own flow-match scheduler over Z-Image's
             default sigmas, shifted for the image's token count
    DENOISE  one scheduler step per engine step: the transformer over every row (and, under
             guidance, every row's negative branch in the same call, as the pipeline makes it),
             ``pos + g·(pos − neg)``, the negated prediction stepped
    DECODE   the VAE (scaling and shift factors) → PIL images

So a Z-Image batch heartbeats between steps, takes a cancel at the next step (its rows are cut out
of the latents and the embedding lists) and the engine counts its steps — where the pipeline's
``__call__`` held the worker's loop for the whole batch. A batch equals ``pipeline(prompts,
generator=[…], …)`` for the same seeds: the same operations in the same order
(``tests/e2e/test_zimage.py`` compares the images byte for byte). Not reproduced: ``cfg_normalization``
and a ``cfg_truncation`` below 1 (the pipeline's defaults are off and 1.0, and requests cannot set them).
"""

from __future__ import annotations

import torch

from omnirelay.workers.generate.image import Batch, BatchPhase, ImageItem

MAX_TEXT_TOKENS = 512     # ZImagePipeline.__call__'s max_sequence_length


class StepwiseZImageRunner:
    """Drives a ``ZImagePipeline`` one phase or denoising step per call over a batch of items of
    one size, step count and guidance scale."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.device = pipe.transformer.device

    def batch_key(self, item: ImageItem) -> tuple:
        return item.width, item.height, item.steps, item.guidance_scale

    @torch.inference_mode()
    def advance(self, batch: Batch) -> list | None:
        """Do the batch's next unit of work; return the PIL images once decoded, else None."""
        if batch.phase is BatchPhase.ENCODE:
            self._encode(batch)
            return None
        if batch.phase is BatchPhase.DENOISE:
            self._denoise(batch)
            return None
        pipe = self.pipe
        latents = batch.latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        return pipe.image_processor.postprocess(pipe.vae.decode(latents, return_dict=False)[0], output_type="pil")

    def _encode(self, batch: Batch) -> None:
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, retrieve_timesteps
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        pipe, items = self.pipe, batch.items
        negatives = [it.negative_prompt for it in items] if any(it.negative_prompt for it in items) else None
        batch.prompt_embeds, batch.negative_embeds = pipe.encode_prompt(
            prompt=[it.prompt for it in items], negative_prompt=negatives, do_classifier_free_guidance=_guided(batch),
            device=self.device, max_sequence_length=MAX_TEXT_TOKENS)
        batch.generators = [torch.Generator().manual_seed(it.seed) for it in items]
        batch.latents = pipe.prepare_latents(len(items), pipe.transformer.in_channels, items[0].height,
                                             items[0].width, torch.float32, self.device, batch.generators)
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        config = scheduler.config
        tokens = (batch.latents.shape[2] // 2) * (batch.latents.shape[3] // 2)
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        retrieve_timesteps(scheduler, items[0].steps, self.device, sigmas=get_default_z_image_sigmas(items[0].steps),
                           mu=mu)
        scheduler.set_begin_index(0)
        batch.scheduler = scheduler
        batch.phase = BatchPhase.DENOISE

    def _denoise(self, batch: Batch) -> None:
        pipe, scheduler = self.pipe, batch.scheduler
        t = scheduler.timesteps[batch.step_index]
        latents = batch.latents
        rows = latents.shape[0]
        timestep = (1000 - t.expand(rows)) / 1000
        typed = latents.to(pipe.transformer.dtype)
        guided = _guided(batch)
        if guided:
            inputs, embeds, timestep = typed.repeat(2, 1, 1, 1), batch.prompt_embeds + batch.negative_embeds, \
                timestep.repeat(2)
        else:
            inputs, embeds = typed, batch.prompt_embeds
        outputs = pipe.transformer(list(inputs.unsqueeze(2).unbind(dim=0)), timestep, embeds, return_dict=False)[0]
        if guided:
            scale = batch.items[0].guidance_scale
            noise = torch.stack([pos.float() + scale * (pos.float() - neg.float())
                                 for pos, neg in zip(outputs[:rows], outputs[rows:])])
        else:
            noise = torch.stack([out.float() for out in outputs])
        noise = -noise.squeeze(2)
        batch.latents = scheduler.step(noise.to(torch.float32), t, latents, return_dict=False)[0]
        batch.step_index += 1
        if batch.step_index >= len(scheduler.timesteps):
            batch.phase = BatchPhase.DECODE

    def keep_rows(self, batch: Batch, rows: list[int]) -> None:
        """Cut the rows of cancelled items out of a batch in flight (the embeddings are lists)."""
        batch.items = [batch.items[i] for i in rows]
        batch.generators = [batch.generators[i] for i in rows] if batch.generators else []
        if batch.latents is not None:
            batch.latents = batch.latents.index_select(0, torch.tensor(rows, dtype=torch.long,
                                                                       device=batch.latents.device))
        for name in ("prompt_embeds", "negative_embeds"):
            embeds = getattr(batch, name)
            if embeds:
                setattr(batch, name, [embeds[i] for i in rows])


def _guided(batch: Batch) -> bool:
    """Z-Image guides at any positive scale (``pos + g·(pos − neg)``: g is the extra weight), not
    above 1 as Stable Diffusion does."""
    return batch.items[0].guidance_scale > 0
