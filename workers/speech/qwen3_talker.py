"""Qwen3-Omni's talker, stepped by us: transformers' ``generate`` of
``Qwen3OmniMoeTalkerForConditionalGeneration`` cut into a prompt forward per request and decode
steps that several requests share (step_batch.py).

One talker step of a request, as ``generate`` runs it (its ``prepare_inputs_for_generation``):

1. the code predictor fills in the other ``num_code_groups - 1`` codebooks of the last sampled
   first-codebook code: a fresh little generation over [the talker's last hidden state, that
   code's embedding], one codebook per sub-step (top-k 50, top-p 0.8);
2. the talker's next input is the sum of the embeddings of all the step's codes plus the next row
   of the trailing text (tts pad past its end);
3. one talker forward; its first-codebook code is sampled (top-k 50, temperature 0.9, repetition
   penalty 1.05 over the codes so far, the control range suppressed).

Batched, every sub-step is one forward for all requests: the code predictor's caches are fresh
each step, so its rows are always the same length; the talker's caches are laid side by side by
:class:`~omnirelay.workers.speech.talker_batch.BatchKV`. Each request samples from its own
generator in ``generate``'s order (the talker's code, then that code's residuals, …).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache

from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.talker_batch import BatchKV, KVRow, RowSampler, sample_rows

TALKER_SAMPLING = {"top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05}
PREDICTOR_SAMPLING = {"top_k": 50, "top_p": 0.8}   # what the talker's generate() asks of the code predictor


@dataclasses.dataclass(eq=False)
class Qwen3Row:
    """One request's talker between steps."""
    kv: KVRow
    talker: RowSampler
    predictor: RowSampler
    past_hidden: torch.Tensor          # [H]: the talker's last-layer state at its last position
    first_codes: list[int]             # the first-codebook codes sampled so far (the last not yet stepped)
    text_row: torch.Tensor | None = None   # [H]: the trailing text of the next step (set before it rides)
    codes: torch.Tensor | None = None      # [groups]: the last step's codes (set by the step)

    @property
    def sampled(self) -> int:
        return len(self.first_codes)


def start(talker, inputs: dict, generator: torch.Generator, suppress: list[int]) -> Qwen3Row:
    """The prompt forward of one request (``inputs``: what ``generate`` would get) and its first
    code. Call holding the engine's turn: the forward sets the shared talker's ``rope_deltas``."""
    cache = DynamicCache()
    device = inputs["inputs_embeds"].device
    out = talker(**inputs, cache=cache, use_cache=True, output_hidden_states=True)
    row = Qwen3Row(KVRow(cache, cache.get_seq_length(), int(talker.rope_deltas[0, 0])),
                   RowSampler(generator, suppress=suppress, device=device, **TALKER_SAMPLING),
                   RowSampler(generator, device=device, **PREDICTOR_SAMPLING),
                   out.hidden_states[0][-1][0, -1], [])
    row.first_codes.append(row.talker.sample(out.logits[0, -1], torch.zeros(0, dtype=torch.long, device=device)))
    return row


def step(talker, batch_kv: BatchKV, seats: list[Seat]) -> None:
    """One talker step of every seat's request (a :class:`~omnirelay.workers.speech.step_batch.StepBatch` run)."""
    rows: list[Qwen3Row] = [seat.state for seat in seats]
    codes, inputs_embeds = step_inputs(talker, rows)
    cache, mask, positions = batch_kv.take([r.kv for r in rows])
    out = talker(inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=positions, cache=cache,
                 use_cache=True, output_hidden_states=True, generation_step=0)
    batch_kv.advance()
    finish_step(rows, codes, out.logits[:, -1], out.hidden_states[0][-1][:, -1])


def step_inputs(talker, rows: list[Qwen3Row], cache_name: str = "cache") -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–2 for a batch: the code predictor's other codebooks of each row's last first-codebook
    code (one little generation for the whole batch: its caches are fresh, so every row is the
    same length) and the talker's next input (the step's code embeddings summed, plus the row's
    text). Returns the step's codes [B, groups] and the input [B, 1, H]. ``cache_name``: what the
    predictor calls its cache (transformers' ``cache``; the qwen_tts package's ``past_key_values``)."""
    device = rows[0].past_hidden.device
    last = torch.tensor([[r.first_codes[-1]] for r in rows], dtype=torch.long, device=device)
    embeds = [talker.get_input_embeddings()(last)]                       # [B, 1, H] per codebook
    codes = [last]
    predictor = talker.code_predictor
    no_ids = [torch.zeros(0, dtype=torch.long, device=device)] * len(rows)
    out = predictor(inputs_embeds=torch.cat((torch.stack([r.past_hidden for r in rows])[:, None], embeds[0]), dim=1),
                    use_cache=True, **{cache_name: DynamicCache()})
    for group in range(1, talker.config.num_code_groups):
        drawn = torch.tensor(sample_rows([r.predictor for r in rows], out.logits[:, -1], no_ids),
                             dtype=torch.long, device=device)[:, None]
        codes.append(drawn)
        embeds.append(predictor.get_input_embeddings()[group - 1](drawn))
        if group < talker.config.num_code_groups - 1:
            out = predictor(input_ids=drawn, use_cache=True, generation_steps=group,
                            **{cache_name: getattr(out, cache_name)})
    text = torch.stack([r.text_row for r in rows])[:, None].to(embeds[0].dtype)
    return torch.cat(codes, dim=1), torch.cat(embeds, dim=1).sum(1, keepdim=True) + text


def finish_step(rows: list[Qwen3Row], codes: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """Step 3's end for a batch: each row's step codes, its new last state, its next first-codebook code."""
    device = logits.device
    seen = [torch.tensor(r.first_codes, dtype=torch.long, device=device) for r in rows]
    for i, (row, code) in enumerate(zip(rows, sample_rows([r.talker for r in rows], logits, seen))):
        row.codes = codes[i]
        row.past_hidden = hidden[i]
        row.first_codes.append(code)
