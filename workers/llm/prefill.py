"""Prefill engine: prompts → first token + KV cache handed to decode through the connector.

Life of a request through this engine::

    add(PrefillTask) ──▶ waiting (FIFO)
        ──admit: blocks for the whole prompt; the longest cached prefix is reused, not recomputed──▶
    running ──step() × k: its next chunk joins one packed forward with the other running prompts,
        within ``max_batched_tokens`` per step (a long prompt takes several steps: chunked prefill)──▶
    last chunk done: sample the first token ──▶ its KV (all heads) is under ``kv/<request_id>/<attempt>``
        ──▶ PrefillResult(handles); blocks released, the full ones stay cached under their content
        hash for the next prompt that shares the prefix

How the KV leaves (``kv_transfer``): ``"auto"`` (the default) streams layers for a step whose finishing
sequences hold at least ``layerwise_min_bytes`` of KV, and puts it whole otherwise. ``"layerwise"`` puts
each layer of the sequences whose last chunk runs in a step while that step's later layers still
compute, and the manifest last (:mod:`~omnirelay.workers.kv.export`); the step returns once every
piece is out. ``"whole"`` (and any tensor/pipeline-parallel group, whose heads and layers sit on other
ranks) reads the finished sequence out of the pool after the forward and puts it as one tensor.
Decode reads either format.

A multimodal request (Qwen2.5-Omni) arrives with the encode stage's handles: at admission its
image/audio embeddings are fetched from the connector (the key is deleted when the prefill ends,
finished or cancelled, so a retry after this worker died still finds it) and its M-RoPE positions
and rope delta computed (:mod:`~omnirelay.mrope`); each chunk's forward then takes the
embeddings at the placeholder rows and the 3-row rotary positions. Such a prompt bypasses the
prefix cache (its placeholder token ids say nothing about the media behind them), and the rope
delta travels to decode in the outputs. Text-only prompts take exactly the text path.

Structured output (``PrefillTask.structured``): the first token is sampled under the request's
grammar (:mod:`~omnirelay.workers.llm.structured_output`; the matcher is built at admission, a resumed
stream's emitted tokens replayed, and dropped when the request leaves: decode rebuilds its own).

A request whose first token already ends it (EOS, a stop token, ``max_tokens == 1``) finishes here:
no KV is handed off and the decode stage is skipped. ``cancel`` drops a waiting or running request
and frees its blocks. A request waits (never fails) while the pool is short; only a prompt larger
than the whole pool fails (``out_of_memory``). The engine holds no sockets; the worker runtime feeds
it tasks and sends its results.

Prefix hits are visible to routing: :meth:`PrefillEngine.prefix_hit_tokens` says how many tokens of a
prompt this worker would reuse now, and :meth:`PrefillEngine.prefix_events` hands out the block
hashes cached and evicted since the last call (what a heartbeat would carry to the broker).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from omnirelay.broker.protocol import StructuredOutput
from omnirelay.connectors import Connector
from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, OutOfMemory

from omnirelay.block_hash import block_hashes
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.handoffs import EmbedsHandoff, Handoff, KVHandoff, SpeechHandoff, delete_quietly, release_kv
from omnirelay.workers.kv.export import LAYERWISE_MIN_BYTES, TRANSFER_MODES, ExportSequence, LayerwiseExport
from omnirelay.workers.llm.logits_processors import LogitsProcessors, TokenHistory
from omnirelay.workers.llm.model_runner import LocalRunner, ModelRunner, local_runner, logits_for_sampling
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.mrope import MropeSpec, mrope_positions
from omnirelay.workers.kv.prefix_cache import PrefixCachingAllocator
from omnirelay.workers.llm.sampling import SamplingParams, TokenLogprobs, chosen_logprobs, sample
from omnirelay.workers.llm.stopping import finish_reason_for
from omnirelay.workers.llm.structured_output import GrammarSampler

DEFAULT_KV_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass
class PrefillTask:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float
    attempt: int = 0
    position_offset: int = 0
    media: EmbedsHandoff | None = None    # the encode stage's outputs
    # Speech out (Qwen2.5-Omni): "" none; "reply": decode speaks its reply after us; "prompt": the
    # prompt's tail is the text to speak (/v1/audio/speech), so generate follows even if we finish.
    speech: str = ""
    structured: StructuredOutput | None = None   # the output must match this grammar


@dataclasses.dataclass
class _Media:
    """A multimodal prompt's extras, resolved at admission."""

    rope: torch.Tensor           # [3, n] M-RoPE positions of the prompt
    rope_delta: int              # decode positions are token index + this
    index: torch.Tensor          # [K] prompt rows taking an encoder output, ascending
    embeds: torch.Tensor         # [K, hidden] in the same order
    key: str                     # the encoder outputs' connector key, deleted when the prefill ends
    # Qwen3-Omni's DeepStack: the image rows (ascending) and the features added to them after the
    # first decoder layers, [L, V, hidden]; None for other models and prompts without images.
    deep_index: torch.Tensor | None = None
    deep: torch.Tensor | None = None


