"""Prefill engine: prompts → first token + KV cache handed to decode through the connector.

Life of a request through this engine::

    add(PrefillTask) ──▶ waiting (FIFO)
        ──admit: blocks for the whole prompt; the longest cached prefix is reused, not recomputed──▶
    running ──step() × k: its next chunk joins one packed forward with the other running prompts,
        within ``max_batched_tokens`` per step (a long prompt takes several steps: chunked prefill)──▶
    last chunk done: sample the first token (FirstToken, to the gateway at once) ──▶ sending: its KV
        (all heads) goes under ``kv/<request_id>/<attempt>`` while the batch keeps stepping
        ──▶ PrefillResult(handles) once the hand-off is out; blocks released, the full ones stay
        cached under their content hash for the next prompt that shares the prefix

How the KV leaves (``kv_transfer``): ``"auto"`` (the default) streams layers for a step whose
finishing sequences hold at least ``layerwise_min_bytes`` of KV, and puts it whole otherwise.
``"layerwise"`` puts each layer of the sequences finishing in a step while its later layers still
compute, and the manifest last (:mod:`~omnirelay.workers.kv.export`). ``"whole"`` (and any
tensor/pipeline-parallel group, whose heads and layers sit on other ranks) gathers the finished
sequence out of the pool into connector memory and publishes it as one tensor. Decode reads either.

Prefill never blocks its batch on a transfer: every connector call is a job of the worker's
:class:`~omnirelay.workers.runtime.transfers.TransferPool` (the jobs are in
:mod:`~omnirelay.workers.llm.handoff_jobs`). A media prompt's encoder outputs are fetched while it
waits, and text prompts behind it are admitted meanwhile. A step's hand-offs (whole KVs, the
layerwise export's completion, speech prompt states) go out in one job, on a transfer thread, and
are reported in the first step after it; on shared memory, whose writes cannot wait
(``Connector.local_writes``), the pool runs that job inline and the step itself reports them. A
whole KV's blocks are free once gathered; a layerwise step's stay held until its export is complete.

A multimodal request (Qwen2.5-Omni) arrives with the encode stage's handles. Its embeddings' key is
deleted when the prefill ends, finished or cancelled, so a retry after this worker died still
finds it. At admission they are placed and its M-RoPE positions and rope delta computed
(:mod:`~omnirelay.workers.llm.prefill_media`); each chunk's forward takes the embeddings at the
placeholder rows. Such a prompt bypasses the prefix cache (its placeholder ids say nothing about
the media), and the rope delta travels to decode in the outputs.

Structured output (``TextParams.structured``): the first token is sampled under the request's
grammar (:mod:`~omnirelay.workers.llm.structured_output`; the matcher is built at admission, a resumed
stream's emitted tokens replayed, and dropped when the request leaves: decode rebuilds its own).

A request whose first token already ends it (EOS, a stop token, ``max_tokens == 1``) finishes here
and skips decode. ``cancel`` drops a waiting, running or sending request and frees its blocks (a
hand-off on its way is deleted when its job returns). A request waits (never fails) while the pool
is short; only a prompt larger than the whole pool fails (``out_of_memory``). The engine holds no
sockets; its owner calls :meth:`PrefillEngine.close` before closing the connector (it joins the
transfer threads, see ``TransferPool.CLOSE_JOIN_S``).

A request asking for its prompt's logprobs (``PrefillTask.prompt_logprobs``) takes no cached prefix
and has its prompt tokens scored by the forwards that prefill them; they leave with its first
token. ``PrefillTask.cache_salt`` salts its prefix-cache block names (``omnirelay.block_hash``).

Prefix hits are visible to routing: :meth:`PrefillEngine.prefix_hit_tokens` says how many tokens of a
prompt this worker would reuse now, and :meth:`PrefillEngine.prefix_events` hands out the block
hashes cached and evicted since the last call (what a heartbeat would carry to the broker).
"""

