"""Speech engine of the generate role: a talker speaks codes, a vocoder turns them into a waveform.

The engine is one class for every model; what a model computes is its family's
(:class:`~omnirelay.workers.speech.family.SpeechFamily`, a strategy the engine holds: ``prompt``,
``start``, ``step``, ``vocode``, ``vocoder``): Qwen2.5-Omni (qwen2_5_omni.py), Qwen3-Omni (qwen3.py),
Qwen3-TTS (qwen3_tts.py). The engine owns the queue, the request records, the synthesis threads,
the step batch, the turn and the vocoder slots, and the talker loop (:meth:`GenerateSpeechEngine._talk`)
every family runs the same way (family.py gives the call order). Each ``load_*`` function of a
family module builds one.

Life of a Qwen2.5-Omni request through this engine (the others: their modules' docstrings)::

    add(SpeechTask: prompt ids + hidden states, reply ids + hidden states, SpeechParams)
        ──▶ waiting (FIFO) ──step(): the oldest live request──▶
    talker: its prompt is built exactly as transformers' ``Qwen2_5OmniForConditionalGeneration.generate``
        builds it, then stepped as ``generate`` steps it (its decode steps batched with the other
        requests': qwen2_5_talker.py) and sampled with the same settings (top-k 40, top-p 0.8,
        temperature 0.9, repetition penalty 1.05, codec BOS suppressed, EOS = codec pad/end) up to
        ``max_codes`` (by default in proportion to the reply's length: ``SpeechParams.codes_for``)
    ──▶ token2wav: DiT (10 Runge-Kutta steps from Gaussian noise, speaker ``cond`` + ``ref_mel``)
        + BigVGAN ──▶ SpeechOutput(float waveform at :data:`SAMPLE_RATE`) to the role adapter

A streamed request (``SpeechTask.stream``: the client reads the audio as it comes) runs the same
talker, but its family's streaming vocoder (family.py ``StreamingVocoder``) runs per chunk of codes
between the talker's steps (:meth:`GenerateSpeechEngine.synthesize_stream`; Qwen2.5-Omni's: ``stream.py``): each SpeechChunk goes to the
role adapter as soon as the codes it depends on exist, the last one marked ``final``, and no
SpeechOutput follows. Its samples differ slightly from the one-shot's (how and why: ``stream.py``).

What the talker reads, for a prompt of ``n`` tokens and a thinker reply ``t0 … t(m-1)``:

* ``prompt_hidden`` [n, H]: the thinker's last-layer (final-norm) states of the prompt;
* the prompt's input embeddings: not shipped — at text positions they are rows of the thinker's
  embedding table, which this engine loads (one matrix), and at media positions transformers
  zeroes them before the talker, so the token ids say everything;
* ``reply_hidden`` [m-1, H]: the states of ``t0 … t(m-2)`` (the tokens fed back into the thinker;
  the last token is never fed, as in transformers). Decode computes them; for ``/v1/audio/speech``
  the text is teacher-forced into the prompt and prefill computes them.

Determinism: each request samples from its own ``torch.Generator`` seeded with its seed, in
transformers' order — talker sampling, then token2wav's noise (drawn from that generator where
the talker left it, as transformers draws it from the global stream) — so its audio equals ``torch.manual_seed(seed);
model.generate(...)`` of transformers with a greedy thinker (tested bitwise). A streamed request's
talker draws the same codes; its token2wav noise comes from its own generator seeded with the seed.
What else the worker runs never touches a request's draws. It can touch its logits: in a batched
step (below) a row's matmuls may add in another order than alone, so the contract is "a function
of seed and inputs up to the float rounding of a batched forward". On the CPU builds we test, a
row's results in a batch are bitwise those alone (tests/engine/test_speech_batching.py checks it);
on other kernels a rounding difference that moves a sample across a top-k/top-p border changes
that request's codes from there on.

A reply streamed in by decode (``SpeechTask.reply_stream``, a :class:`ReplySource` over the
hand-off's chunks) is read as the talker needs it, one row per step (``Qwen2_5OmniFamily.reply_rows``), waiting
for the thinker when the talker is ahead; a whole reply is read through the same source, so both
give the same rows, the same codes and the same audio. The codec budget of a streamed reply (its
length is known only at its end) is checked after each code and stops where a whole reply's would
(``SpeechTask.codes_budget``).

Batching: the talker's decode steps of every request held run as one forward (continuous
batching, as decode does for text): each request's synthesis thread builds its prompt and runs its
prompt forward alone, then rides each decode step in the worker's
:class:`~omnirelay.workers.speech.step_batch.StepBatch`, which runs the steps of every thread that
is ready as one batched talker step (the family's ``step``; the caches side by side:
``talker_batch.BatchKV``). A thread waiting for its thinker's next chunk, or running token2wav on
its last codes, is away from the batch: nobody waits for it. token2wav is not batched: it is
compute-bound (measured on the tiny model: 8 requests' DiT in one call take 8.3× one's), unlike the
talker's small per-step forwards.

Records: each attempt the engine holds is a :class:`~omnirelay.workers.speech.requests.SpeechRequest`
with a status, found by id in the engine's registry (requests.py); its stop event, its thread's
future and its streamed counters live on it. A request cancelled while it runs leaves the registry
at once and waits in ``draining`` until its thread ends, so the same id dispatched again is a new
record that nothing of the old attempt can touch.

Threads: each request held runs on its own synthesis thread (up to ``max_batch_size``, draining
ones included). Only the talker's prompt forward takes turns (:class:`~omnirelay.workers.speech.turns.Turns`:
the talker module keeps M-RoPE state from it); no thread touches a process-global random stream.
Vocoder calls, the one-shot token2wav included, share :data:`VOCODER_SLOTS` slots, a request whose
first piece has not left first (:meth:`_vocode`); the step batch runs the talker steps beside them. ``step()``
starts waiting requests on free threads and returns as soon as a piece is queued or a request ends
(50 ms at most), so pieces leave when made and the worker's loop keeps heartbeating and taking
cancels. Streamed pieces pass from the threads to ``step()`` through a deque (appended there, taken
here). A cancelled running request is dropped: it stops at its next talker step or while waiting for
a chunk, streamed or one-shot, and whatever its thread ends with (audio, an error) is not reported.
:meth:`close` stops the waiting ones and joins the threads (the worker runtime owns the engine and
closes it).

The engine holds no sockets; the role adapter (``role.py``) encodes and sends the audio.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable

import torch

from omnirelay.errors import DeadlineExceeded, OmniError, OutOfMemory
from omnirelay.speech_params import MAX_CODES, SpeechParams

from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.speech.family import SpeechFamily, SpeechTaskLike, StreamingVocoder
from omnirelay.workers.speech.reply_source import ReplySource
from omnirelay.workers.speech.requests import SpeechRegistry, SpeechRequest, SpeechStatus
from omnirelay.workers.speech.step_batch import StepBatch
from omnirelay.workers.speech.stream import SynthesisCancelled
from omnirelay.workers.speech.talker_batch import BatchKV
from omnirelay.workers.speech.turns import Slots, Turns

log = logging.getLogger("omnirelay.worker.speech")

SAMPLE_RATE = 24000                                   # Qwen2.5-Omni's token2wav output rate
# Vocoder calls a worker runs at once. Vocoders are compute-bound: eight side by side only share the
# cores and every first piece comes as late as the last (measured at 8 streamed answers on 2 cores:
# Qwen2.5-Omni's first audio 1.5 s one at a time, 2.5 s all at once); one at a time leaves a core
# idle beside the talker batch (Qwen3-Omni's end to end 7.5 s → 10.1 s). Two, first audio first.
VOCODER_SLOTS = 2


@dataclasses.dataclass
class SpeechTask:
    request_id: str
    prompt_token_ids: list[int]
    prompt_hidden: torch.Tensor        # [n, H]
    reply_token_ids: list[int]         # t0 … t(m-1), m >= 2
    reply_hidden: torch.Tensor         # [m-1, H]
    params: SpeechParams
    deadline: float
    # Media in the prompt (from the encode stage, via prefill): the talker's M-RoPE positions
    # follow the thinker's, so they need each image's (t, h, w) patch grid and each clip's mel frames.
    image_grids: list[list[int]] = dataclasses.field(default_factory=list)
    audio_lengths: list[int] = dataclasses.field(default_factory=list)
    # Streamed (chat ``stream: true``): audio comes out as SpeechChunks while the talker speaks,
    # instead of one SpeechOutput at the end (see stream.py for how the samples differ).
    stream: bool = False
    # The reply arriving in chunks while decode writes it (then reply_token_ids/reply_hidden are empty).
    reply_stream: ReplySource | None = None
    priority: int = 0   # Task.priority: the waiting queue's order (request_queue.py)

    def reply(self) -> ReplySource:
        """The reply as the talker reads it (complete unless it is streamed)."""
        if self.reply_stream is None:
            self.reply_stream = ReplySource(self.reply_token_ids, self.reply_hidden)
        return self.reply_stream

    def bind_stop(self, stop: threading.Event) -> None:
        """A wait for a streamed reply's next chunk ends when ``stop`` is set (the request cancelled)."""
        self.reply().cancelled = stop

    def codes_budget(self) -> Callable[[int], bool]:
        """Whether a talker that has sampled ``count`` codes is done: ``SpeechParams.codes_for`` the
        reply's length, known once the reply ended (a streamed one's, at its end; the talker cannot
        get past that budget before, as each of its steps reads one reply token and the budget is
        more codes than tokens), and never more than ``max_codes``."""
        reply, params = self.reply(), self.params
        cap = params.max_codes or MAX_CODES
        return lambda count: count >= cap or (reply.ended and count >= params.codes_for(len(reply.token_ids)))


