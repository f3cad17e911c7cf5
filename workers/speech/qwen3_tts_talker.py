"""Qwen3-TTS's talker, stepped by us: the package's ``Qwen3TTSForConditionalGeneration.generate``
(speaker voice, language "auto", ``non_streaming_mode``) cut into a prompt forward per request and
decode steps that several requests share (step_batch.py).

The prompt, as that ``generate`` builds it for one text: the role tokens ``<|im_start|>assistant\\n``
projected, then tts pads over the codec think controls (or the dialect's language id) and the
speaker's codec id, tts bos over codec pad; then the whole text projected and closed by tts eos,
over codec pads; then tts pad over codec bos. Every step after reads tts pad as its text.

A decode step is Qwen3-Omni's (qwen3_talker.py): the code predictor fills in the other codebooks
of the last first-codebook code, the sum of the step's code embeddings plus tts pad goes through
the talker, and the next first-codebook code is sampled (the checkpoint's ``generation_config``
sampling, at least 2 codes before EOS, the control range suppressed). This talker computes its
M-RoPE positions inside its forward, one offset for the whole batch, and runs the code predictor
there too, so a batched step calls the talker's decoder and codec head directly with each row's
own positions.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from omnirelay.workers.speech.qwen3_talker import Qwen3Row, finish_step, step_inputs
from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.talker_batch import BatchKV, KVRow, RowSampler


def prompt(model, ids: list[int], voice: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker's prompt embeddings [1, n, H] for ``ids`` (``<|im_start|>assistant\\n`` TEXT
    ``<|im_end|>\\n<|im_start|>assistant\\n``) spoken by ``voice``, and the tts pad row [H]."""
    cfg, talker = model.config, model.talker
    tc = cfg.talker_config
    text = talker.get_text_embeddings()
    codec = talker.get_input_embeddings()

    def codec_rows(*codes: int) -> torch.Tensor:
        return codec(torch.tensor([codes], dtype=torch.long, device=device))

    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    tts_bos, tts_eos, tts_pad = talker.text_projection(text(torch.tensor(
        [[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]], device=device))).chunk(3, dim=1)
    dialect = tc.spk_is_dialect[voice]
    controls = ((tc.codec_think_id, tc.codec_think_bos_id, tc.codec_language_id[dialect], tc.codec_think_eos_id)
                if dialect else (tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id))
    speaker = codec(torch.tensor(tc.spk_id[voice], device=device)).view(1, 1, -1)
    codecs = torch.cat((codec_rows(*controls), speaker, codec_rows(tc.codec_pad_id)), dim=1)
    head = torch.cat((tts_pad.expand(-1, codecs.shape[1] - 1, -1), tts_bos), dim=1) + codecs
    body = tokens[:, 3:-5]
    spoken = torch.cat((talker.text_projection(text(body)), tts_eos), dim=1) \
        + codec_rows(*[tc.codec_pad_id] * (body.shape[1] + 1))
    embeds = torch.cat((talker.text_projection(text(tokens[:, :3])), head, spoken,
                        tts_pad + codec_rows(tc.codec_bos_id)), dim=1)
    return embeds, tts_pad[0, 0]


def start(model, embeds: torch.Tensor, generator: torch.Generator, sampling: dict) -> Qwen3Row:
    """The prompt forward of one request and its first code. Call holding the engine's turn: the
    forward sets the shared talker's ``rope_deltas``."""
    talker, tc = model.talker, model.config.talker_config
    device = embeds.device
    cache = DynamicCache()
    out = talker(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long, device=device),
                 past_key_values=cache, use_cache=True, generation_step=-1)
    suppress = [i for i in range(tc.vocab_size - 1024, tc.vocab_size) if i != tc.codec_eos_token_id]
    row = Qwen3Row(KVRow(cache, cache.get_seq_length(), int(talker.rope_deltas[0, 0])),
                   RowSampler(generator, greedy=not sampling.get("do_sample", True),
                              top_k=sampling.get("top_k", 50), top_p=sampling.get("top_p", 1.0),
                              temperature=sampling.get("temperature", 0.9),
                              repetition_penalty=sampling.get("repetition_penalty", 1.05),
                              min_new_tokens=(2, tc.codec_eos_token_id), suppress=suppress, device=device),
                   RowSampler(generator, greedy=not sampling.get("subtalker_dosample", True),
                              top_k=sampling.get("subtalker_top_k", 50), top_p=sampling.get("subtalker_top_p", 1.0),
                              temperature=sampling.get("subtalker_temperature", 0.9), device=device),
                   out.past_hidden[0, -1], [])
    row.first_codes.append(row.talker.sample(out.logits[0, -1], torch.zeros(0, dtype=torch.long, device=device)))
    return row


def step(model, batch_kv: BatchKV, seats: list[Seat]) -> None:
    """One talker step of every seat's request (a :class:`~omnirelay.workers.speech.step_batch.StepBatch` run)."""
    talker = model.talker
    rows: list[Qwen3Row] = [seat.state for seat in seats]
    codes, inputs_embeds = step_inputs(talker, rows, cache_name="past_key_values")
    cache, mask, positions = batch_kv.take([r.kv for r in rows])
    # The talker's own forward would run the code predictor itself (from the global random stream)
    # and place every row at one position: its decoder and head are called as that forward calls them.
    out = talker.model(inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True,
                       cache_position=torch.tensor([mask.shape[1] - 1], device=mask.device))
    batch_kv.advance()
    hidden = out.last_hidden_state[:, -1]
    finish_step(rows, codes, talker.codec_head(hidden), hidden)
