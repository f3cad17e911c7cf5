"""What one forward pass computes, as a handful of integer tensors.

The engines describe a step as a list of sequence chunks: for each sequence, the new tokens to run
(one for a decode step, a whole prompt or a chunk of it for prefill), the position of the first one
(= tokens of this sequence already in the KV cache: an earlier chunk or a prefix-cache hit) and
the sequence's block table. :meth:`ForwardBatch.build` packs that into flat tensors once per step;
everything per layer (slots to write, gather indices, masks) is derived once here, never inside the
layer loop. Being tensors only, a batch can be broadcast as-is from rank 0 to the other ranks of a
tensor/pipeline-parallel group (:mod:`omnirelay.workers.llm.parallel`).

Engines build a batch on the CPU; the runner moves it to its rank's device once per step
(:meth:`ForwardBatch.to`). The per-sequence lengths are also kept as Python lists from the CPU copy,
so planning a prefill step on a GPU never waits for the device.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class ForwardBatch:
    """``T`` new tokens of ``B`` sequences, packed sequence after sequence.

    input_ids, positions, slots: [T]; ``slots`` is the flat KV slot (block * block_size + offset)
        each new token's K/V is written to.
    query_lens:   [B] new tokens per sequence (their sum is T).
    context_lens: [B] tokens in the cache for each sequence *after* this step (prefix + new).
    block_tables: [B, W] block ids of each sequence, padded with block 0 (never written by anyone).

    Multimodal models (Qwen2.5-Omni's thinker) add two optional fields; None keeps the text path:
    rope_positions: [T] or [3, T] rotary positions when they differ from ``positions`` (M-RoPE:
        temporal/height/width positions of media tokens; decode: token index + the request's rope
        delta). ``positions`` stays the token's index in the sequence (its KV slot).
    embeds: ``(index [K], values [K, hidden])``: rows of the packed tokens whose input embedding is
        ``values`` (encoder outputs at media placeholders) instead of the token's embedding.
    deepstack: ``(index [V], values [L, V, hidden])`` (Qwen3-Omni's DeepStack): after decoder layer
        ``i < L`` the hidden states of rows ``index`` (image tokens) get ``values[i]`` added.
    lora_slots: [T] the LoRA adapter slot of each token (-1: the base), or None when no sequence of
        the step has an adapter (:mod:`omnirelay.workers.llm.lora`).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    rope_positions: torch.Tensor | None = None
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    deepstack: tuple[torch.Tensor, torch.Tensor] | None = None
    lora_slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.num_seqs = int(self.query_lens.shape[0])
        self.num_tokens = int(self.input_ids.shape[0])
        self.is_decode = self.num_tokens == self.num_seqs
        self.last_index = torch.cumsum(self.query_lens, 0) - 1
        self._plan: dict = {}
        # (query_lens, context_lens) as lists, read where the tensors are on the host.
        self._host_lens: tuple[list[int], list[int]] | None = None

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> "ForwardBatch":
        """The same batch with every tensor on ``device`` (itself when already there)."""
        device = torch.device(device)
        if self.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        out = ForwardBatch(*(move(t) for t in (self.input_ids, self.positions, self.slots, self.query_lens,
                                                 self.context_lens, self.block_tables)), self.block_size,
                           rope_positions=move(self.rope_positions),
                           embeds=None if self.embeds is None else (move(self.embeds[0]), move(self.embeds[1])),
                           deepstack=None if self.deepstack is None else (move(self.deepstack[0]),
                                                                          move(self.deepstack[1])),
                           lora_slots=move(self.lora_slots))
        out._host_lens = self._lens()
        return out

    def _lens(self) -> tuple[list[int], list[int]]:
        if self._host_lens is None:
            self._host_lens = (self.query_lens.tolist(), self.context_lens.tolist())
        return self._host_lens

    @classmethod
    def build(cls, chunks: list[tuple[list[int], int, list[int]]], block_size: int) -> "ForwardBatch":
        """``chunks``: per sequence ``(new_token_ids, start_position, block_ids)``; the blocks must
        cover ``start_position + len(new_token_ids)`` tokens."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        width = max(len(blocks) for _, _, blocks in chunks)
        tables = torch.zeros((len(chunks), width), dtype=torch.long)
        for row, (tokens, start, blocks) in enumerate(chunks):
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            context_lens.append(start + len(tokens))
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        positions_t = torch.tensor(positions, dtype=torch.long)
        query_lens_t = torch.tensor(query_lens, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(chunks)), query_lens_t)
        slots = tables[rows, positions_t // block_size] * block_size + positions_t % block_size
        return cls(torch.tensor(ids, dtype=torch.long), positions_t, slots, query_lens_t,
                   torch.tensor(context_lens, dtype=torch.long), tables, block_size)

    @classmethod
    def decode(cls, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               block_size: int) -> "ForwardBatch":
        """One new token per sequence, at ``positions`` (vectorised: no per-sequence Python)."""
        rows = torch.arange(block_tables.shape[0], device=block_tables.device)
        slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
        ones = torch.ones_like(positions)
        return cls(input_ids, positions, slots, ones, positions + 1, block_tables, block_size)

    # ------------------------------------------------------------------ derived, once per step

    def decode_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat block ids to gather [B * W], boolean mask of real keys [B, 1, 1, W * block_size])."""
        if "decode" not in self._plan:
            span = self.block_tables.shape[1] * self.block_size
            valid = torch.arange(span, device=self.device)[None, :] < self.context_lens[:, None]
            self._plan["decode"] = (self.block_tables.reshape(-1), valid[:, None, None, :])
        return self._plan["decode"]

    def prefill_plan(self) -> list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]:
        """Per sequence ``(start, end, blocks, mask)`` in the packed tokens; ``blocks``/``mask`` are
        None when the sequence has no cached prefix (attend to its own new keys, causally), else
        the blocks holding its whole context and the bottom-right causal mask [n, context]."""
        if "prefill" not in self._plan:
            plan = []
            start = 0
            for n, ctx, table in zip(*self._lens(), self.block_tables):
                if ctx == n:
                    plan.append((start, start + n, None, None))
                else:
                    nblocks = -(-ctx // self.block_size)
                    # Query i (absolute position ctx - n + i) sees keys 0 .. ctx - n + i.
                    mask = torch.ones(n, ctx, dtype=torch.bool, device=self.device).tril(ctx - n)
                    plan.append((start, start + n, table[:nblocks].clone(), mask))
                start += n
            self._plan["prefill"] = plan
        return self._plan["prefill"]

    def tensors(self) -> list[torch.Tensor]:
        """The fields that travel to the other ranks, in a fixed order (see :meth:`from_tensors`)."""
        return [self.input_ids, self.positions, self.slots, self.query_lens, self.context_lens,
                self.block_tables.reshape(-1)]

    @classmethod
    def from_tensors(cls, parts: list[torch.Tensor], width: int, block_size: int) -> "ForwardBatch":
        ids, positions, slots, query_lens, context_lens, tables = parts
        return cls(ids, positions, slots, query_lens, context_lens, tables.view(-1, width), block_size)
