"""Qwen2.5-Omni's talker, stepped by us: transformers' ``generate`` of
``Qwen2_5OmniTalkerForConditionalGeneration`` cut into a prompt forward per request and decode
steps that several requests share (step_batch.py).

A decode step of a request, as ``generate`` runs it: the input is the embedding of the last codec
token plus the request's next reply row (``thinker_reply_part``: the thinker's state + embedding of
the next reply token, then text EOS, then text pads), one talker forward, and the next codec token
sampled (top-k 40, top-p 0.8, temperature 0.9, repetition penalty 1.05 over the codec prompt and
the codes so far, codec BOS suppressed). Batched, the rows' caches are laid side by side by
:class:`~omnirelay.workers.speech.talker_batch.BatchKV` and each row samples from its own generator.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache

from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.talker_batch import BatchKV, KVRow, RowSampler, sample_rows

TALKER_SAMPLING = {"top_k": 40, "top_p": 0.8, "temperature": 0.9, "repetition_penalty": 1.05}


@dataclasses.dataclass(eq=False)
class Qwen2_5Row:
    """One request's talker between steps."""
    kv: KVRow
    sampler: RowSampler
    seen: list[int]                    # the codec prompt and every code sampled (the last not yet stepped)
    prompt_len: int
    reply_row: torch.Tensor | None = None   # [H]: what the next step reads (set before it rides)

    @property
    def sampled(self) -> int:
        return len(self.seen) - self.prompt_len

    @property
    def last(self) -> int:
        return self.seen[-1]


def start(talker, inputs: dict, generator: torch.Generator) -> Qwen2_5Row:
    """The prompt forward of one request (``inputs``: what ``generate`` would get) and its first
    code. Call holding the engine's turn: the forward sets the shared talker's ``rope_deltas``."""
    cache = DynamicCache()
    prompt = inputs["input_ids"]
    out = talker(**inputs, use_audio_in_video=False, cache=cache, use_cache=True)
    sampler = RowSampler(generator, suppress=[talker.codec_bos_token], device=prompt.device, **TALKER_SAMPLING)
    row = Qwen2_5Row(KVRow(cache, cache.get_seq_length(), int(talker.rope_deltas[0, 0])), sampler,
                     [int(t) for t in prompt[0]], prompt.shape[1])
    row.seen.append(sampler.sample(out.logits[0, -1], prompt[0]))
    return row


def step(talker, batch_kv: BatchKV, seats: list[Seat]) -> None:
    """One talker step of every seat's request (a :class:`~omnirelay.workers.speech.step_batch.StepBatch` run)."""
    rows: list[Qwen2_5Row] = [seat.state for seat in seats]
    device = rows[0].reply_row.device
    last = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=device)
    reply = torch.stack([r.reply_row for r in rows])[:, None]
    cache, mask, positions = batch_kv.take([r.kv for r in rows])
    out = talker(input_ids=last, thinker_reply_part=reply, attention_mask=mask, position_ids=positions,
                 cache=cache, use_cache=True)
    batch_kv.advance()
    logits = out.logits[:, -1]
    seen = [torch.tensor(r.seen, dtype=torch.long, device=device) for r in rows]
    for row, code in zip(rows, sample_rows([r.sampler for r in rows], logits, seen)):
        row.seen.append(code)