from __future__ import annotations

import collections
import dataclasses
import time


from omnirelay.block_hash import block_hashes
from omnirelay.connectors import Connector
from omnirelay.connectors.base import Payload, Reservation
from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, OutOfMemory
from omnirelay.handoffs import EmbedsHandoff, Handoff, KVHandoff, delete_quietly, kv_key, speech_prompt_key
from omnirelay.mrope import MropeSpec
from omnirelay.workers.kv.export import LAYERWISE_MIN_BYTES, TRANSFER_MODES, ExportSequence, LayerwiseExport
from omnirelay.workers.kv.prefix_cache import PrefixCachingAllocator
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.llm.lora import LoraSlots
from omnirelay.workers.llm.logits_processors import LogitsProcessors, TokenHistory
from omnirelay.workers.llm.model_runner import ModelRunner, local_runner
from omnirelay.workers.llm.models.llama import HiddenCapture, LlamaModel
from omnirelay.workers.llm.prefill_media import PlacedMedia, media_fields, place_media
from omnirelay.workers.llm.prompt_logprobs import PromptCapture, PromptLogprobs
from omnirelay.workers.llm.handoff_jobs import (HandoffSend, MediaFetch, OutgoingHandoff, SentHandoff,
                                                     speech_payload)
from omnirelay.request_params import TextParams
from omnirelay.workers.llm.sampling import TokenLogprobs, sample_step
from omnirelay.workers.llm.stopping import finish_reason_for
from omnirelay.workers.llm.structured_output import GrammarSampler
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.runtime.transfers import Transfer, TransferPool, TransferState

DEFAULT_KV_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass
class PrefillTask:
    request_id: str
    prompt_token_ids: list[int]
    params: TextParams
    deadline: float
    attempt: int = 0
    position_offset: int = 0
    media: EmbedsHandoff | None = None    # the encode stage's outputs
    # Speech out (Qwen2.5-Omni): "" none; "reply": decode speaks its reply after us; "prompt": the
    # prompt's tail is the text to speak (/v1/audio/speech), so generate follows even if we finish.
    speech: str = ""
    priority: int = 0   # Task.priority: the waiting queue's order (request_queue.py)
    prompt_logprobs: int = -1   # k >= 0: the prompt tokens' logprobs and top k (prompt_logprobs.py)
    cache_salt: str = ""   # enters the prefix-cache block names: equal prompts of other salts share nothing


@dataclasses.dataclass
class PrefillResult:
    request_id: str
    first_token: int | None = None
    position: int = 0
    finish_reason: str = ""
    outputs: Handoff | None = None   # for the next stage: KV for decode, or prompt states for speech
    speech_next: bool = False   # the request goes on to a speech stage although its text finished
    logprobs: TokenLogprobs | None = None   # the first token's, when the request asked
    token_sent: bool = False    # its first token was reported already, as a FirstToken
    prompt_logprobs: PromptLogprobs | None = None   # the request asked (PrefillTask.prompt_logprobs)
    cached_tokens: int = 0      # prompt tokens taken from the prefix cache, not computed


@dataclasses.dataclass
class FirstToken:
    """A first token reported as soon as it is sampled, while the request's hand-off is still on its
    way: time to first token does not wait for the KV transfer. Its PrefillResult follows
    (``token_sent``), or, if the hand-off fails, a RequestFailure (the broker then restarts the request
    from its first stage, as after a failed import in decode)."""

    request_id: str
    token: int
    position: int
    finish_reason: str = ""
    logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0      # PrefillResult.cached_tokens
    prompt_logprobs: PromptLogprobs | None = None   # PrefillResult.prompt_logprobs


# What a step reports of a request: an early first token, prefilled (its first token and hand-off),
# or failed.
PrefillOutcome = PrefillResult | FirstToken | RequestFailure


