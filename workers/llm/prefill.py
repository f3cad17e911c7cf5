"""Prefill engine: prompts → first token + KV cache handed to decode through the connector.

Life of a request through this engine (its :class:`~omnirelay.workers.llm.requests.Request`'s status)::

    add(PrefillTask) ──▶ WAITING (queue order)
        [a media prompt ──its encoder outputs' get──▶ WAITING_FOR_REMOTE]
        ──admit: blocks for the whole prompt; the longest cached prefix is reused, not recomputed──▶
    RUNNING ──step() × k: its next chunk joins one packed forward with the other running prompts,
        within ``max_batched_tokens`` per step (a long prompt takes several steps: chunked prefill)──▶
    last chunk done: sample the first token (a TokenOut, to the gateway at once) ──▶ SENDING_HANDOFF:
        its KV (all heads) goes under ``kv/<request_id>/<attempt>`` while the batch keeps stepping
        ──▶ FINISHED: a done TokenOut (handles) once the hand-off is out; blocks released, the full
        ones stay cached under their content hash for the next prompt that shares the prefix
    any ──a refusal, a failed get or send, the deadline──▶ FAILED (a RequestFailure)

Each ``step()`` is schedule (collect finished hand-offs, expire, start media gets, admit, pick
each running prompt's next chunk) → execute (one packed forward, the first tokens sampled) →
update (chunks advanced, full blocks named, finished prompts handed off).

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
and skips decode. ``cancel`` finds the request by id and undoes what its status holds: a waiting
one's get, a running one's blocks; a sending one becomes CANCELLED (its hand-off is deleted when
its job returns). A request waits (never fails) while the pool
is short; only a prompt larger than the whole pool fails (``out_of_memory``). The engine holds no
sockets; its owner calls :meth:`PrefillEngine.close` before closing the connector (it joins the
transfer threads, see ``TransferPool.CLOSE_JOIN_S``).

A pooling request (``PrefillTask.pooling``: ``/v1/embeddings``) ends here: its forwards capture the
final-norm states its :class:`~omnirelay.workers.llm.pooling.PoolAccumulator` reduces, and its last
chunk reports the pooled vector (``TokenOut.pooled``) instead of a first token and a hand-off; decode
is never involved (:mod:`~omnirelay.workers.llm.pooling`).

A request asking for its prompt's logprobs (``TextParams.prompt_logprobs``) takes no cached prefix
and has its prompt tokens scored by the forwards that prefill them; they leave with its first
token. ``TextParams.cache_salt`` salts its prefix-cache block names (``omnirelay.block_hash``).

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
from omnirelay.connectors.base import Reservation
from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, OutOfMemory
from omnirelay.handoffs import EmbedsHandoff, KVHandoff, delete_quietly, kv_key, speech_prompt_key
from omnirelay.mrope import MropeSpec
from omnirelay.workers.kv.export import LAYERWISE_MIN_BYTES, TRANSFER_MODES, ExportSequence, LayerwiseExport
from omnirelay.workers.kv.prefix_cache import PrefixCachingAllocator
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.llm.lora import LoraSlots
from omnirelay.workers.llm.logits_processors import LogitsProcessors
from omnirelay.workers.llm.model_runner import ModelRunner
from omnirelay.workers.llm.models.llama import HiddenCapture
from omnirelay.workers.llm.pooling import PoolAccumulator
from omnirelay.workers.llm.prefill_media import media_fields, place_media
from omnirelay.workers.llm.prompt_logprobs import PromptCapture, PromptLogprobs
from omnirelay.workers.llm.handoff_jobs import (HandoffSend, MediaFetch, OutgoingHandoff, SentHandoff,
                                                     speech_payload)
from omnirelay.pooling_params import PoolingParams
from omnirelay.request_params import TextParams
from omnirelay.workers.llm.requests import EngineStep, Registry, Request, Status, TokenOut
from omnirelay.workers.llm.sampling import sample_step
from omnirelay.workers.llm.stopping import finish_reason_for
from omnirelay.workers.llm.structured_output import GrammarSampler
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.runtime.transfers import Transfer, TransferPool, TransferState

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
    pooling: PoolingParams | None = None   # a pooling request: the vector, not a first token, ends it here


@dataclasses.dataclass
class _Sending:
    """One step's hand-off job and the requests (SENDING_HANDOFF, or CANCELLED meanwhile) waiting on it."""

    ticket: Transfer[dict[str, SentHandoff]]
    requests: list[Request]
    held_blocks: list[int]    # a layerwise export reads them until its job has completed it