@dataclasses.dataclass
class PrefillResult:
    request_id: str
    first_token: int | None = None
    position: int = 0
    finish_reason: str = ""
    outputs: Handoff | None = None   # for the next stage: KV for decode, or prompt states for speech
    error_type: str = ""
    message: str = ""
    speech_next: bool = False   # the request goes on to a speech stage although its text finished
    logprobs: TokenLogprobs | None = None   # the first token's, when the request asked


@dataclasses.dataclass
class _Running:
    task: PrefillTask
    blocks: list[int]
    hashes: list[bytes]
    computed: int     # prompt tokens whose KV is in the blocks (cached prefix + chunks done)
    named: int        # leading blocks already registered under their hash
    media: _Media | None = None
    hidden: list = dataclasses.field(default_factory=list)   # speech: final-norm states per chunk


class PrefillEngine:
    """``model``: a :class:`LlamaModel` (a local pool of ``kv_cache_bytes`` is made for it) or a
    :class:`ModelRunner` (e.g. rank 0 of a tensor-parallel group). ``grammars``: structured
    output support (None: a request that asks for it fails as ``bad_request``)."""

    def __init__(self, model: LlamaModel | ModelRunner, connector: Connector, *, max_model_len: int,
                 max_batch: int = 16, max_batched_tokens: int = 256, kv_cache_bytes: int = DEFAULT_KV_BYTES,
                 block_size: int = 16, prefix_caching: bool = True, mrope: MropeSpec | None = None,
                 transfer_timeout_s: float = 30.0, kv_transfer: str = "auto",
                 layerwise_min_bytes: int = LAYERWISE_MIN_BYTES, grammars: GrammarSampler | None = None):
        if kv_transfer not in TRANSFER_MODES:
            raise ValueError(f"kv_transfer must be one of {', '.join(TRANSFER_MODES)}, got {kv_transfer!r}")
        self.runner = (local_runner(model, block_size=block_size, budget_bytes=kv_cache_bytes)
                       if isinstance(model, LlamaModel) else model)
        self.connector = connector
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.mrope = mrope                 # set for a model with media inputs
        self.transfer_timeout_s = transfer_timeout_s
        # A group's KV heads and layers are on other ranks: only a local runner streams layers.
        self.kv_transfer = kv_transfer if isinstance(self.runner, LocalRunner) else "whole"
        self.layerwise_min_bytes = layerwise_min_bytes
        self.block_size = self.runner.block_size
        self.allocator = PrefixCachingAllocator(self.runner.num_blocks)
        self.waiting: collections.deque[PrefillTask] = collections.deque()
        self.running: list[_Running] = []
        self.stats = collections.Counter()
        self.grammars = grammars
        self.processors = LogitsProcessors(self.runner.config.eos_token_ids)
        self._grammar_complete: set[str] = set()   # requests whose first token completed their grammar

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, task: PrefillTask) -> None:
        self.waiting.append(task)

    def cancel(self, request_id: str) -> bool:
        for task in self.waiting:
            if task.request_id == request_id:
                self.waiting.remove(task)
                return True
        for seq in self.running:
            if seq.task.request_id == request_id:
                self._retire(seq)
                return True
        return False

    def prefix_hit_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens whose KV this worker holds now (what routing would maximise)."""
        if not self.prefix_caching:
            return 0
        usable = block_hashes(token_ids, self.block_size)[: (len(token_ids) - 1) // self.block_size]
        return len(self.allocator.match(usable)) * self.block_size

    def prefix_events(self) -> tuple[list[bytes], list[bytes]]:
        return self.allocator.drain_events()

    def prefix_names(self) -> list[bytes]:
        return self.allocator.names()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[PrefillResult]:
        results: list[PrefillResult] = []
        self._expire(results)
        self._admit(results)
        if self.running:
            self._forward(results)
        return results

    def _expire(self, results: list[PrefillResult]) -> None:
        now = time.time()
        for seq in [s for s in self.running if now > s.task.deadline]:
            self._retire(seq)
            results.append(PrefillResult(seq.task.request_id, error_type=DeadlineExceeded.error_type,
                                         message="deadline passed during prefill"))

    def _admit(self, results: list[PrefillResult]) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            task = self.waiting[0]
            n = len(task.prompt_token_ids)
            if time.time() > task.deadline:
                self.waiting.popleft()
                results.append(PrefillResult(task.request_id, error_type=DeadlineExceeded.error_type,
                                             message="deadline passed before prefill"))
                continue
            if not n or n >= self.max_model_len:
                self.waiting.popleft()
                results.append(PrefillResult(task.request_id, error_type=BadRequest.error_type,
                                             message=f"prompt of {n} tokens does not fit max_model_len {self.max_model_len}"))
                continue
            if task.media and not isinstance(self.runner, LocalRunner):
                # A parallel group's broadcast carries token ids and positions only, not embeddings.
                self.waiting.popleft()
                task.media.release(self.connector)
                results.append(PrefillResult(task.request_id, error_type=BadRequest.error_type,
                                             message="image/audio input needs a single-process prefill worker "
                                                     "(tensor and pipeline parallel size 1)"))
                continue
            if task.speech and not isinstance(self.runner, LocalRunner):
                self.waiting.popleft()
                results.append(PrefillResult(task.request_id, error_type=BadRequest.error_type,
                                             message="speech output needs a single-process prefill worker "
                                                     "(tensor and pipeline parallel size 1)"))
                continue
            grammar_error = self._grammar_error(task)
            if grammar_error:
                self.waiting.popleft()
                results.append(PrefillResult(task.request_id, error_type=BadRequest.error_type, message=grammar_error))
                continue
            total = -(-n // self.block_size)
            if total > self.runner.num_blocks - 1:
                self.waiting.popleft()
                results.append(PrefillResult(task.request_id, error_type=OutOfMemory.error_type,
                                             message=f"prompt of {n} tokens exceeds the prefill KV pool"))
                continue
            # Placeholder ids say nothing about the media behind them: a media prompt neither reuses
            # nor publishes cached blocks.
            hashes = block_hashes(task.prompt_token_ids, self.block_size) if self.prefix_caching and not task.media else []
            # The last prompt token is always computed: its logits give the first output token.
            # A speech request needs every prompt token's hidden state: no cached prefix is skipped.
            hits = [] if task.speech else self.allocator.match(hashes[: (n - 1) // self.block_size])
            self.allocator.acquire(hits)
            if total - len(hits) > self.allocator.free:
                self.allocator.release(hits)
                return   # wait for running prompts to finish and give their blocks back
            self.waiting.popleft()
            media = None
            if task.media:
                try:
                    media = self._load_media(task)
                except (OmniError, ValueError, KeyError, TypeError) as exc:
                    task.media.release(self.connector)
                    results.append(PrefillResult(task.request_id, error_type=getattr(exc, "error_type", BadRequest.error_type),
                                                 message=f"multimodal inputs: {exc}"))
                    continue
            blocks = hits + self.allocator.allocate(total - len(hits))
            cached = len(hits) * self.block_size
            self.running.append(_Running(task, blocks, hashes, computed=cached, named=len(hits), media=media))
            self.stats["prefix_cached_tokens"] += cached
            self.stats["prefix_hit_requests"] += bool(hits)

    def _load_media(self, task: PrefillTask) -> _Media:
        """Fetch the encoder outputs and place them: placeholder rows, M-RoPE positions, rope delta."""
        if self.mrope is None:
            raise ValueError("this model takes no media inputs")
        media = task.media
        # The key stays until this prefill ends (_retire): a retry elsewhere after our death reads it.
        payload = self.connector.get(media.mm_key, media.mm_handle, timeout=self.transfer_timeout_s)
        ids = torch.tensor(task.prompt_token_ids)
        rows, values = [], []
        for token, name in ((self.mrope.image_token_id, "image_embeds"), (self.mrope.audio_token_id, "audio_embeds")):
            where = torch.nonzero(ids == token).flatten()
            embeds = payload.get(name)
            count = 0 if embeds is None else embeds.shape[0]
            if count != len(where):
                raise ValueError(f"{len(where)} placeholder tokens for {count} encoder outputs ({name})")
            if count:
                rows.append(where)
                values.append(embeds)
        rope, delta = mrope_positions(task.prompt_token_ids, self.mrope, [list(g) for g in media.image_grids],
                                      list(media.audio_lengths))
        index = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        order = torch.argsort(index)
        embeds = torch.cat(values)[order] if values else torch.empty(0, self.runner.config.hidden_size)
        deep_index, deep = None, payload.get("image_deepstack")
        if deep is not None:
            deep_index = torch.nonzero(ids == self.mrope.image_token_id).flatten()
            if deep.dim() != 3 or deep.shape[1] != len(deep_index):
                raise ValueError(f"DeepStack features {tuple(deep.shape)} for {len(deep_index)} image tokens")
        self.stats["media_prompts"] += 1
        return _Media(rope, delta, index[order], embeds, media.mm_key, deep_index, deep)

    def _media_fields(self, chunks: list[tuple["_Running", int]]) -> dict:
        """ForwardBatch extras for a step with multimodal prompts: 3-row rotary positions for every
        packed token (text prompts repeat their positions) and the embeddings at placeholder rows."""
        if not any(seq.media is not None for seq, _ in chunks):
            return {}
        rope, index, values, offset = [], [], [], 0
        deep_rows, deep_values = [], []
        for seq, n in chunks:
            lo, hi = seq.computed, seq.computed + n
            if seq.media is None:
                rope.append(torch.arange(lo, hi).expand(3, n))
            else:
                rope.append(seq.media.rope[:, lo:hi])
                inside = (seq.media.index >= lo) & (seq.media.index < hi)
                index.append(seq.media.index[inside] - lo + offset)
                values.append(seq.media.embeds[inside])
                if seq.media.deep is not None:
                    inside = (seq.media.deep_index >= lo) & (seq.media.deep_index < hi)
                    deep_rows.append(seq.media.deep_index[inside] - lo + offset)
                    deep_values.append(seq.media.deep[:, inside])
            offset += n
        fields = {"rope_positions": torch.cat(rope, dim=1)}
        if index:
            fields["embeds"] = (torch.cat(index), torch.cat(values))
        if deep_rows:
            fields["deepstack"] = (torch.cat(deep_rows), torch.cat(deep_values, dim=1))
        return fields

    def _forward(self, results: list[PrefillResult]) -> None:
        chunks: list[tuple[_Running, int]] = []
        budget = self.max_batched_tokens
        for seq in self.running:
            if budget <= 0:
                break
            n = min(len(seq.task.prompt_token_ids) - seq.computed, budget)
            chunks.append((seq, n))
            budget -= n
        batch = ForwardBatch.build(
            [(seq.task.prompt_token_ids[seq.computed: seq.computed + n], seq.computed, seq.blocks) for seq, n in chunks],
            self.block_size)
        for name, value in self._media_fields(chunks).items():
            setattr(batch, name, value)
        export = self._start_export([seq for seq, n in chunks if seq.computed + n == len(seq.task.prompt_token_ids)])
        try:
            logits = self._forward_batch(batch, chunks, export)
            self.stats["prefill_steps"] += 1
            done_rows, done = [], []
            for row, (seq, n) in enumerate(chunks):
                seq.computed += n
                self.stats["prefill_tokens"] += n
                self._name_full_blocks(seq)
                if seq.computed == len(seq.task.prompt_token_ids):
                    done_rows.append(row)
                    done.append(seq)
            if not done:
                return
            params = [s.task.params for s in done]
            done_logits = logits_for_sampling(logits[done_rows], params)
            grammar_rows = [self._grammar_row(s.task) for s in done]
            sample_logits = self.grammars.mask(done_logits, grammar_rows) if self.grammars else done_logits
            histories = [TokenHistory(s.task.prompt_token_ids, s.task.position_offset) for s in done]
            tokens = sample(self.processors.apply(sample_logits, params, histories), params,
                            [s.task.position_offset for s in done])
            if self.grammars:
                self._grammar_complete = {s.task.request_id for s, ended
                                          in zip(done, self.grammars.accept(grammar_rows, tokens)) if ended}
            logprobs = chosen_logprobs(done_logits, params, tokens)
            exported = {}
            if export is not None:   # manifests for the sequences that go on to decode; the rest deleted
                exported = export.complete({self._kv_key(s.task) for s, t in zip(done, tokens)
                                            if not self._finish_reason(s, t)})
            for seq, token, token_logprobs in zip(done, tokens, logprobs):
                result = self._finish(seq, token, exported.get(self._kv_key(seq.task)))
                result.logprobs = token_logprobs
                results.append(result)
        finally:   # the step owns the export's thread: joined, and the pieces deleted, on any exception
            if export is not None:
                export.abort()

    def _start_export(self, finishing: list[_Running]) -> LayerwiseExport | None:
        """A layerwise export of the sequences whose last chunk runs in this step (None: whole)."""
        if self.kv_transfer == "whole" or not finishing:
            return None
        if self.kv_transfer == "auto":
            per_token = self.runner.cache.bytes_per_block // self.block_size
            if sum(len(s.task.prompt_token_ids) for s in finishing) * per_token < self.layerwise_min_bytes:
                return None
        sequences = [ExportSequence(self._kv_key(s.task), s.blocks, len(s.task.prompt_token_ids)) for s in finishing]
        return LayerwiseExport(self.connector, self.runner.cache, sequences, len(self.runner.model.layers))

    @staticmethod
    def _kv_key(task: PrefillTask) -> str:
        return f"kv/{task.request_id}/{task.attempt}"

    def _grammar_error(self, task: PrefillTask) -> str:
        """Why ``task``'s grammar cannot be enforced here ("" when it can, or it has none)."""
        if task.structured is None:
            return ""
        if self.grammars is None:
            return "this prefill worker has no structured output support"
        try:
            self.grammars.prepare(self._grammar_row(task))
        except ValueError as exc:
            return str(exc)
        return ""

    def _grammar_row(self, task: PrefillTask):
        if self.grammars is None:
            return None
        return self.grammars.row(task.request_id, task.structured, task.prompt_token_ids, task.position_offset)

    def _finish_reason(self, seq: _Running, token: int) -> str:
        if seq.task.request_id in self._grammar_complete:
            return "stop"
        n = len(seq.task.prompt_token_ids)
        return finish_reason_for(token, 1, n + 1, seq.task.params, self.runner.config.eos_token_ids,
                                 self.max_model_len)

    def _forward_batch(self, batch: ForwardBatch, chunks: list[tuple["_Running", int]],
                       export: LayerwiseExport | None = None):
        """One forward (streaming each layer's KV to ``export``); for speech requests also keep
        their tokens' final-norm hidden states."""
        speech = [seq.task.speech for seq, _ in chunks]
        on_layer = {} if export is None else {"on_layer": export.layer_done}   # LocalRunner only
        if not any(speech):
            return self.runner.forward(batch, **on_layer)
        model = self.runner.model   # LocalRunner only: _admit refuses speech on a parallel group
        model.capture_hidden = True
        try:
            logits = self.runner.forward(batch, **on_layer)
            hidden = model.captured_hidden
        finally:
            model.capture_hidden, model.captured_hidden = False, None
        start = 0
        for seq, n in chunks:
            if seq.task.speech:
                seq.hidden.append(hidden[start:start + n].clone())
            start += n
        return logits

    def _put_speech(self, seq: _Running) -> SpeechHandoff:
        """Hand the prompt's hidden states to the speech stage (through decode, or straight)."""
        key = f"speech/{seq.task.request_id}/{seq.task.attempt}/prompt"
        media = seq.task.media   # the talker places media tokens as the thinker does (M-RoPE)
        handle = self.connector.put(key, {"hidden": torch.cat(seq.hidden),
                                          "image_grids": [list(g) for g in media.image_grids] if media else [],
                                          "audio_lengths": list(media.audio_lengths) if media else []})
        self.stats["speech_handoffs"] += 1
        return SpeechHandoff(key, handle)

    def _name_full_blocks(self, seq: _Running) -> None:
        full = min(seq.computed // self.block_size, len(seq.hashes))
        for index in range(seq.named, full):
            self.allocator.register(seq.blocks[index], seq.hashes[index])
        seq.named = max(seq.named, full)

    def _finish(self, seq: _Running, token: int, exported: dict | OmniError | None = None) -> PrefillResult:
        """``exported``: the layerwise export's manifest handle (or its error) for this sequence;
        None: the KV goes whole, from here."""
        task = seq.task
        n = len(task.prompt_token_ids)
        reason = self._finish_reason(seq, token)
        result = PrefillResult(task.request_id, first_token=token, position=task.position_offset, finish_reason=reason)
        speech = None
        try:
            if task.speech == "prompt" or (task.speech and not reason):
                try:
                    speech = result.outputs = self._put_speech(seq)
                except OmniError as exc:
                    if isinstance(exported, dict):   # already exported: nobody will import it now
                        release_kv(self.connector, self._kv_key(task), exported)
                    return PrefillResult(task.request_id, error_type=exc.error_type, message=str(exc))
                result.speech_next = True
            if not reason:
                key = self._kv_key(task)
                if isinstance(exported, OmniError):
                    if speech is not None:   # the request fails: nobody will read the prompt states
                        speech.release(self.connector)
                    return PrefillResult(task.request_id, error_type=exported.error_type, message=str(exported))
                if exported is not None:
                    handle = exported
                    self.stats["kv_layerwise_handoffs"] += 1
                else:
                    try:
                        handle = self._export_kv(key, seq.blocks, n)
                    except OmniError as exc:
                        if speech is not None:
                            speech.release(self.connector)
                        return PrefillResult(task.request_id, error_type=exc.error_type, message=str(exc))
                self.stats["kv_handoffs"] += 1
                media = seq.media
                result.outputs = KVHandoff(key, handle, token, rope_delta=media.rope_delta if media else 0,
                                           has_media=media is not None,
                                           speech_prompt_key=speech.speech_prompt_key if speech else "",
                                           speech_prompt_handle=speech.speech_prompt_handle if speech else None)
            return result
        finally:
            self._retire(seq)

    def _export_kv(self, key: str, blocks: list[int], num_tokens: int) -> dict:
        """Gather the sequence's KV straight into connector memory and publish it (one copy fewer
        than gathering into a tensor for ``put`` to copy out)."""
        reservation = self.connector.reserve({"kv": self.runner.kv_spec(num_tokens)})
        try:
            self.runner.read_kv(blocks, num_tokens, out=reservation.tensors["kv"])
        except BaseException:
            self.connector.release(reservation)
            raise
        return self.connector.put_reserved(key, reservation, {"num_tokens": num_tokens})

    def _retire(self, seq: _Running) -> None:
        self.running.remove(seq)
        if self.grammars is not None:
            self.grammars.release(seq.task.request_id)
        self.allocator.release(seq.blocks)
        if seq.media is not None:
            delete_quietly(self.connector, seq.media.key)