@dataclasses.dataclass
class _Running:
    task: PrefillTask
    blocks: list[int]
    hashes: list[bytes]
    computed: int     # prompt tokens whose KV is in the blocks (cached prefix + chunks done)
    named: int        # leading blocks already registered under their hash
    cached: int = 0   # prompt tokens found in the prefix cache at admission (not computed)
    media: PlacedMedia | None = None
    hidden: list = dataclasses.field(default_factory=list)   # speech: captured states per chunk
    prompt_lp: PromptLogprobs | None = None   # the prompt's logprobs so far, when the request asked


@dataclasses.dataclass
class _Handoff:
    """A finished prefill whose hand-off is on a transfer thread: its result, less the outputs."""

    result: PrefillResult
    kv_key: str = ""          # "" when no KV goes on
    layers: int = 0           # the KV's layout (KVHandoff.layers): 0 whole, else one piece per layer
    speech: bool = False      # prompt states go to the speech stage
    rope_delta: int = 0
    has_media: bool = False
    dropped: bool = False     # cancelled meanwhile: what arrives is deleted, nothing reported
    lora: str = ""            # the LoRA adapter the KV was computed under ("": the base)


@dataclasses.dataclass
class _Sending:
    """One step's hand-off job and the requests waiting on it."""

    ticket: Transfer[dict[str, SentHandoff]]
    handoffs: list[_Handoff]
    held_blocks: list[int]    # a layerwise export reads them until its job has completed it


