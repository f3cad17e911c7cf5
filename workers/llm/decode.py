"""Decode engine: continuous batching over a paged KV cache.

Life of a request through this engine (its :class:`~omnirelay.workers.llm.requests.Request`'s status)::

    add(DecodeTask) ──▶ WAITING ──next step: its KV import starts (a TransferPool job: connector gets on
        a transfer thread, every key deleted)──▶ WAITING_FOR_REMOTE ──▶ ready: KV on the host
        ──admit: blocks free and a batch slot──▶ KV written into its blocks ──▶ RUNNING
        ──step() × n: one token per running sequence──▶ FINISHED (EOS / stop token / max_tokens /
        context full) → blocks released; a spoken reply is SENDING_HANDOFF until its states are out
    WAITING_FOR_REMOTE ──the import failed──▶ its keys released ──▶ FAILED with the error's error_type
        (the broker restarts it from prefill under a new attempt, with new keys, or fails it)
    WAITING / WAITING_FOR_REMOTE ──cancel or deadline──▶ gone: its import dropped and its keys
        released (an import in flight runs out its own get first, see runtime.transfers)

    RUNNING ──blocks ran out──▶ PREEMPTED: blocks released, back to the front of waiting; on
        re-admission its KV is recomputed from prompt + tokens so far (never a failure); a
        multimodal sequence instead keeps its KV in host memory and gets it back as it was (its
        media embeddings are not in the token ids), and runs at rotary position index + rope delta

Every ``step()`` is schedule → execute → update. Schedule: report the spoken replies whose
states went out, expire, hand new requests' KV imports to the prefetcher, admit waiting sequences
whose KV is ready (in arrival order; one still importing is passed over, not waited for) and
re-admit preempted ones, rebuild the KV of those in one packed forward straight into their new
blocks, make room for the running ones (preempting the most recently admitted when the pool is
short); execute: one batched forward for all running sequences, a token sampled for each;
update: tokens appended, finished sequences retired. Sequences of any length join and
leave between steps without copying anyone's blocks. A slow connector (a Redis outage, a layerwise
KV still arriving) thus delays only the request whose KV it is, never the running batch. A step with
nothing to run while imports are pending waits briefly for one to finish rather than spin.
The block allocator lives here; the model and its pool sit behind a
:class:`~omnirelay.workers.llm.model_runner.ModelRunner` (this process, or a TP/PP group whose pools
hold head/layer shards of the same block ids): the imports run in this process (rank 0) and only
the step thread writes into the pool. The engine holds no sockets: it returns token deltas and
finished/failed requests to the runtime. Its owner calls :meth:`DecodeEngine.close` before closing
the connector; it joins the import threads for at most ``TransferPool.CLOSE_JOIN_S`` (one still
inside a get ends by itself when the get returns, touching the connector only to release its keys).
A failed request's speech prompt key, like a cancelled one's, is deleted: it will never be read.
A spoken reply's states go to the generate stage on a transfer thread like the imports (the
:class:`~omnirelay.workers.llm.handoff_jobs.SpeechReplySend` job): its last token is reported, with
the hand-off, in the first step after the put returned, and the batch keeps stepping meanwhile.
With ``stream_chunk_tokens`` K > 0 the reply is streamed instead (``reply_stream.py``): every K
new tokens a chunk goes out, the first one announced in ``EngineStep.streams`` (the role sends
``StageStreaming`` and generate starts on it), and a finished reply waits in ``_finishing``
(SENDING_HANDOFF, its blocks already freed) until its last chunk is written; then its last token is reported.

Speculative decoding (``--speculative-config``, :mod:`~omnirelay.workers.llm.spec_decode`): the execute
phase may instead draft up to k tokens per running sequence and verify them in the one batched forward
(1 + d query positions each); update then appends each sequence's accepted tokens and gives back the
blocks that held only rejected drafts.

Structured output (``TextParams.structured``): every token is sampled under the request's grammar
(:mod:`~omnirelay.workers.llm.structured_output`). Its matcher is built when the sequence is first
checked (before its KV import) by replaying what was already emitted: a resumed stream's tokens at
the end of the prompt, then prefill's first token; it survives preemption and is dropped when the
sequence leaves. A sequence whose grammar completes finishes with ``stop``.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from omnirelay.connectors import Connector
from omnirelay.errors import BadRequest, DeadlineExceeded, OutOfMemory
from omnirelay.handoffs import SpeechHandoff, release_kv, speech_reply_key

from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.llm.lora import LoraSlots
from omnirelay.workers.llm.handoff_jobs import SpeechReplySend
from omnirelay.workers.llm.reply_stream import ReplyStreamWriter
from omnirelay.workers.kv.cache import BlockAllocator, PagedKVCache
from omnirelay.workers.kv.prefetch import KVImport, kv_prefetcher
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.runtime.transfers import TransferState
from omnirelay.workers.llm.logits_processors import LogitsProcessors
from omnirelay.workers.llm.model_runner import ModelRunner
from omnirelay.workers.llm.models.llama import HiddenCapture
from omnirelay.request_params import TextParams
from omnirelay.speculative import SpeculativeConfig
from omnirelay.workers.llm.requests import EngineStep, Registry, Request, Status, TokenOut
from omnirelay.workers.llm.sampling import SampledStep, sample_step
from omnirelay.workers.llm.spec_decode import SpeculativeDecoder
from omnirelay.workers.llm.stopping import finish_reason_for
from omnirelay.workers.llm.structured_output import GrammarSampler


# Finished streamed replies remembered for a late CancelTask.streams_only (which crosses decode's own
# StageDone at the broker): a few seconds' worth of spoken replies on any worker.
WRITTEN_STREAMS_KEPT = 256


@dataclasses.dataclass
class DecodeTask:
    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    params: TextParams
    deadline: float
    reply_to: str
    kv_key: str
    kv_handle: dict
    position_offset: int = 0
    # Multimodal prompt (Qwen2.5-Omni): rotary positions are token index + rope_delta (M-RoPE), and
    # the prompt's KV cannot be recomputed from its token ids (the media embeddings are gone).
    rope_delta: int = 0
    has_media: bool = False
    # Speech out (Qwen2.5-Omni): prefill's prompt hidden states, passed on to the generate stage
    # with ours (each reply token's state); None: a text-only request.
    speech_inputs: SpeechHandoff | None = None
    priority: int = 0   # Task.priority: the waiting queue's order (request_queue.py)
    kv_layers: int | None = None   # the KV's layout (KVHandoff.layers; None: read it) for deleting it unread


class DecodeEngine:
    """``runner``: the model and its KV pool (:class:`ModelRunner`: this process, or rank 0 of a
    tensor/pipeline-parallel group, whose ranks hold the pools); the engine allocates its blocks.
    ``kv_import_threads``: the threads importing new requests' KVs (see
    :mod:`~omnirelay.workers.kv.prefetch`); at most ``max_num_seqs`` imported KVs wait for admission.
    ``grammars``: structured output support (None: a request that asks for it fails as ``bad_request``).
    ``speculative``: draft and verify several tokens a step (:mod:`~omnirelay.workers.llm.spec_decode`;
    None: one token a step; an in-process runner only, which the worker's config ensures)."""

    # A step with nothing running sleeps at most this long for an import to finish. A broker message
    # for the loop ends the wait at once (wake(), from the broker link's thread); the bound is for
    # the heartbeat, which the loop sends between steps.
    IDLE_WAIT_S = 0.02

    def __init__(self, runner: ModelRunner, connector: Connector, *,
                 max_num_seqs: int, max_model_len: int, transfer_timeout_s: float = 30.0, kv_import_threads: int = 2,
                 grammars: GrammarSampler | None = None, stream_chunk_tokens: int = 0, lora: LoraSlots | None = None,
                 speculative: SpeculativeConfig | None = None):
        self.runner = runner
        self.allocator = BlockAllocator(runner.num_blocks)
        self.block_size = self.runner.block_size
        self.eos_token_ids = self.runner.config.eos_token_ids
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.transfer_timeout_s = transfer_timeout_s
        self._transfers = kv_prefetcher(connector, timeout_s=transfer_timeout_s, max_held=max_num_seqs,
                                       threads=kv_import_threads)
        self.requests = Registry()          # every request not over, by id; its status says where it is
        self.waiting: RequestQueue[Request] = RequestQueue()   # WAITING, WAITING_FOR_REMOTE, PREEMPTED
        self.running: list[Request] = []    # RUNNING, in admission order
        # SENDING_HANDOFF: finished spoken replies whose states are on their way (or CANCELLED meanwhile) ...
        self._speech_sends: list[Request] = []
        # ... and streamed ones (stream_chunk_tokens > 0) whose last chunk is still to be written.
        self.stream_chunk_tokens = stream_chunk_tokens
        self._finishing: list[Request] = []
        # Streams written to their end, most recent last: a consumer that stopped reading early may
        # be reported (close_stream) after decode finished; then its unread chunks are deleted here.
        self._written_streams: collections.OrderedDict[str, ReplyStreamWriter] = collections.OrderedDict()
        self.stats = collections.Counter()
        self.grammars = grammars
        self.lora = lora   # None: LoRA off (a sequence naming an adapter is refused)
        self.processors = LogitsProcessors(self.eos_token_ids)
        self.spec = None if speculative is None else SpeculativeDecoder(
            speculative, stats=self.stats, processors=self.processors, grammars=grammars,
            eos_token_ids=self.eos_token_ids, max_model_len=max_model_len)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def has_work(self) -> bool:
        # waiting includes sequences whose KV is importing
        return bool(self.waiting or self.running or self._speech_sends or self._finishing)

    def add(self, task: DecodeTask) -> None:
        seq = Request(task, generated=[task.first_token])
        if task.speech_inputs is not None and self.stream_chunk_tokens:
            seq.stream = ReplyStreamWriter.open(task.speech_inputs, task.params.max_tokens, self.stream_chunk_tokens,
                                                task.request_id)
        self.requests.add(seq)
        self.waiting.add(seq)

    def cancel(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq.status in (Status.WAITING, Status.WAITING_FOR_REMOTE, Status.PREEMPTED):
            self.waiting.remove_task(seq)
            self._drop_kv_key(seq)
            self._drop_speech_key(seq)
            self._release_grammar(seq)
        elif seq.status is Status.RUNNING:
            self._retire(seq)
            self._drop_speech_key(seq)
        elif seq.stream is not None:   # SENDING_HANDOFF: its last chunk still to be written
            self._finishing.remove(seq)
            self._drop_speech_key(seq)
        # SENDING_HANDOFF, a spoken reply's states: the put runs out; they are deleted when it returns
        self.requests.end(seq, Status.CANCELLED)
        self.stats["cancelled"] += 1
        return True

    def close_stream(self, request_id: str) -> None:
        """The generate stage finished reading ``request_id``'s streamed reply before decode finished
        writing it: stop writing, delete what it will never read; the text goes on."""
        seq = self.requests.get(request_id)
        if (seq is not None and seq.stream is not None and not seq.stream.closed
                and seq.status in (Status.RUNNING, Status.SENDING_HANDOFF)):
            writer = seq.stream
            writer.closed = True
            if writer.ticket is not None:   # deleted when its put returns
                self._transfers.cancel(writer.ticket)
                writer.ticket = writer.in_flight = None
            self._transfers.release(f"unread chunks of {request_id}", writer.release_chunks)
            self.stats["speech_streams_closed"] += 1
            return
        written = self._written_streams.pop(request_id, None)
        if written is not None:   # finished meanwhile: what the consumer did not read is deleted now
            self._transfers.release(f"unread chunks of {request_id}", written.release_chunks)
            self.stats["speech_streams_closed"] += 1

    def wake(self) -> None:
        """A broker message is waiting for the loop: end a step's idle wait on transfers now."""
        self._transfers.poke()

    def close(self) -> None:
        """Stop the transfer threads (KV imports, spoken replies' sends) and join them for at most ``TransferPool.CLOSE_JOIN_S`` (an
        import in flight runs out its get first; see runtime.transfers). Call before closing the
        connector. Idempotent."""
        self._transfers.close()

    # ------------------------------------------------------------------ one step

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def step(self) -> EngineStep:
        out = EngineStep()
        self._schedule(out)
        if self.running and not self._speculate(out):
            batch, sampled, positions = self._execute()
            self._update(batch, sampled, positions, out)
        self._pump_streams(out)
        self._collect_speech_sends(out)
        # A gauge, not a count: the heartbeat carries the engine's stats (KV imports and speech sends).
        self.stats["kv_imports_inflight"] = pending = self._transfers.num_pending
        if pending and not (self.running or out.tokens or out.failed):   # never delays what this step made
            self._transfers.wait_for_news(self.IDLE_WAIT_S)
        return out

    def _schedule(self, out: EngineStep) -> None:
        """Report what went out, fail the expired, start imports, admit (writing each admitted
        sequence's KV into its blocks), then give every running sequence room for its next token."""
        self._collect_speech_sends(out)
        self._pump_streams(out)
        self._expire(out)
        self._start_imports(out)
        self._admit(out)
        self._recompute()
        self._make_room(out)

    def _expire(self, out: EngineStep) -> None:
        now = time.time()
        for seq in [s for s in [*self.waiting, *self.running] if now > s.deadline]:
            self.cancel(seq.request_id)
            seq.status = Status.FAILED
            out.failed.append(RequestFailure(seq.request_id, DeadlineExceeded.error_type, "deadline passed in decode"))

    def _fail(self, seq: Request, out: EngineStep, error_type: str, message: str) -> None:
        self.requests.end(seq, Status.FAILED)
        out.failed.append(RequestFailure(seq.request_id, error_type, message))

    def _start_imports(self, out: EngineStep) -> None:
        """Hand new requests' KVs to the prefetcher (first failing those this worker cannot serve, so
        their KVs are never read). Done here rather than in add(): a cancel before the first step
        then releases the keys at once, with no import racing it."""
        for seq in list(self.waiting):
            if seq.status is not Status.WAITING or self._rejected(seq, out):
                continue
            key, seq.task.kv_key = seq.task.kv_key, ""
            seq.fetch = self._transfers.submit(KVImport(key, seq.task.kv_handle, len(seq.task.prompt_token_ids),
                                                        seq.task.deadline, layers=seq.task.kv_layers))
            seq.status = Status.WAITING_FOR_REMOTE

    def _rejected(self, seq: Request, out: EngineStep) -> bool:
        """Fail (and take out of waiting) a sequence this worker can never run."""
        cached = seq.total_len - 1
        if self.blocks_needed(cached + 1) > self.runner.num_blocks - 1:
            error = (OutOfMemory.error_type, f"sequence of {cached + 1} tokens exceeds the whole KV pool")
        elif (seq.task.has_media or seq.task.rope_delta) and not self.runner.in_process:
            # a parallel group's broadcast carries no rotary offsets
            error = (BadRequest.error_type, "image/audio input needs a single-process decode worker "
                     "(tensor and pipeline parallel size 1)")
        elif seq.task.speech_inputs is not None and not self.runner.in_process:
            error = (BadRequest.error_type, "speech output needs a single-process decode worker "
                     "(tensor and pipeline parallel size 1)")
        elif grammar_error := self._grammar_error(seq):
            error = (BadRequest.error_type, grammar_error)
        elif lora_error := self._lora_error(seq):
            error = (BadRequest.error_type, lora_error)
        else:
            return False
        self.waiting.remove_task(seq)
        self._drop_kv_key(seq)
        self._drop_speech_key(seq)
        self._release_grammar(seq)
        self._fail(seq, out, *error)
        return True

    def _admit(self, out: EngineStep) -> None:
        """Admit waiting sequences in order while slots and blocks last. A new one whose KV is still
        importing is passed over (a later one may be ready); one that does not fit stops admission,
        so that a long sequence is not starved by shorter ones behind it."""
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                return
            if self._rejected(seq, out):   # a preempted sequence that outgrew the pool
                continue
            fresh = seq.status is not Status.PREEMPTED
            if fresh and not seq.fetch.finished:
                continue
            if fresh and seq.fetch.state is TransferState.FAILED:   # its KV keys were released
                self.waiting.remove_task(seq)
                self._drop_speech_key(seq)
                error = seq.fetch.error
                self._fail(seq, out, error.error_type, str(error))
                continue
            if self.lora is not None and not self.lora.fits(seq.lora, {s.lora for s in self.running}):
                continue   # a step holds at most max_loras adapters
            # Room for the cached tokens plus the one this step writes.
            cached = seq.total_len - 1
            needed = self.blocks_needed(cached + 1)
            if needed > self.allocator.free:
                return
            self.waiting.remove_task(seq)
            seq.blocks = self.allocator.allocate(needed)
            if seq.swapped is not None:   # a preempted media sequence: its KV comes back as it left
                self.runner.write_kv(seq.blocks, seq.swapped)
                seq.num_computed, seq.swapped = seq.swapped.shape[2], None
                seq.status = Status.RUNNING
                self.stats["kv_swapped_in"] += 1
            elif fresh:
                with self._transfers.take(seq.fetch) as kv:
                    self.runner.write_kv(seq.blocks, kv)
                seq.fetch = None
                seq.num_computed = cached
                seq.status = Status.RUNNING
                self.stats["kv_loads"] += 1
            # else PREEMPTED until _recompute rebuilds its KV, in this step
            self.running.append(seq)

    def _recompute(self) -> None:
        """Rebuild the KV of re-admitted preempted sequences, all in one packed forward, straight
        into their blocks."""
        todo = [s for s in self.running if s.status is Status.PREEMPTED]
        if not todo:
            return
        chunks = [(s.task.prompt_token_ids + s.generated[:-1], 0, s.blocks) for s in todo]
        batch = ForwardBatch.build(chunks, self.block_size)
        if self.lora is not None:
            batch.lora_slots = self.lora.token_slots([s.lora for s in todo], [len(c[0]) for c in chunks])
        self.runner.forward(batch)
        for seq, (tokens, _, _) in zip(todo, chunks):
            seq.num_computed, seq.status = len(tokens), Status.RUNNING
            self.stats["recomputed_tokens"] += len(tokens)

    def _drop_kv_key(self, seq: Request) -> None:
        if seq.fetch is not None:   # the import owns the key: it releases it, now or when it returns
            self._transfers.cancel(seq.fetch)
            seq.fetch = None
        elif seq.task.kv_key:
            key, handle, layers = seq.task.kv_key, seq.task.kv_handle, seq.task.kv_layers
            self._transfers.release(key, lambda connector: release_kv(connector, key, handle, layers=layers))
            seq.task.kv_key = ""

    def _drop_speech_key(self, seq: Request) -> None:
        """A cancelled or failed speech request: prefill's prompt states will never be read (a
        restart runs prefill again, under a new attempt's key)."""
        if seq.stream is not None:
            if seq.stream.ticket is not None:   # the chunk on its way is deleted when its put returns
                self._transfers.cancel(seq.stream.ticket)
            self._transfers.release(f"speech stream of {seq.request_id}", seq.stream.release)
        elif seq.task.speech_inputs is not None:
            self._transfers.release(f"speech states of {seq.request_id}", seq.task.speech_inputs.release)

    def _make_room(self, out: EngineStep) -> None:
        """Give every running sequence a slot for its next token, preempting the newest when short."""
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below while making room for an earlier one
            if self.blocks_needed(seq.num_computed + 1) <= len(seq.blocks):
                continue
            while self.allocator.free == 0 and len(self.running) > 1:
                self._preempt(self.running[-1] if self.running[-1] is not seq else self.running[-2])
            if self.allocator.free == 0:
                self._preempt(seq)   # alone and still no room: wait for blocks to come back
                continue
            seq.blocks += self.allocator.allocate(1)

    def _preempt(self, seq: Request) -> None:
        if seq.task.has_media:   # recomputing from token ids would lose the image/audio embeddings
            seq.swapped = self.runner.read_kv(seq.blocks, seq.num_computed)
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.blocks, seq.num_computed, seq.status = [], 0, Status.PREEMPTED
        self.waiting.appendleft(seq)
        self.stats["preemptions"] += 1

    def _retire(self, seq: Request) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.blocks = []
        self._release_grammar(seq)

    def held_loras(self) -> list[str] | None:
        """The adapters this worker holds (slots, and its requests'), for the broker; None: LoRA off."""
        if self.lora is None:
            return None
        return self.lora.held({s.lora for s in [*self.waiting, *self.running]})

    def _lora_error(self, seq: Request) -> str:
        name = seq.lora
        if not name:
            return ""
        if self.lora is None:
            return f"LoRA adapter {name!r}: LoRA is not enabled on this worker"
        return self.lora.ensure(name, seq.task.params.lora_path)

    def _grammar_row(self, seq: Request):
        if self.grammars is None:
            return None
        return self.grammars.row(seq.request_id, seq.task.params.structured, seq.task.prompt_token_ids,
                                 seq.task.position_offset, seq.generated)

    def _grammar_error(self, seq: Request) -> str:
        """Why ``seq``'s grammar cannot be enforced here ("" when it can, or it has none); builds
        its matcher (replaying the tokens emitted so far) on first call."""
        if seq.task.params.structured is None:
            return ""
        if self.grammars is None:
            return "this decode worker has no structured output support"
        try:
            self.grammars.prepare(self._grammar_row(seq))
        except ValueError as exc:
            return str(exc)
        return ""

    def _release_grammar(self, seq: Request) -> None:
        if self.grammars is not None:
            self.grammars.release(seq.request_id)

    def _execute(self) -> tuple[list[Request], SampledStep, list[int]]:
        """One batched forward of every running sequence's last token and a token sampled for each:
        (the batch, its sampled rows, the output positions sampled)."""
        batch = list(self.running)
        width = max(len(s.blocks) for s in batch)
        pad = [PagedKVCache.PAD_BLOCK] * width
        tables = torch.tensor([s.blocks + pad[len(s.blocks):] for s in batch], dtype=torch.long)
        input_ids = torch.tensor([s.generated[-1] for s in batch], dtype=torch.long)
        positions = torch.tensor([s.num_computed for s in batch], dtype=torch.long)
        decode_batch = ForwardBatch.decode(input_ids, positions, tables, self.block_size)
        if self.lora is not None:
            decode_batch.lora_slots = self.lora.token_slots([s.lora for s in batch], [1] * len(batch))
        if any(s.task.rope_delta for s in batch):
            decode_batch.rope_positions = positions + torch.tensor([s.task.rope_delta for s in batch])
        logits = self._forward_batch(decode_batch, batch)
        out_positions = [s.task.position_offset + len(s.generated) for s in batch]
        sampled = sample_step(logits, [s.task.params for s in batch], [s.history for s in batch], out_positions,
                              processors=self.processors, grammars=self.grammars,
                              grammar_rows=[self._grammar_row(s) for s in batch])
        return batch, sampled, out_positions

    def _update(self, batch: list[Request], sampled: SampledStep, out_positions: list[int], out: EngineStep) -> None:
        """Append each sequence's token; a finished one leaves the batch (a spoken reply's last token
        waits for its states: SENDING_HANDOFF)."""
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(batch)
        for seq, token, position, token_logprobs, ended in zip(batch, sampled.tokens, out_positions,
                                                               sampled.logprobs, sampled.grammar_ended):
            seq.num_computed += 1
            seq.generated.append(token)
            reason = "stop" if ended else finish_reason_for(token, len(seq.generated), seq.total_len, seq.task.params,
                                                            self.eos_token_ids, self.max_model_len)
            self._report(seq, TokenOut(seq.request_id, seq.task.reply_to, position, token, reason,
                                       logprobs=token_logprobs, done=bool(reason)), out)

    def _speculate(self, out: EngineStep) -> bool:
        """A speculative step (spec_decode.py): drafts get the blocks that are free (never a
        preemption), one decode forward verifies them all, each sequence keeps its accepted prefix and gives
        back the blocks that held only rejected drafts. False: this step does not speculate."""
        drafts = self.spec.drafts(self.running) if self.spec is not None else None
        if drafts is None:
            return False
        batch = list(self.running)
        for seq, draft in zip(batch, drafts):
            room = (len(seq.blocks) + self.allocator.free) * self.block_size - seq.num_computed - 1
            del draft[max(room, 0):]
            extra = self.blocks_needed(seq.num_computed + 1 + len(draft)) - len(seq.blocks)
            if extra > 0:
                seq.blocks += self.allocator.allocate(extra)
        if not any(drafts):
            return False
        # Each verified position is a decode row of its own (its sequence's blocks, its own context
        # length): the same attention kernel and numbers as a one-token step, and its logits back.
        rows = [(seq, j, token) for seq, draft in zip(batch, drafts)
                for j, token in enumerate([seq.generated[-1], *draft])]
        width = max(len(s.blocks) for s in batch)
        pad = [PagedKVCache.PAD_BLOCK] * width
        tables = torch.tensor([s.blocks + pad[len(s.blocks):] for s, _, _ in rows], dtype=torch.long)
        positions = torch.tensor([s.num_computed + j for s, j, _ in rows], dtype=torch.long)
        verify = ForwardBatch.decode(torch.tensor([t for _, _, t in rows], dtype=torch.long), positions, tables,
                                     self.block_size)
        if self.lora is not None:
            verify.lora_slots = self.lora.token_slots([s.lora for s, _, _ in rows], [1] * len(rows))
        if any(s.task.rope_delta for s in batch):
            verify.rope_positions = positions + torch.tensor([s.task.rope_delta for s, _, _ in rows])
        results = self.spec.accept(self.runner.forward(verify), batch, drafts, self._grammar_row)
        self.stats["decode_steps"] += 1
        for seq, result in zip(batch, results):
            self.stats["decode_tokens"] += len(result.tokens)
            seq.num_computed += len(result.tokens)   # the fed token and the accepted drafts
            keep = self.blocks_needed(seq.num_computed + 1)
            if len(seq.blocks) > keep:   # roll back: blocks holding only rejected drafts
                self.allocator.release(seq.blocks[keep:])
                del seq.blocks[keep:]
            for token, position, token_logprobs, reason in zip(result.tokens, result.positions, result.logprobs,
                                                               result.reasons):
                self._report(seq, TokenOut(seq.request_id, seq.task.reply_to, position, token, reason,
                                           logprobs=token_logprobs, done=bool(reason)), out)
        return True

    def _report(self, seq: Request, token_out: TokenOut, out: EngineStep) -> None:
        """Report ``seq``'s new token; a finished sequence leaves the batch (a spoken reply's last
        token waits for its states: SENDING_HANDOFF)."""
        reason = token_out.finish_reason
        if not reason:
            out.tokens.append(token_out)
            return
        self._retire(seq)
        if seq.stream is not None:   # the last token leaves once the last chunk is out
            seq.pending, seq.status = token_out, Status.SENDING_HANDOFF
            self._finishing.append(seq)
        elif seq.task.speech_inputs is not None:   # the last token leaves with its states
            seq.pending, seq.status = token_out, Status.SENDING_HANDOFF
            seq.send = self._transfers.submit(self._speech_reply(seq))
            self._speech_sends.append(seq)
        else:
            self.requests.end(seq, Status.FINISHED)
            out.tokens.append(token_out)

    def _forward_batch(self, batch: ForwardBatch, seqs: list[Request]) -> torch.Tensor:
        """One decode forward; for speech requests also keep the fed token's final-norm state."""
        if all(s.task.speech_inputs is None for s in seqs):
            return self.runner.forward(batch)
        capture = HiddenCapture()   # in-process runners only: _rejected refuses speech on a parallel group
        logits = self.runner.forward(batch, capture=capture)
        for row, seq in enumerate(seqs):
            if seq.task.speech_inputs is not None:
                seq.hidden.append(capture.states[row].clone())
        return logits

    def _speech_reply(self, seq: Request) -> SpeechReplySend:
        """The reply for the generate stage: its tokens and the states of all but the last (which
        was never fed back), next to prefill's prompt states; put on a transfer thread."""
        prompt = seq.task.speech_inputs
        key = speech_reply_key(prompt.speech_prompt_key, seq.request_id)
        hidden = torch.stack(seq.hidden) if seq.hidden else torch.zeros(0, 0)
        return SpeechReplySend(prompt, key, {"hidden": hidden, "token_ids": list(seq.generated)}, seq.deadline)

    def _pump_streams(self, out: EngineStep) -> None:
        """Streamed spoken replies: take the chunks that were written (announcing a stream's first,
        reporting a finished reply's last token after its last), fail those whose put failed, and
        start the next chunk of each where one is due."""
        for seq in [s for s in self.running if s.stream is not None] + list(self._finishing):
            writer, token = seq.stream, seq.pending
            ticket = writer.ticket
            if ticket is not None and ticket.finished:
                if ticket.state is TransferState.FAILED:   # nothing of that chunk is left behind
                    error = ticket.error
                    writer.ticket = writer.in_flight = None
                    self._drop_stream(seq)
                    self._fail(seq, out, error.error_type, str(error))
                    continue
                with self._transfers.take(ticket) as written:
                    if written:
                        writer.written()
                        self.stats["speech_stream_chunks"] += 1
                    else:
                        writer.deferred()
                        self.stats["speech_stream_deferred"] += 1
                if writer.next_index == 1 and not writer.announced and not writer.ended:
                    writer.announced = True
                    self.stats["speech_streams"] += 1
                    out.streams.append((seq.request_id, writer.handoff))
            if (writer.ended or writer.closed) and token is not None:
                self._finishing.remove(seq)
                if writer.ended and writer.announced:
                    self._written_streams[seq.request_id] = writer
                    while len(self._written_streams) > WRITTEN_STREAMS_KEPT:
                        self._written_streams.popitem(last=False)
                if not writer.announced:   # the whole reply fit one chunk: the stream is the hand-off
                    self.stats["speech_streams"] += 1
                    token.outputs, token.speech_next = writer.handoff, True
                self.requests.end(seq, Status.FINISHED)
                out.tokens.append(token)
                continue
            job = writer.next_chunk(seq.generated, seq.hidden, final=token is not None, deadline=seq.deadline)
            if job is not None:
                writer.ticket = self._transfers.submit(job)

    def _drop_stream(self, seq: Request) -> None:
        """A streamed reply that failed: out of the batch or the finishing list, its keys released."""
        if seq.status is Status.SENDING_HANDOFF:
            self._finishing.remove(seq)
        elif seq.status is Status.RUNNING:
            self._retire(seq)
        self._drop_speech_key(seq)

    def _collect_speech_sends(self, out: EngineStep) -> None:
        """Report the spoken replies whose states are out: the last token carries the hand-off."""
        for seq in [s for s in self._speech_sends if s.send.finished]:
            self._speech_sends.remove(seq)
            token, ticket = seq.pending, seq.send
            seq.send = None
            if ticket.state is TransferState.FAILED:   # the job deleted the prompt's states too
                if seq.status is Status.SENDING_HANDOFF:
                    self._fail(seq, out, ticket.error.error_type, str(ticket.error))
                continue
            with self._transfers.take(ticket) as handoff:
                if seq.status is Status.CANCELLED:   # cancelled while its states were on their way: never read
                    handoff.release(self.connector)
                    continue
                self.stats["speech_handoffs"] += 1
                token.outputs, token.speech_next = handoff, True
                self.requests.end(seq, Status.FINISHED)
                out.tokens.append(token)