class PrefillEngine:
    """``runner``: the model and its KV pool (:class:`ModelRunner`: this process, e.g.
    :func:`~omnirelay.workers.llm.model_runner.local_runner`, or rank 0 of a tensor/pipeline-parallel
    group); the engine's blocks are the pool's, of ``runner.block_size`` tokens. ``grammars``: structured
    output support (None: a request that asks for it fails as ``bad_request``). ``transfer_threads``:
    the threads of its :class:`~omnirelay.workers.runtime.transfers.TransferPool`."""

    # A step with nothing to run sleeps at most this long for a transfer to finish. A broker message
    # for the loop ends the wait at once (wake(), from the broker link's thread); the bound is for
    # the heartbeat, which the loop sends between steps.
    IDLE_WAIT_S = 0.02

    def __init__(self, runner: ModelRunner, connector: Connector, *, max_model_len: int,
                 max_batch: int = 16, max_batched_tokens: int = 256, prefix_caching: bool = True,
                 mrope: MropeSpec | None = None,
                 transfer_timeout_s: float = 30.0, kv_transfer: str = "auto",
                 layerwise_min_bytes: int = LAYERWISE_MIN_BYTES, grammars: GrammarSampler | None = None,
                 transfer_threads: int = 2, lora: LoraSlots | None = None):
        if kv_transfer not in TRANSFER_MODES:
            raise ValueError(f"kv_transfer must be one of {', '.join(TRANSFER_MODES)}, got {kv_transfer!r}")
        self.runner = runner
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
        self.requests = Registry()          # every request not over, by id; its status says where it is
        self.waiting: RequestQueue[Request] = RequestQueue()   # WAITING, WAITING_FOR_REMOTE
        self.running: list[Request] = []    # RUNNING, in admission order
        self.stats = collections.Counter()
        self.grammars = grammars
        self.lora = lora    # None: LoRA off, a request naming an adapter is refused
        self.processors = LogitsProcessors(self.runner.config.eos_token_ids)
        # Media fetches and hand-off sends are each held to one batch's worth by the engine (see
        # _start_media_fetches and _admit), so the pool's own bound never makes a send wait behind
        # fetched payloads that wait for blocks a send holds.
        self._transfers = TransferPool(connector, timeout_s=transfer_timeout_s, max_held=2 * max_batch,
                                       threads=transfer_threads, name="prefill-transfer")
        self._sending: list[_Sending] = []   # hand-off jobs, oldest first

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
        return self.requests.count(Status.SENDING_HANDOFF)

    def add(self, task: PrefillTask) -> None:
        request = Request(task)
        self.requests.add(request)
        self.waiting.add(request)

    def cancel(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status in (Status.WAITING, Status.WAITING_FOR_REMOTE):
            self.waiting.remove_task(request)
            self._cancel_fetch(request)
        elif request.status is Status.RUNNING:
            self._retire(request)
        # SENDING_HANDOFF: its job runs out; what it put is deleted when it returns (_deliver)
        self.requests.end(request, Status.CANCELLED)
        return True

    def wake(self) -> None:
        """A broker message is waiting for the loop: end a step's idle wait on transfers now."""
        self._transfers.poke()

    def close(self) -> None:
        """Stop the transfer threads, discarding what is queued or on its way, and join them for at
        most ``TransferPool.CLOSE_JOIN_S``. Call before closing the connector. Idempotent. The
        encoder outputs of prompts still waiting stay: the runtime hands those requests back to the
        broker (worker_lost), whose retry elsewhere reads them; a hand-off already put is deleted
        (the retry prefills under a new attempt, with new keys)."""
        for request in self.waiting:
            if request.fetch is not None:
                request.fetch.job.delete_on_discard = False
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

    def held_loras(self) -> list[str] | None:
        """The adapters this worker holds (slots, and its requests'), for the broker; None: LoRA off."""
        if self.lora is None:
            return None
        return self.lora.held(self._running_loras() | {r.lora for r in self.waiting})

    # ------------------------------------------------------------------ one step

    def step(self) -> EngineStep:
        """schedule → execute → update, then report the hand-offs that went out meanwhile."""
        out = EngineStep()
        chunks = self._schedule(out)
        if chunks:
            export = self._start_export([r for r, n in chunks if r.num_computed + n == len(r.task.prompt_token_ids)
                                         and r.pool is None])   # a pooled prompt's KV goes nowhere
            try:
                logits, sampled = self._execute(chunks, export)
                self._update(chunks, logits, sampled, export, out)
            except BaseException:   # before the hand-off took it: the export's thread joined, its pieces deleted
                if export is not None:
                    export.abort()
                raise
        self._collect_sent(out)
        self.stats["transfers_inflight"] = pending = self._transfers.num_pending   # a gauge
        if pending and not (self.running or out.tokens or out.failed):   # never delays what this step made
            self._transfers.wait_for_news(self.IDLE_WAIT_S)
        return out

    def _schedule(self, out: EngineStep) -> list[tuple[Request, int]]:
        """Report finished hand-offs, fail the expired, start media gets, admit; then each running
        prompt's next chunk, in admission order, within ``max_batched_tokens``."""
        self._collect_sent(out)
        self._expire(out)
        self._start_media_fetches(out)
        self._admit(out)
        chunks: list[tuple[Request, int]] = []
        budget = self.max_batched_tokens
        for request in self.running:
            if budget <= 0:
                break
            n = min(len(request.task.prompt_token_ids) - request.num_computed, budget)
            chunks.append((request, n))
            budget -= n
        return chunks

    def _execute(self, chunks: list[tuple[Request, int]], export: LayerwiseExport | None):
        """One packed forward of the chunks (streaming finishing prompts' layers to ``export``),
        then the first token of each prompt whose last chunk it was: (logits, sampled rows)."""
        batch = ForwardBatch.build([(r.task.prompt_token_ids[r.num_computed: r.num_computed + n], r.num_computed,
                                     r.blocks) for r, n in chunks], self.block_size)
        for name, value in media_fields([(r.media, r.num_computed, n) for r, n in chunks]).items():
            setattr(batch, name, value)
        if self.lora is not None:
            batch.lora_slots = self.lora.token_slots([r.lora for r, _ in chunks], [n for _, n in chunks])
        logits = self._forward_batch(batch, chunks, export)
        done_rows = [row for row, (r, n) in enumerate(chunks) if r.num_computed + n == len(r.task.prompt_token_ids)]
        if not done_rows:
            return logits, None
        done = [chunks[row][0] for row in done_rows]
        sampled = sample_step(logits[done_rows], [r.task.params for r in done], [r.history for r in done],
                              [r.task.position_offset for r in done], processors=self.processors,
                              grammars=self.grammars, grammar_rows=[self._grammar_row(r.task) for r in done])
        for request, ended in zip(done, sampled.grammar_ended):
            request.grammar_ended = ended
        return logits, sampled

    def _update(self, chunks: list[tuple[Request, int]], logits, sampled, export: LayerwiseExport | None,
                out: EngineStep) -> None:
        """Advance the chunks, name the blocks they filled; hand off the prompts that are done."""
        self.stats["prefill_steps"] += 1
        done = []
        for row, (request, n) in enumerate(chunks):
            request.num_computed += n
            self.stats["prefill_tokens"] += n
            self._name_full_blocks(request)
            if request.num_computed == len(request.task.prompt_token_ids):
                done.append(request)
                if request.pool is not None and request.pool.wants_logits:   # a reranker scores its last logits
                    request.pool.add_logits(logits[row])
        if done:
            self._hand_off(done, sampled.tokens, sampled.logprobs, export, out)

    def _expire(self, out: EngineStep) -> None:
        for request in self.waiting.pop_expired():
            self._cancel_fetch(request)
            self._fail(request, out, DeadlineExceeded.error_type, "deadline passed before prefill")
        now = time.time()
        for request in [r for r in self.running if now > r.deadline]:
            self._retire(request)
            self._fail(request, out, DeadlineExceeded.error_type, "deadline passed during prefill")

    def _fail(self, request: Request, out: EngineStep, error_type: str, message: str) -> None:
        self.requests.end(request, Status.FAILED)
        out.failed.append(RequestFailure(request.request_id, error_type, message))

    def _refusal(self, task: PrefillTask) -> tuple[str, str] | None:
        """(error_type, message) when this worker can never prefill ``task``; cheap checks only."""
        n = len(task.prompt_token_ids)
        if not n or n > self.max_model_len or (n == self.max_model_len and task.pooling is None):   # room for a token
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
        if task.pooling is not None and (not self.runner.in_process or task.media or self.runner.config.capture_layer):
            # The states are captured in process, after the final norm (a capture layer is a talker's).
            return BadRequest.error_type, ("pooling needs a single-process prefill worker (tensor and pipeline "
                                           "parallel size 1) of a text model")
        if task.params.prompt_logprobs >= 0 and not self.runner.in_process:
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
        return {r.lora for r in self.running}

    def _start_media_fetches(self, out: EngineStep) -> None:
        """Start the encoder outputs' gets of new media prompts (failing first those this worker can
        never serve, so their outputs are never read). Here rather than in add(): a cancel before
        the first step then deletes the key at once, with no get racing it."""
        fetching = sum(r.fetch is not None for r in self.waiting)
        for request in list(self.waiting):
            if fetching >= self.max_batch:   # host memory: one batch of payloads at most
                return
            if request.task.media is None or request.status is Status.WAITING_FOR_REMOTE:
                continue
            refusal = self._refusal(request.task)
            if refusal is not None:
                self._refuse(request, refusal, out)
                continue
            request.fetch = self._transfers.submit(MediaFetch(request.task.media, request.deadline))
            request.status = Status.WAITING_FOR_REMOTE
            fetching += 1

    def _refuse(self, request: Request, refusal: tuple[str, str], out: EngineStep) -> None:
        self.waiting.remove_task(request)
        if request.fetch is not None:
            self._cancel_fetch(request)   # the fetch owns the media key: it deletes it
        elif request.task.media is not None:
            self._transfers.release(request.task.media.mm_key, request.task.media.release)
        self._fail(request, out, *refusal)

    def _cancel_fetch(self, request: Request) -> None:
        if request.fetch is not None:
            self._transfers.cancel(request.fetch)
            request.fetch = None

    def _admit(self, out: EngineStep) -> None:
        """Admit waiting prompts in order while batch slots and blocks last. A media prompt whose
        encoder outputs are still on their way is passed over, not waited for. While a batch's worth
        of hand-offs is still on its way (a store that stalls), nothing new is admitted: their
        connector memory, and a layerwise step's blocks, are not given back until they are out."""
        if self.num_sending >= self.max_batch:
            return
        for request in list(self.waiting):
            if len(self.running) >= self.max_batch:
                return
            task, fetch = request.task, request.fetch
            if task.media is not None:
                if fetch is None or not fetch.finished:
                    continue
                if fetch.state is TransferState.FAILED:   # the fetch deleted the key before failing
                    request.fetch = None
                    self.waiting.remove_task(request)
                    self._fail(request, out, fetch.error.error_type, f"multimodal inputs: {fetch.error}")
                    continue
            refusal = self._refusal(task)
            if refusal is None and (grammar_error := self._grammar_error(task)):
                refusal = BadRequest.error_type, grammar_error
            if refusal is not None:
                self._refuse(request, refusal, out)
                continue
            n = len(task.prompt_token_ids)
            total = -(-n // self.block_size)
            if self.lora is not None and not self.lora.fits(request.lora, self._running_loras()):
                continue   # a step holds at most max_loras adapters: wait for a slot's sequences
            # Placeholder ids say nothing about the media behind them: a media prompt neither reuses
            # nor publishes cached blocks.
            hashes = (block_hashes(task.prompt_token_ids, self.block_size, task.params.lora, task.params.cache_salt)
                      if self.prefix_caching and not task.media else [])
            # The last prompt token is always computed: its logits give the first output token.
            # A speech request needs every prompt token's hidden state, prompt logprobs every prompt
            # token's logits: no cached prefix is skipped.
            fresh = task.speech or task.params.prompt_logprobs >= 0 or (task.pooling and task.pooling.needs_every_token)
            hits = [] if fresh else self.allocator.match(hashes[: (n - 1) // self.block_size])
            self.allocator.acquire(hits)
            if total - len(hits) > self.allocator.free:
                self.allocator.release(hits)
                return   # wait for running prompts to finish and give their blocks back
            self.waiting.remove_task(request)
            if fetch is not None:
                request.fetch = None
                with self._transfers.take(fetch) as payload:   # the media key is ours now: _retire deletes it
                    try:
                        request.media = place_media(task.prompt_token_ids, task.media, payload, self.mrope,
                                                    self.runner.config.hidden_size)
                    except (ValueError, KeyError, TypeError) as exc:
                        self._transfers.release(task.media.mm_key, task.media.release)
                        self.allocator.release(hits)
                        self._fail(request, out, BadRequest.error_type, f"multimodal inputs: {exc}")
                        continue
                self.stats["media_prompts"] += 1
            request.blocks = hits + self.allocator.allocate(total - len(hits))
            request.hashes, request.named = hashes, len(hits)
            request.num_computed = request.cached_tokens = len(hits) * self.block_size
            k = task.params.prompt_logprobs   # k >= 0: the prompt tokens' logprobs and top k
            request.prompt_lp = PromptLogprobs(k) if k >= 0 else None
            request.pool = PoolAccumulator(task.pooling, n) if task.pooling is not None else None
            request.status = Status.RUNNING
            self.running.append(request)
            self.stats["prefix_cached_tokens"] += request.cached_tokens
            self.stats["prefix_hit_requests"] += bool(hits)

    def _hand_off(self, done: list[Request], tokens: list[int], logprobs: list, export: LayerwiseExport | None,
                  out: EngineStep) -> None:
        """Report the requests that end here; send the others' hand-offs in one transfer job.
        Whole KVs are gathered into connector memory now (the pool is the step thread's); a
        layerwise export is completed by the job, so its requests' blocks stay held until then."""
        outgoing: list[OutgoingHandoff] = []
        sending: list[Request] = []
        for request, token, token_logprobs in zip(done, tokens, logprobs):
            task = request.task
            if request.pool is not None:   # the vector is the answer: nothing goes on
                out.tokens.append(TokenOut(task.request_id, "", task.position_offset, token, "stop",
                                           cached_tokens=request.cached_tokens, done=True,
                                           pooled=request.pool.finish()))
                self.stats["pooled_requests"] += 1
                self.requests.end(request, Status.FINISHED)
                continue
            reason = self._finish_reason(request, token)
            first = TokenOut(task.request_id, "", task.position_offset, token, reason, logprobs=token_logprobs,
                             cached_tokens=request.cached_tokens, prompt_logprobs=request.prompt_lp)
            speech = task.speech == "prompt" or bool(task.speech and not reason)
            if reason and not speech:
                first.done = True
                out.tokens.append(first)
                self.requests.end(request, Status.FINISHED)
                continue
            item = OutgoingHandoff(task.request_id)
            if speech:
                item.speech_key = speech_prompt_key(task.request_id, task.attempt)
                item.speech_payload = speech_payload(request.hidden, task.media)
            if not reason:
                item.kv_key, item.num_tokens = self._kv_key(task), len(task.prompt_token_ids)
                if export is None:
                    try:
                        item.reservation = self._gather_kv(request.blocks, item.num_tokens)
                    except OmniError as exc:
                        self._fail(request, out, exc.error_type, str(exc))
                        continue
            outgoing.append(item)
            out.tokens.append(first)   # to the gateway now; the done output follows with the hand-off
            request.pending = dataclasses.replace(first, done=True, token_sent=True, speech_next=speech)
            request.kv_key = item.kv_key
            request.kv_layers = export.num_layers if export and item.kv_key else 0
            request.rope_delta = request.media.rope_delta if request.media else 0
            request.has_media = request.media is not None
            request.status = Status.SENDING_HANDOFF
            sending.append(request)
        held: list[int] = []
        for request in done:
            held += self._retire(request, keep_blocks=export is not None)
        if outgoing or export is not None:
            job = HandoffSend(outgoing, export, deadline=max(r.deadline for r in done))
            self._sending.append(_Sending(self._transfers.submit(job), sending, held))

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

    def _collect_sent(self, out: EngineStep) -> None:
        """Report the requests whose hand-off job has finished; free the blocks it held."""
        for sending in [s for s in self._sending if s.ticket.finished]:
            self._sending.remove(sending)
            if sending.ticket.state is TransferState.READY:
                with self._transfers.take(sending.ticket) as sent:
                    for request in sending.requests:
                        self._deliver(request, sent[request.request_id], out)
            else:   # the job failed as a whole: it deleted everything it had put
                error = sending.ticket.error
                for request in sending.requests:
                    if request.status is Status.SENDING_HANDOFF:
                        self._fail(request, out, error.error_type, str(error))
            self.allocator.release(sending.held_blocks)

    def _deliver(self, request: Request, sent: SentHandoff, out: EngineStep) -> None:
        if request.status is Status.CANCELLED:   # cancelled while its hand-off was on its way: nobody will read it
            key, layers = request.kv_key, request.kv_layers
            self._transfers.release(key, lambda connector: sent.release(connector, key, layers))
            return
        if sent.error is not None:
            self._fail(request, out, sent.error.error_type, str(sent.error))
            return
        result = request.pending
        if result.speech_next:
            self.stats["speech_handoffs"] += 1
            result.outputs = sent.speech
        if request.kv_key:
            self.stats["kv_handoffs"] += 1
            self.stats["kv_layerwise_handoffs"] += bool(request.kv_layers)
            speech = sent.speech
            result.outputs = KVHandoff(request.kv_key, sent.kv_handle, result.token, rope_delta=request.rope_delta,
                                       has_media=request.has_media, lora=request.lora, layers=request.kv_layers,
                                       speech_prompt_key=speech.speech_prompt_key if speech else "",
                                       speech_prompt_handle=speech.speech_prompt_handle if speech else None)
        self.requests.end(request, Status.FINISHED)
        out.tokens.append(result)

    def _start_export(self, finishing: list[Request]) -> LayerwiseExport | None:
        """A layerwise export of the requests whose last chunk runs in this step (None: whole)."""
        if self.kv_transfer == "whole" or not finishing:
            return None
        # Only an in-process runner streams layers (__init__ makes a group's kv_transfer "whole").
        if self.kv_transfer == "auto":
            per_token = self.runner.kv_bytes_per_token
            if sum(len(r.task.prompt_token_ids) for r in finishing) * per_token < self.layerwise_min_bytes:
                return None
        sequences = [ExportSequence(self._kv_key(r.task), r.blocks, len(r.task.prompt_token_ids)) for r in finishing]
        return self.runner.layerwise_export(self.connector, sequences)

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

    def _finish_reason(self, request: Request, token: int) -> str:
        if request.grammar_ended:
            return "stop"
        n = len(request.task.prompt_token_ids)
        return finish_reason_for(token, 1, n + 1, request.task.params, self.runner.config.eos_token_ids,
                                 self.max_model_len)

    def _forward_batch(self, batch: ForwardBatch, chunks: list[tuple[Request, int]],
                       export: LayerwiseExport | None = None):
        """One forward (streaming each layer's KV to ``export``); for speech requests also keep
        their tokens' captured hidden states, for requests asking for their prompt's logprobs score
        this chunk's prompt tokens (:mod:`~omnirelay.workers.llm.prompt_logprobs`)."""
        options = {} if export is None else {"on_layer": export.layer_done}   # in-process runners only
        # The prompt rows to score, of requests asking for their prompt's logprobs (in-process runners
        # only: _refusal turns the others away).
        scoring = [(r.task.prompt_token_ids, r.num_computed, n, r.prompt_lp) for r, n in chunks]
        prompt = PromptCapture.of_step(scoring)
        if prompt is not None:
            options["prompt"] = prompt
        if not any(r.task.speech or (r.pool is not None and not r.pool.wants_logits) for r, _ in chunks):
            logits = self.runner.forward(batch, **options)
        else:
            capture = HiddenCapture()   # in-process runners only: _refusal turns speech and pooling away from a group
            logits = self.runner.forward(batch, capture=capture, **options)
            start = 0
            for request, n in chunks:
                if request.task.speech:
                    request.hidden.append(capture.states[start:start + n].clone())
                if request.pool is not None:
                    request.pool.add(capture.states[start:start + n], request.num_computed)
                start += n
        if prompt is not None:
            prompt.deal(scoring)
        return logits

    def _name_full_blocks(self, request: Request) -> None:
        full = min(request.num_computed // self.block_size, len(request.hashes))
        for index in range(request.named, full):
            self.allocator.register(request.blocks[index], request.hashes[index])
        request.named = max(request.named, full)

    def _retire(self, request: Request, keep_blocks: bool = False) -> list[int]:
        """Take ``request`` out of the batch: its grammar, media key and captured states go, its
        blocks are released (or, with ``keep_blocks``, returned for the caller to release later)."""
        self.running.remove(request)
        if self.grammars is not None:
            self.grammars.release(request.request_id)
        if request.media is not None:
            key = request.media.key
            self._transfers.release(key, lambda connector: delete_quietly(connector, key))
            request.media = None
        request.hidden = []
        request.pool = None
        blocks, request.blocks = request.blocks, []
        if keep_blocks:
            return blocks
        self.allocator.release(blocks)
        return []