@dataclasses.dataclass
class SpeechChunk:
    """One piece of a streamed request's waveform, in order (``index`` 0, 1, …); ``final`` on the
    last. ``codes`` is how many codec tokens the talker had produced when the piece was emitted
    (on the final piece: all it produced)."""
    request_id: str
    index: int
    waveform: torch.Tensor             # float32 [samples], in [-1, 1]; may be empty on the final piece
    codes: int
    final: bool


@dataclasses.dataclass
class SpeechOutput:
    request_id: str
    waveform: torch.Tensor             # float32 [samples], in [-1, 1]
    num_codes: int


@dataclasses.dataclass
class SpeechStep:
    outputs: list[SpeechOutput] = dataclasses.field(default_factory=list)
    chunks: list[SpeechChunk] = dataclasses.field(default_factory=list)
    failed: list[RequestFailure] = dataclasses.field(default_factory=list)


class GenerateSpeechEngine:
    """The speech engine of the generate role for any :class:`~omnirelay.workers.speech.family.SpeechFamily`:
    the queue, the synthesis threads, the step batch, cancellation and deadlines; what the talker
    and the vocoder compute is the family's."""

    def __init__(self, family: SpeechFamily, *, device: str = "cpu", max_batch_size: int = 4):
        self.family = family
        self.device = torch.device(device)
        self.max_batch_size = max(1, max_batch_size)
        self.requests = SpeechRegistry()   # the live attempts, by request id (requests.py)
        self.waiting: RequestQueue[SpeechRequest] = RequestQueue()
        self.running: list[SpeechRequest] = []    # on a synthesis thread, in start order
        # Cancelled while running: out of the registry (the same id may come again), their thread
        # still running out; step() collects each once it ended and drops its result.
        self.draining: list[SpeechRequest] = []
        # Streamed pieces, appended by the synthesis threads, taken by step() (deque ends are thread-safe).
        self._chunks: collections.deque[tuple[SpeechRequest, SpeechChunk]] = collections.deque()
        self._news = threading.Event()   # set by a thread that queued a piece or ended: step() returns
        # One thread per request held (running or draining): a talker waiting for the thinker's next
        # chunk never holds back another request.
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=self.max_batch_size,
                                                             thread_name_prefix="speech-synth")
        self.turns = Turns()   # the talker prompt forwards, one at a time (turns.py)
        # The talker's decode steps of the requests held, run as one forward (step_batch.py).
        self.batch_kv = BatchKV()
        self.step_batch = StepBatch(lambda seats: family.step(self.batch_kv, seats), idle=self.batch_kv.clear)
        self.vocoder_slots = Slots(VOCODER_SLOTS)
        self.stats: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ queue

    @property
    def voices(self) -> list[str]:
        return self.family.voices

    @property
    def num_requests(self) -> int:
        """The live requests and the cancelled ones whose thread still runs (it holds a thread)."""
        return len(self.requests) + len(self.draining)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running) or bool(self.draining)

    def load(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting)}

    def wake(self) -> None:
        """Nothing to wake: step() never waits idle."""

    def close(self) -> None:
        """Stop taking work and join the synthesis thread (a running request finishes first)."""
        self.waiting.clear()
        for request in self.running + self.draining:   # a talker waiting for the thinker stops now
            request.stop.set()
        self._thread.shutdown(wait=True, cancel_futures=True)

    def add(self, task: SpeechTaskLike) -> None:
        """Validate ``task`` (the family's checks: :class:`BadRequest` for what this model cannot
        speak) and queue it as a WAITING record: in the registry and the waiting queue."""
        self.family.check(task)
        request = SpeechRequest(task)
        self.requests.add(request)
        self.waiting.add(request)

    def cancel(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is SpeechStatus.WAITING:
            self.waiting.remove(request_id)
        else:   # RUNNING: it stops at its next talker step; step() collects its thread
            request.stop.set()
            self.running.remove(request)
            self.draining.append(request)
        self.requests.end(request, SpeechStatus.CANCELLED)
        return True

    # ------------------------------------------------------------------ one step

    def step(self, wait_s: float = 0.05) -> SpeechStep:
        """Expire waiting requests, start waiting ones while threads are free, then return as soon as
        a streamed piece is queued or a request finishes (within ``wait_s``), with every piece queued
        and every request finished by then."""
        out = SpeechStep()
        for request in self.waiting.pop_expired():
            self.requests.end(request, SpeechStatus.FAILED)
            out.failed.append(RequestFailure(request.request_id, DeadlineExceeded.error_type,
                                             "deadline passed before speech"))
        # A draining thread still holds its place in the pool: it counts against the batch size.
        while len(self.running) + len(self.draining) < self.max_batch_size and self.waiting:
            request = self.waiting.popleft()
            request.task.bind_stop(request.stop)   # a wait for the thinker ends when it is cancelled
            request.status = SpeechStatus.RUNNING
            request.future = self._thread.submit(self._synthesize_any, request)
            request.future.add_done_callback(lambda _: self._news.set())
            self.running.append(request)
        if not self.running and not self.draining:
            return out
        # A piece leaves as soon as it is made: waiting out wait_s would add up to that much to
        # every piece's latency, the first audio's included.
        self._news.clear()
        if not self._chunks and not any(r.future is not None and r.future.done()
                                        for r in self.running + self.draining):
            self._news.wait(wait_s)
        self._collect_chunks(out)   # a request that ended queued its last pieces before it did
        for request in [r for r in self.running if r.future is not None and r.future.done()]:
            self.running.remove(request)
            self._finish(request, out)
        for request in [r for r in self.draining if r.future is not None and r.future.done()]:
            self.draining.remove(request)
            self._finish(request, out)   # collected; a cancelled request reports nothing
        return out

    def _finish(self, request: SpeechRequest, out: SpeechStep) -> None:
        """A request's synthesis ended: its output, or its failure (nothing for a cancelled one,
        whatever its thread ended with)."""
        assert request.future is not None
        try:
            waveform, codes = request.future.result()
        except SynthesisCancelled:
            return   # a cancelled request stopped between tokens
        except Exception as exc:
            if request.status is not SpeechStatus.CANCELLED:
                self.requests.end(request, SpeechStatus.FAILED)
                out.failed.append(self._failure(request, exc))
            return
        if request.status is SpeechStatus.CANCELLED:
            return
        self.requests.end(request, SpeechStatus.FINISHED)
        self.stats["speech_requests"] += 1
        self.stats["talker_codes"] += codes
        if waveform is not None:
            self.stats["audio_samples"] += int(waveform.numel())
            out.outputs.append(SpeechOutput(request.request_id, waveform, codes))

    @staticmethod
    def _failure(request: SpeechRequest, exc: Exception) -> RequestFailure:
        """What a synthesis that raised ``exc`` reports."""
        if isinstance(exc, OmniError):   # the streamed reply could not be read (transfer, deadline, malformed)
            return RequestFailure(request.request_id, exc.error_type, str(exc))
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return RequestFailure(request.request_id, OutOfMemory.error_type, str(exc))
        # A bug in synthesis fails this request, not the worker.
        log.error("speech synthesis failed for %s", request.request_id, exc_info=exc)
        return RequestFailure(request.request_id, OmniError.error_type, f"{type(exc).__name__}: {exc}")

    def _collect_chunks(self, out: SpeechStep) -> None:
        """Move the streamed pieces the synthesis thread queued into ``out`` (the dropped request's
        are discarded) and count them. ``speech_stream_early_first_chunks`` counts streamed requests
        whose first piece went out before the talker's last code: the point of streaming."""
        while self._chunks:
            request, chunk = self._chunks.popleft()
            if request.status is SpeechStatus.CANCELLED:
                continue
            self.stats["speech_stream_chunks"] += 1
            self.stats["audio_samples"] += int(chunk.waveform.numel())
            if chunk.index == 0:
                request.first_piece_codes = chunk.codes
            if chunk.final:
                self.stats["speech_stream_requests"] += 1
                first = chunk.codes if request.first_piece_codes is None else request.first_piece_codes
                self.stats["speech_stream_first_chunk_codes"] += first
                self.stats["speech_stream_codes"] += chunk.codes
                self.stats["speech_stream_early_first_chunks"] += int(first < chunk.codes)
            out.chunks.append(chunk)

    # ------------------------------------------------------------------ synthesis (synthesis thread)

    def _synthesize_any(self, request: SpeechRequest) -> tuple[torch.Tensor | None, int]:
        """On the synthesis thread: the one-shot waveform, or (None, codes) for a streamed request
        whose pieces went to ``self._chunks``."""
        if request.task.stream:
            def emit(chunk: SpeechChunk) -> None:
                self._chunks.append((request, chunk))
                self._news.set()

            return None, self.synthesize_stream(request.task, emit, request.stop)
        return self.synthesize(request.task, request.stop)

    @torch.inference_mode()
    def synthesize(self, task: SpeechTaskLike, cancelled: threading.Event | None = None) -> tuple[torch.Tensor, int]:
        """The waveform of one request (float32, 1-D) and the number of codes spoken.
        ``cancelled`` set: raises :class:`SynthesisCancelled` at the talker's next step."""
        codes, generator = self._talk(task, None, cancelled or threading.Event())
        if not codes:
            return torch.zeros(0), 0
        with self.vocoder_slots.hold():
            wav = self.family.vocode(task, codes, generator)
        return _with_speed(wav, task.params.speed), len(codes)

    @torch.inference_mode()
    def synthesize_stream(self, task: SpeechTaskLike, emit: Callable[[SpeechChunk], None],
                          cancelled: threading.Event | None = None) -> int:
        """A streamed request: ``emit`` each waveform piece as soon as the codes it depends on exist
        (the family's :class:`~omnirelay.workers.speech.family.StreamingVocoder`); returns the number
        of codes spoken. The talker runs as in :meth:`synthesize` (same inputs, sampling and seed,
        so the same codes); the vocoder runs per piece between its steps. ``cancelled`` set: raises
        :class:`SynthesisCancelled` at the next step (or before the last piece)."""
        cancelled = cancelled or threading.Event()
        index = 0

        def on_piece(wav: torch.Tensor, codes: int, final: bool) -> None:
            nonlocal index
            emit(SpeechChunk(task.request_id, index, _with_speed(wav.reshape(-1).float().cpu(), task.params.speed),
                             codes, final))
            index += 1

        vocoder = self.family.vocoder(task, on_piece)
        codes, _ = self._talk(task, vocoder, cancelled)
        if cancelled.is_set():
            raise SynthesisCancelled()
        with self.vocoder_slots.hold():
            vocoder.finish()
        return len(codes)

    def _talk(self, task: SpeechTaskLike, vocoder: StreamingVocoder | None,
              cancelled: threading.Event) -> tuple[list[Any], torch.Generator]:
        """Run the talker: the codes it speaks (up to its EOS or budget) and the generator it sampled
        from. The prompt is built outside the turn (it may wait for the thinker), its forward runs
        holding the turn; each decode step rides the worker's step batch; a streamed request's
        ``vocoder`` is fed the codes so far after each new one (:meth:`_vocode`)."""
        generator = torch.Generator(device=self.device).manual_seed(task.params.seed)
        prompt = self.family.prompt(task)
        with self.turns.hold(urgent=task.stream):
            talk = self.family.start(task, prompt, generator)
        codes: list[Any] = []

        def spoken() -> None:
            for code in talk.spoken():
                codes.append(code)
                if vocoder is not None:
                    self._vocode(vocoder, codes)

        reply = talk.reply
        with self.step_batch.seat(talk.row) as seat:
            if reply is not None:
                reply.waiting = self.step_batch.away   # a wait for the thinker holds back no other request
            try:
                spoken()
                while not talk.done():
                    if cancelled.is_set():
                        raise SynthesisCancelled()   # a cancelled request stops at its next step
                    talk.prepare()
                    self.step_batch.ride(seat)
                    spoken()
            finally:
                if reply is not None:
                    reply.waiting = lambda wait: wait()
        return codes, generator

    def _vocode(self, vocoder: StreamingVocoder, codes: list[Any]) -> None:
        """Hand a streamed request's vocoder its codes so far between two talker steps. A feed that
        vocodes a piece (``vocoder.ready``) runs away from the step batch (no step waits for it), in
        one of the worker's :data:`VOCODER_SLOTS`, a request whose first audio has not left yet
        first. One that only collects codes runs in place: away at every step, the request would
        miss batches, and each coming and going would rebuild the batch cache."""
        if not vocoder.ready(len(codes)):
            vocoder.feed(codes)
            return
        urgent = vocoder.pieces == 0

        def in_slot() -> None:
            with self.vocoder_slots.hold(urgent=urgent):
                vocoder.feed(codes)

        self.step_batch.away(in_slot)


def _with_speed(wav: torch.Tensor, speed: float) -> torch.Tensor:
    """``wav`` played ``speed`` times faster by resampling (linear interpolation; the pitch moves with it)."""
    if speed == 1.0 or not wav.numel():
        return wav
    target = max(1, int(round(wav.numel() / speed)))
    return torch.nn.functional.interpolate(wav[None, None], size=target, mode="linear",
                                           align_corners=False)[0, 0]