class PrefillEngine:
    """``model``: a :class:`LlamaModel` (a local pool of ``kv_cache_bytes`` is made for it) or a
    :class:`ModelRunner` (e.g. rank 0 of a tensor-parallel group). ``grammars``: structured
    output support (None: a request that asks for it fails as ``bad_request``). ``transfer_threads``:
    the threads of its :class:`~omnirelay.workers.runtime.transfers.TransferPool`."""

    # A step with nothing to run sleeps at most this long for a transfer to finish. A broker message
    # for the loop ends the wait at once (wake(), from the broker link's thread); the bound is for
    # the heartbeat, which the loop sends between steps.
    IDLE_WAIT_S = 0.02

    def __init__(self, model: LlamaModel | ModelRunner, connector: Connector, *, max_model_len: int,
                 max_batch: int = 16, max_batched_tokens: int = 256, kv_cache_bytes: int = DEFAULT_KV_BYTES,
                 block_size: int = 16, prefix_caching: bool = True, mrope: MropeSpec | None = None,
                 transfer_timeout_s: float = 30.0, kv_transfer: str = "auto",
                 layerwise_min_bytes: int = LAYERWISE_MIN_BYTES, grammars: GrammarSampler | None = None,
                 transfer_threads: int = 2, lora: LoraSlots | None = None):
        if kv_transfer not in TRANSFER_MODES:
            raise ValueError(f"kv_transfer must be one of {', '.join(TRANSFER_MODES)}, got {kv_transfer!r}")
        self.runner: ModelRunner = (local_runner(model, block_size=block_size, budget_bytes=kv_cache_bytes)
                                    if isinstance(model, LlamaModel) else model)
        self.connector = connector
        self.max_batch = max_batch
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.mrope = mrope                 # set for a model with media inputs
        self.transfer_timeout_s = transfer_timeout_s
        # A group's KV heads and layers are on other ranks: only an in-process runner streams layers.
        self.kv_transfer = kv_transfer if self.runner.in_process else "whole"
        self.layerwise_min_bytes = layerwise_min_bytes
        self.block_size = self.runner.block_size
        self.allocator = PrefixCachingAllocator(self.runner.num_blocks)
        self.waiting: RequestQueue[PrefillTask] = RequestQueue()
        self.running: list[_Running] = []
        self.stats = collections.Counter()
        self.grammars = grammars
        self.lora = lora    # None: LoRA off, a request naming an adapter is refused
        self.processors = LogitsProcessors(self.runner.config.eos_token_ids)
        self._grammar_complete: set[str] = set()   # requests whose first token completed their grammar
        # Media fetches and hand-off sends are each held to one batch's worth by the engine (see
        # _start_media_fetches and _admit), so the pool's own bound never makes a send wait behind
        # fetched payloads that wait for blocks a send holds.
        self._transfers = TransferPool(connector, timeout_s=transfer_timeout_s, max_held=2 * max_batch,
                                       threads=transfer_threads, name="prefill-transfer")
        self._media_fetches: dict[str, Transfer[Payload]] = {}   # waiting request → its encoder outputs' get
        self._sending: list[_Sending] = []

    @property
    def num_requests(self) -> int:
        """Requests waiting or running: what the worker's credits count. One whose hand-off is on
        its way uses no compute and holds its place no longer (a new prompt may start meanwhile;
        _admit holds admissions back while a batch of hand-offs is stuck)."""
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._sending)

    @property
    def num_sending(self) -> int:
        """Requests whose hand-off is on its way (prefilled, not yet reported)."""
        return sum(not h.dropped for s in self._sending for h in s.handoffs)

    def add(self, task: PrefillTask) -> None:
        self.waiting.add(task)

    def cancel(self, request_id: str) -> bool:
        if self.waiting.remove(request_id) is not None:
            self._cancel_fetch(request_id)
            return True
        for seq in self.running:
            if seq.task.request_id == request_id:
                self._retire(seq)
                return True
        for sending in self._sending:
            for handoff in sending.handoffs:
                if handoff.result.request_id == request_id and not handoff.dropped:
                    handoff.dropped = True   # its job runs out; what it put is deleted when it returns
                    return True
        return False

    def wake(self) -> None:
        """A broker message is waiting for the loop: end a step's idle wait on transfers now."""
        self._transfers.poke()

    def close(self) -> None:
        """Stop the transfer threads, discarding what is queued or on its way, and join them for at
        most ``TransferPool.CLOSE_JOIN_S``. Call before closing the connector. Idempotent. The
        encoder outputs of prompts still waiting stay: the runtime hands those requests back to the
        broker (worker_lost), whose retry elsewhere reads them; a hand-off already put is deleted
        (the retry prefills under a new attempt, with new keys)."""
        for fetch in self._media_fetches.values():
            fetch.job.delete_on_discard = False
        self._transfers.close()

    def prefix_hit_tokens(self, token_ids: list[int], lora: str = "", cache_salt: str = "") -> int:
        """Prompt tokens whose KV this worker holds now (what routing would maximise); ``lora``:
        the adapter the prompt would run under, ``cache_salt`` its request's salt."""
        if not self.prefix_caching:
            return 0
        usable = block_hashes(token_ids, self.block_size, lora, cache_salt)[: (len(token_ids) - 1) // self.block_size]
        return len(self.allocator.match(usable)) * self.block_size

    def prefix_events(self) -> tuple[list[bytes], list[bytes]]:
        return self.allocator.drain_events()

    def prefix_names(self) -> list[bytes]:
        return self.allocator.names()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[PrefillOutcome]:
        results: list[PrefillOutcome] = []
        self._collect_sent(results)
        self._expire(results)
        self._start_media_fetches(results)
        self._admit(results)
        if self.running:
            self._forward(results)
        self._collect_sent(results)
        self.stats["transfers_inflight"] = pending = self._transfers.num_pending   # a gauge
        if pending and not (self.running or results):   # never delays what this step made
            self._transfers.wait_for_news(self.IDLE_WAIT_S)
        return results

    def _expire(self, results: list[PrefillOutcome]) -> None:
        for task in self.waiting.pop_expired():
            self._cancel_fetch(task.request_id)
            results.append(RequestFailure(task.request_id, DeadlineExceeded.error_type,
                                         message="deadline passed before prefill"))
        now = time.time()
        for seq in [s for s in self.running if now > s.task.deadline]:
            self._retire(seq)
            results.append(RequestFailure(seq.task.request_id, DeadlineExceeded.error_type,
                                         message="deadline passed during prefill"))

    def _refusal(self, task: PrefillTask) -> tuple[str, str] | None:
        """(error_type, message) when this worker can never prefill ``task``; cheap checks only."""
        n = len(task.prompt_token_ids)
        if not n or n >= self.max_model_len:
            return BadRequest.error_type, f"prompt of {n} tokens does not fit max_model_len {self.max_model_len}"
        if task.media and not self.runner.in_process:
            # A parallel group's broadcast carries token ids and positions only, not embeddings.
            return BadRequest.error_type, ("image/audio input needs a single-process prefill worker "
                                           "(tensor and pipeline parallel size 1)")
        if task.media and self.mrope is None:
            return BadRequest.error_type, "multimodal inputs: this model takes no media inputs"
        if task.speech and not self.runner.in_process:
            return BadRequest.error_type, ("speech output needs a single-process prefill worker "
                                           "(tensor and pipeline parallel size 1)")
        if task.prompt_logprobs >= 0 and not self.runner.in_process:
            return BadRequest.error_type, ("prompt_logprobs need a single-process prefill worker "
                                           "(tensor and pipeline parallel size 1)")
        if -(-n // self.block_size) > self.runner.num_blocks - 1:
            return OutOfMemory.error_type, f"prompt of {n} tokens exceeds the prefill KV pool"
        if task.params.lora:
            error = (f"LoRA adapter {task.params.lora!r}: LoRA is not enabled on this worker" if self.lora is None
                     else self.lora.ensure(task.params.lora, task.params.lora_path))
            if error:
                return BadRequest.error_type, error
        return None

    def _running_loras(self) -> set[str]:
        return {seq.task.params.lora for seq in self.running}

    def held_loras(self) -> list[str] | None:
        """The adapters this worker holds (slots, and its requests'), for the broker; None: LoRA off."""
        if self.lora is None:
            return None
        return self.lora.held(self._running_loras() | {task.params.lora for task in self.waiting})

    def _start_media_fetches(self, results: list[PrefillOutcome]) -> None:
        """Start the encoder outputs' gets of new media prompts (failing first those this worker can
        never serve, so their outputs are never read). Here rather than in add(): a cancel before
        the first step then deletes the key at once, with no get racing it."""
        for task in list(self.waiting):
            if len(self._media_fetches) >= self.max_batch:   # host memory: one batch of payloads at most
                return
            if task.media is None or task.request_id in self._media_fetches:
                continue
            refusal = self._refusal(task)
            if refusal is not None:
                self._refuse(task, refusal, results)
                continue
            self._media_fetches[task.request_id] = self._transfers.submit(MediaFetch(task.media, task.deadline))

    def _refuse(self, task: PrefillTask, refusal: tuple[str, str], results: list[PrefillOutcome]) -> None:
        self.waiting.remove_task(task)
        if task.request_id in self._media_fetches:
            self._cancel_fetch(task.request_id)   # the fetch owns the media key: it deletes it
        elif task.media is not None:
            self._transfers.release(task.media.mm_key, task.media.release)
        results.append(RequestFailure(task.request_id, refusal[0], refusal[1]))

    def _cancel_fetch(self, request_id: str) -> None:
        ticket = self._media_fetches.pop(request_id, None)
        if ticket is not None:
            self._transfers.cancel(ticket)

    def _admit(self, results: list[PrefillOutcome]) -> None:
        """Admit waiting prompts in order while batch slots and blocks last. A media prompt whose
        encoder outputs are still on their way is passed over, not waited for. While a batch's worth
        of hand-offs is still on its way (a store that stalls), nothing new is admitted: their
        connector memory, and a layerwise step's blocks, are not given back until they are out."""
        if self.num_sending >= self.max_batch:
            return
        for task in list(self.waiting):
            if len(self.running) >= self.max_batch:
                return
            fetch = self._media_fetches.get(task.request_id)
            if task.media is not None:
                if fetch is None or not fetch.finished:
                    continue
                if fetch.state is TransferState.FAILED:   # the fetch deleted the key before failing
                    del self._media_fetches[task.request_id]
                    self.waiting.remove_task(task)
                    results.append(RequestFailure(task.request_id, fetch.error.error_type,
                                                 message=f"multimodal inputs: {fetch.error}"))
                    continue
            refusal = self._refusal(task)
            if refusal is None and (grammar_error := self._grammar_error(task)):
                refusal = BadRequest.error_type, grammar_error
            if refusal is not None:
                self._refuse(task, refusal, results)
                continue
            n = len(task.prompt_token_ids)
            total = -(-n // self.block_size)
            # Placeholder ids say nothing about the media behind them: a media prompt neither reuses
            # nor publishes cached blocks.
            if self.lora is not None and not self.lora.fits(task.params.lora, self._running_loras()):
                continue   # a step holds at most max_loras adapters: wait for a slot's sequences
            hashes = (block_hashes(task.prompt_token_ids, self.block_size, task.params.lora, task.cache_salt)
                      if self.prefix_caching and not task.media else [])
            # The last prompt token is always computed: its logits give the first output token.
            # A speech request needs every prompt token's hidden state, prompt logprobs every prompt
            # token's logits: no cached prefix is skipped.
            fresh = task.speech or task.prompt_logprobs >= 0
            hits = [] if fresh else self.allocator.match(hashes[: (n - 1) // self.block_size])
            self.allocator.acquire(hits)
            if total - len(hits) > self.allocator.free:
                self.allocator.release(hits)
                return   # wait for running prompts to finish and give their blocks back
            self.waiting.remove_task(task)
            media = None
            if fetch is not None:
                del self._media_fetches[task.request_id]
                with self._transfers.take(fetch) as payload:   # the media key is ours now: _retire deletes it
                    try:
                        media = place_media(task.prompt_token_ids, task.media, payload, self.mrope,
                                            self.runner.config.hidden_size)
                    except (ValueError, KeyError, TypeError) as exc:
                        self._transfers.release(task.media.mm_key, task.media.release)
                        self.allocator.release(hits)
                        results.append(RequestFailure(task.request_id, BadRequest.error_type,
                                                     message=f"multimodal inputs: {exc}"))
                        continue
                self.stats["media_prompts"] += 1
            blocks = hits + self.allocator.allocate(total - len(hits))
            cached = len(hits) * self.block_size
            self.running.append(_Running(task, blocks, hashes, computed=cached, named=len(hits), cached=cached,
                                         media=media, prompt_lp=PromptLogprobs(task.prompt_logprobs)
                                         if task.prompt_logprobs >= 0 else None))
            self.stats["prefix_cached_tokens"] += cached
            self.stats["prefix_hit_requests"] += bool(hits)

    def _forward(self, results: list[PrefillOutcome]) -> None:
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
        for name, value in media_fields([(seq.media, seq.computed, n) for seq, n in chunks]).items():
            setattr(batch, name, value)
        if self.lora is not None:
            batch.lora_slots = self.lora.token_slots([seq.task.params.lora for seq, _ in chunks], [n for _, n in chunks])
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
            step = sample_step(logits[done_rows], [s.task.params for s in done],
                               [TokenHistory(s.task.prompt_token_ids, s.task.position_offset) for s in done],
                               [s.task.position_offset for s in done], processors=self.processors,
                               grammars=self.grammars, grammar_rows=[self._grammar_row(s.task) for s in done])
            if self.grammars:
                self._grammar_complete = {s.task.request_id for s, ended in zip(done, step.grammar_ended) if ended}
            self._hand_off(done, step.tokens, step.logprobs, export, results)
            export = None   # the hand-off job owns it now
        finally:   # an exception before the hand-off: the export's thread joined, its pieces deleted
            if export is not None:
                export.abort()

    def _hand_off(self, done: list[_Running], tokens: list[int], logprobs: list, export: LayerwiseExport | None,
                  results: list[PrefillOutcome]) -> None:
        """Report the sequences that end here; send the others' hand-offs in one transfer job.
        Whole KVs are gathered into connector memory now (the pool is the step thread's); a
        layerwise export is completed by the job, so its sequences' blocks stay held until then."""
        outgoing: list[OutgoingHandoff] = []
        handoffs: list[_Handoff] = []
        for seq, token, token_logprobs in zip(done, tokens, logprobs):
            task = seq.task
            reason = self._finish_reason(seq, token)
            result = PrefillResult(task.request_id, first_token=token, position=task.position_offset,
                                   finish_reason=reason, logprobs=token_logprobs, cached_tokens=seq.cached,
                                   prompt_logprobs=seq.prompt_lp)
            speech = task.speech == "prompt" or bool(task.speech and not reason)
            if reason and not speech:
                results.append(result)
                continue
            item = OutgoingHandoff(task.request_id)
            if speech:
                item.speech_key = speech_prompt_key(task.request_id, task.attempt)
                item.speech_payload = speech_payload(seq.hidden, task.media)
            if not reason:
                item.kv_key, item.num_tokens = self._kv_key(task), len(task.prompt_token_ids)
                if export is None:
                    try:
                        item.reservation = self._gather_kv(seq.blocks, item.num_tokens)
                    except OmniError as exc:
                        results.append(RequestFailure(task.request_id, exc.error_type, str(exc)))
                        continue
            outgoing.append(item)
            results.append(FirstToken(task.request_id, token, task.position_offset, reason, token_logprobs, seq.cached,
                                      seq.prompt_lp))
            result.token_sent = True
            media = seq.media
            handoffs.append(_Handoff(result, item.kv_key, layers=export.num_layers if export and item.kv_key else 0,
                                     speech=speech, rope_delta=media.rope_delta if media else 0,
                                     has_media=media is not None, lora=task.params.lora))
        held: list[int] = []
        for seq in done:
            held += self._retire(seq, keep_blocks=export is not None)
        if outgoing or export is not None:
            job = HandoffSend(outgoing, export, deadline=max(s.task.deadline for s in done))
            self._sending.append(_Sending(self._transfers.submit(job), handoffs, held))

    def _gather_kv(self, blocks: list[int], num_tokens: int) -> Reservation:
        """The sequence's KV read straight into connector memory (one copy fewer than gathering
        into a tensor for ``put`` to copy out), for the hand-off job to publish."""
        reservation = self.connector.reserve({"kv": self.runner.kv_spec(num_tokens)})
        try:
            self.runner.read_kv(blocks, num_tokens, out=reservation.tensors["kv"])
        except BaseException:
            self.connector.release(reservation)
            raise
        return reservation

    def _collect_sent(self, results: list[PrefillOutcome]) -> None:
        """Report the requests whose hand-off job has finished; free the blocks it held."""
        for sending in [s for s in self._sending if s.ticket.finished]:
            self._sending.remove(sending)
            if sending.ticket.state is TransferState.READY:
                with self._transfers.take(sending.ticket) as sent:
                    for handoff in sending.handoffs:
                        self._deliver(handoff, sent[handoff.result.request_id], results)
            else:   # the job failed as a whole: it deleted everything it had put
                error = sending.ticket.error
                results += [RequestFailure(h.result.request_id, error.error_type, str(error))
                            for h in sending.handoffs if not h.dropped]
            self.allocator.release(sending.held_blocks)

    def _deliver(self, handoff: _Handoff, sent: SentHandoff, results: list[PrefillOutcome]) -> None:
        if handoff.dropped:   # cancelled while its hand-off was on its way: nobody will read it
            key, layers = handoff.kv_key, handoff.layers
            self._transfers.release(key, lambda connector: sent.release(connector, key, layers))
            return
        result = handoff.result
        if sent.error is not None:
            results.append(RequestFailure(result.request_id, sent.error.error_type, str(sent.error)))
            return
        if handoff.speech:
            self.stats["speech_handoffs"] += 1
            result.outputs, result.speech_next = sent.speech, True
        if handoff.kv_key:
            self.stats["kv_handoffs"] += 1
            self.stats["kv_layerwise_handoffs"] += bool(handoff.layers)
            speech = sent.speech
            result.outputs = KVHandoff(handoff.kv_key, sent.kv_handle, result.first_token,
                                       rope_delta=handoff.rope_delta, has_media=handoff.has_media, lora=handoff.lora,
                                       layers=handoff.layers,
                                       speech_prompt_key=speech.speech_prompt_key if speech else "",
                                       speech_prompt_handle=speech.speech_prompt_handle if speech else None)
        results.append(result)

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
        return kv_key(task.request_id, task.attempt)

    def _grammar_error(self, task: PrefillTask) -> str:
        """Why ``task``'s grammar cannot be enforced here ("" when it can, or it has none)."""
        if task.params.structured is None:
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
        return self.grammars.row(task.request_id, task.params.structured, task.prompt_token_ids, task.position_offset)

    def _finish_reason(self, seq: _Running, token: int) -> str:
        if seq.task.request_id in self._grammar_complete:
            return "stop"
        n = len(seq.task.prompt_token_ids)
        return finish_reason_for(token, 1, n + 1, seq.task.params, self.runner.config.eos_token_ids,
                                 self.max_model_len)

    def _forward_batch(self, batch: ForwardBatch, chunks: list[tuple[_Running, int]],
                       export: LayerwiseExport | None = None):
        """One forward (streaming each layer's KV to ``export``); for speech requests also keep
        their tokens' captured hidden states, for requests asking for their prompt's logprobs score
        this chunk's prompt tokens (:mod:`~omnirelay.workers.llm.prompt_logprobs`)."""
        options = {} if export is None else {"on_layer": export.layer_done}   # in-process runners only
        # The prompt rows to score, of requests asking for their prompt's logprobs (in-process runners
        # only: _refusal turns the others away).
        scoring = [(seq.task.prompt_token_ids, seq.computed, n, seq.prompt_lp) for seq, n in chunks]
        prompt = PromptCapture.of_step(scoring)
        if prompt is not None:
            options["prompt"] = prompt
        if not any(seq.task.speech for seq, _ in chunks):
            logits = self.runner.forward(batch, **options)
        else:
            capture = HiddenCapture()   # in-process runners only: _refusal turns speech away from a group
            logits = self.runner.forward(batch, capture=capture, **options)
            start = 0
            for seq, n in chunks:
                if seq.task.speech:
                    seq.hidden.append(capture.states[start:start + n].clone())
                start += n
        if prompt is not None:
            prompt.deal(scoring)
        return logits

    def _name_full_blocks(self, seq: _Running) -> None:
        full = min(seq.computed // self.block_size, len(seq.hashes))
        for index in range(seq.named, full):
            self.allocator.register(seq.blocks[index], seq.hashes[index])
        seq.named = max(seq.named, full)

    def _retire(self, seq: _Running, keep_blocks: bool = False) -> list[int]:
        """Take ``seq`` out of the batch: its grammar and media key go, its blocks are released
        (or, with ``keep_blocks``, returned for the caller to release later)."""
        self.running.remove(seq)
        if self.grammars is not None:
            self.grammars.release(seq.task.request_id)
        if seq.media is not None:
            key = seq.media.key
            self._transfers.release(key, lambda connector: delete_quietly(connector, key))
        if keep_blocks:
            return seq.blocks
        self.allocator.release(seq.blocks)
        return []
