"""Speech engine of the generate role: thinker hidden states → talker codec tokens → token2wav waveform.

Life of a request through this engine::

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
talker, but token2wav runs per chunk of codec tokens between the talker's steps
(:meth:`GenerateSpeechEngine.synthesize_stream`, ``stream.py``): each SpeechChunk goes to the
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
hand-off's chunks) is read as the talker needs it, one row per step (:meth:`_reply_row`), waiting
for the thinker when the talker is ahead; a whole reply is read through the same source, so both
give the same rows, the same codes and the same audio. The codec budget of a streamed reply (its
length is known only at its end) is checked after each code and stops where a whole reply's would
(:meth:`_budget_check`).

Batching: the talker's decode steps of every request held run as one forward (continuous
batching, as decode does for text): each request's synthesis thread builds its prompt and runs its
prompt forward alone, then rides each decode step in the worker's
:class:`~omnirelay.workers.speech.step_batch.StepBatch`, which runs the steps of every thread that
is ready as one batched talker step (``qwen2_5_talker.step``; the caches side by side:
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
a chunk, streamed or one-shot, and whatever its thread ends with (audio, an error) is not reported. :meth:`close` stops the waiting ones and joins the threads (the
worker runtime owns the engine and closes it).

The engine holds no sockets; the role adapter (``role.py``) encodes and sends the audio.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Callable

import torch

from omnirelay.errors import BadRequest, DeadlineExceeded, OmniError, OutOfMemory
from omnirelay.speech_params import MAX_CODES, SpeechParams

from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.speech import qwen2_5_talker
from omnirelay.workers.speech.reply_source import ReplySource
from omnirelay.workers.speech.step_batch import StepBatch
from omnirelay.workers.speech.requests import SpeechRegistry, SpeechRequest, SpeechStatus
from omnirelay.workers.speech.stream import ChunkedToken2Wav, SynthesisCancelled, dit_sample
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


def _load_prefixed(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint whose names start with one of ``prefixes`` (safetensors only)."""
    from safetensors import safe_open
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    return out


class GenerateSpeechEngine:
    def __init__(self, talker, token2wav, thinker_embed: torch.Tensor, speakers: dict, config, *,
                 device: str = "cpu", max_batch_size: int = 4):
        self.talker = talker
        self.token2wav = token2wav
        self.thinker_embed = thinker_embed
        self.speakers = speakers
        self.config = config
        self.device = torch.device(device)
        self.media_token_ids = self._media_token_ids(config.thinker_config)
        self._init_queue(max_batch_size, talker)

    def _init_queue(self, max_batch_size: int, model: torch.nn.Module) -> None:
        """The queue, synthesis threads, their turns and the counters that step()/cancel()/close()
        run on (shared with the Qwen3-TTS engine, qwen3_tts.py, which synthesises differently);
        ``model``: what the threads take turns computing (its per-generation state is kept per thread)."""
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
        self.step_batch = StepBatch(self._step_rows, idle=self.batch_kv.clear)
        self.vocoder_slots = Slots(VOCODER_SLOTS)
        self.stats = collections.Counter()

    @staticmethod
    def _media_token_ids(thinker) -> tuple[int, int, int]:
        """The thinker's audio, image and video placeholder ids (Qwen2.5-Omni names them *_index)."""
        return thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        max_batch_size: int = 4) -> "GenerateSpeechEngine":
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniTalkerForConditionalGeneration, Qwen2_5OmniToken2WavModel)
        root = Path(path)
        config = Qwen2_5OmniConfig.from_pretrained(root)
        talker, token2wav, embed = load_talker(root, Qwen2_5OmniTalkerForConditionalGeneration._from_config(
            config.talker_config), Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config), "token2wav.",
            dtype=dtype, device=device)
        return cls(talker, token2wav, embed, load_speakers(root), config, device=device, max_batch_size=max_batch_size)

    # ------------------------------------------------------------------ queue

    @property
    def voices(self) -> list[str]:
        return sorted(self.speakers)

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

    def add(self, task: SpeechTask) -> None:
        """Validate and queue ``task``; raises :class:`BadRequest` for what this model cannot speak."""
        if task.params.voice not in self.speakers:
            raise BadRequest(f"voice {task.params.voice!r} is not one of this model's speakers: "
                             f"{', '.join(self.voices)}", param="voice")
        m = len(task.reply_token_ids)
        hidden = self.thinker_embed.shape[1]
        if task.reply_stream is not None:   # its reply arrives later: checked as it comes
            m = 2
        elif m < 2:
            raise BadRequest("the reply to speak has fewer than 2 tokens")
        if task.reply_stream is None and tuple(task.reply_hidden.shape) != (m - 1, hidden):
            raise BadRequest(f"reply hidden states are {tuple(task.reply_hidden.shape)}, expected {(m - 1, hidden)}")
        if tuple(task.prompt_hidden.shape) != (len(task.prompt_token_ids), hidden):
            raise BadRequest(f"prompt hidden states are {tuple(task.prompt_hidden.shape)}, "
                             f"expected {(len(task.prompt_token_ids), hidden)}")
        self._queue(task)

    def _queue(self, task) -> None:
        """``task`` (validated) as a WAITING record: in the registry and the waiting queue."""
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
            self._stops_with(request.task, request.stop)
            request.status = SpeechStatus.RUNNING
            request.future = self._thread.submit(self._synthesize_any, request)
            request.future.add_done_callback(lambda _: self._news.set())
            self.running.append(request)
        if not self.running and not self.draining:
            return out
        # A piece leaves as soon as it is made: waiting out wait_s would add up to that much to
        # every piece's latency, the first audio's included.
        self._news.clear()
        if not self._chunks and not any(r.future.done() for r in self.running + self.draining):
            self._news.wait(wait_s)
        self._collect_chunks(out)   # a request that ended queued its last pieces before it did
        for request in [r for r in self.running if r.future.done()]:
            self.running.remove(request)
            self._finish(request, out)
        for request in [r for r in self.draining if r.future.done()]:
            self.draining.remove(request)
            self._finish(request, out)   # collected; a cancelled request reports nothing
        return out

    def _stops_with(self, task: SpeechTask, stop: threading.Event) -> None:
        """A streamed reply's wait for the thinker ends when the request is cancelled."""
        task.reply().cancelled = stop

    def _finish(self, request: SpeechRequest, out: SpeechStep) -> None:
        """A request's synthesis ended: its output, or its failure (nothing for a cancelled one,
        whatever its thread ended with)."""
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
        task = request.task
        self.stats["speech_requests"] += 1
        self.stats["talker_codes"] += codes
        if waveform is not None:
            self.stats["audio_samples"] += int(waveform.numel())
            out.outputs.append(SpeechOutput(task.request_id, waveform, codes))

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

    def _synthesize_any(self, request: SpeechRequest) -> tuple[torch.Tensor | None, int]:
        """On the synthesis thread: the one-shot waveform, or (None, codes) for a streamed request
        whose pieces went to ``self._chunks``."""
        if request.task.stream:
            def emit(chunk: SpeechChunk) -> None:
                self._chunks.append((request, chunk))
                self._news.set()

            return None, self.synthesize_stream(request.task, emit, request.stop)
        return self.synthesize(request.task)

    def _vocode(self, vocoder, codes, count: int) -> None:
        """Hand a streamed request's vocoder its latest codes (``codes``, ``count`` of them so far)
        between two talker steps. A feed that vocodes a piece (``vocoder.ready(count)``) runs away
        from the step batch (no step waits for it), in one of the worker's :data:`VOCODER_SLOTS`, a
        request whose first audio has not left yet first. One that only collects codes runs in
        place: away at every step, the request would miss batches, and each coming and going would
        rebuild the batch cache."""
        if not vocoder.ready(count):
            vocoder.feed(codes)
            return
        urgent = vocoder.pieces == 0

        def in_slot() -> None:
            with self.vocoder_slots.hold(urgent=urgent):
                vocoder.feed(codes)

        self.step_batch.away(in_slot)

    @torch.inference_mode()
    def synthesize(self, task: SpeechTask) -> tuple[torch.Tensor, int]:
        """The waveform of one request (float32, 1-D) and the number of codec tokens spoken."""
        codes, generator = self._talk(task)
        if not codes:
            return torch.zeros(0), 0
        speaker = self.speakers[task.params.voice]
        cond = speaker["cond"].to(self.device).float().expand(1, -1)
        ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
        code = torch.tensor([codes], dtype=torch.long, device=self.device)
        dit = self.token2wav.code2wav_dit_model
        # token2wav's noise: transformers draws it from the global stream after the talker's draws;
        # the request's generator is where that stream would be (seeded alike, drawn alike), so the
        # noise is the same without touching any process-global state.
        noise = torch.randn([1, code.shape[1] * dit.repeats, dit.mel_dim], dtype=ref_mel.dtype,
                            device=self.device, generator=generator)
        with self.vocoder_slots.hold():
            mel = dit_sample(dit, code, cond, ref_mel, noise)
            wav = self.token2wav.code2wav_bigvgan_model(mel)
        wav = wav.reshape(-1).float().cpu()
        if task.params.speed != 1.0:
            wav = _change_speed(wav, task.params.speed)
        return wav, len(codes)

    @torch.inference_mode()
    def synthesize_stream(self, task: SpeechTask, emit: Callable[[SpeechChunk], None],
                          cancelled: threading.Event | None = None) -> int:
        """A streamed request: ``emit`` each waveform piece as soon as the codes it depends on exist
        (stream.py); returns the number of codec tokens spoken. The talker runs as in
        :meth:`synthesize` (same inputs, sampling and seed, so the same codes); token2wav runs per
        chunk between its steps. ``cancelled`` set: raises :class:`SynthesisCancelled` at the next
        step (or before the last piece)."""
        cancelled = cancelled or threading.Event()
        speaker = self.speakers[task.params.voice]
        index = 0

        def on_piece(wav: torch.Tensor, codes: int, final: bool) -> None:
            nonlocal index
            if task.params.speed != 1.0 and wav.numel():
                wav = _change_speed(wav, task.params.speed)
            emit(SpeechChunk(task.request_id, index, wav, codes, final))
            index += 1

        cond = speaker["cond"].to(self.device).float().expand(1, -1)
        ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
        token2wav = ChunkedToken2Wav(self.token2wav, cond, ref_mel, task.params.seed, on_piece)
        codes, _ = self._talk(task, token2wav, cancelled)
        if cancelled.is_set():
            raise SynthesisCancelled()
        with self.vocoder_slots.hold():
            token2wav.feed(codes, final=True)
        return len(codes)

    def _talk(self, task: SpeechTask, vocoder: ChunkedToken2Wav | None = None,
              cancelled: threading.Event | None = None) -> tuple[list[int], torch.Generator]:
        """Run the talker: the codes it speaks (up to its EOS) and the generator it sampled from.
        The prompt forward runs holding the turn; each decode step rides the worker's step batch
        (qwen2_5_talker.py); a streamed request's ``vocoder`` is fed the codes so far after each
        new one (:meth:`_vocode`)."""
        talker, reply = self.talker, task.reply()
        generator = torch.Generator(device=self.device).manual_seed(task.params.seed)
        inputs = self._talker_inputs(task)   # may wait for the thinker's first chunk: outside the turn
        with self.turns.hold(urgent=task.stream):
            row = qwen2_5_talker.start(talker, inputs, generator)
        eos = (talker.codec_pad_token, talker.codec_eos_token)
        reply_row, budget = self._reply_row(task), self._budget_check(task)
        codes: list[int] = []
        with self.step_batch.seat(row) as seat:
            reply.waiting = self.step_batch.away   # a wait for the thinker holds back no other request
            try:
                while row.last not in eos:
                    codes.append(row.last)
                    if vocoder is not None:
                        self._vocode(vocoder, codes, len(codes))
                    if budget(row.sampled):
                        break
                    if reply.cancelled.is_set() or (cancelled is not None and cancelled.is_set()):
                        raise SynthesisCancelled()   # a cancelled request stops at its next step
                    row.reply_row = reply_row(row.sampled - 1)
                    self.step_batch.ride(seat)
            finally:
                reply.waiting = lambda wait: wait()
        return codes, generator

    def _budget_check(self, task: SpeechTask) -> Callable[[int], bool]:
        """Whether a talker that has sampled ``count`` codes is done: ``SpeechParams.codes_for`` the
        reply's length, known once the reply ended (a streamed one's, at its end; the talker cannot
        get past that budget before, as each of its steps reads one reply token and the budget is
        more codes than tokens), and never more than ``max_codes``."""
        reply, params = task.reply(), task.params
        cap = params.max_codes or MAX_CODES
        return lambda count: count >= cap or (reply.ended and count >= params.codes_for(len(reply.token_ids)))

    def _step_rows(self, seats) -> None:
        """One batched talker step of these seats' requests (a StepBatch run)."""
        qwen2_5_talker.step(self.talker, self.batch_kv, seats)

    def _reply_row(self, task: SpeechTask) -> Callable[[int], torch.Tensor]:
        """Row ``k`` of what the talker reads after its prompt, one per codec step, as transformers
        lays it out: the rest of the reply (state + embedding of t(k+1)), then the text EOS
        embedding, then text pads."""
        reply, embed, talker = task.reply(), self.thinker_embed, self.talker
        dtype, dev = embed.dtype, self.device

        def row(k: int) -> torch.Tensor:
            if reply.wait_states(k + 2):
                token = reply.token_ids[k + 1]
                return reply.state(k + 1).to(device=dev, dtype=dtype) + embed[token]
            last = reply.num_states   # m - 1 states: rows 0 … m-3 were the reply, then EOS, then pads
            if reply.num_states < 1:
                raise BadRequest("the reply to speak has fewer than 2 tokens")
            return embed[talker.text_eos_token] if k + 1 == last else embed[talker.text_pad_token]

        return row

    def _talker_inputs(self, task: SpeechTask) -> dict:
        """The talker's prompt for one request, built as transformers' ``generate`` builds it (the
        reply after its first token is read step by step: :meth:`_reply_row`)."""
        dev, talker = self.device, self.talker
        dtype = self.thinker_embed.dtype
        reply = task.reply()
        if not reply.wait_states(1):
            raise BadRequest("the reply to speak has fewer than 2 tokens")
        ids = torch.tensor([task.prompt_token_ids], dtype=torch.long, device=dev)
        embed = self.thinker_embed
        prompt_embeds = embed[ids[0]]
        media = torch.isin(ids[0], torch.tensor(self.media_token_ids, device=dev))
        prompt_embeds = prompt_embeds.masked_fill(media[:, None], 0.0)
        prompt_hidden = task.prompt_hidden.to(device=dev, dtype=dtype)
        first = reply.state(0).to(device=dev, dtype=dtype) + embed[reply.token_ids[0]]
        bos_token = int(self.speakers[task.params.voice]["bos_token"])
        inputs_embeds = torch.cat([prompt_hidden + prompt_embeds, embed[bos_token][None], first[None]])
        n = ids.shape[1]
        codec_prompt = torch.tensor([[talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]],
                                    dtype=torch.long, device=dev)
        text_ids = torch.cat([ids, torch.tensor([[bos_token, reply.token_ids[0]]], device=dev)], dim=1)
        # As transformers' generate() called the documented way (``**processor(...)``, so with the
        # prompt's attention mask, extended by 2 for the codec pad and bos): every position attends.
        # (Without a mask, generate() would infer one from the codec pad id and hide that position.)
        grids = torch.tensor(task.image_grids, dtype=torch.long, device=dev) if task.image_grids else None
        audio = torch.tensor(task.audio_lengths, dtype=torch.long, device=dev) if task.audio_lengths else None
        return {"input_ids": codec_prompt, "input_text_ids": text_ids, "inputs_embeds": inputs_embeds[None],
                "attention_mask": torch.ones_like(codec_prompt),
                "image_grid_thw": grids, "audio_feature_lengths": audio}


def load_speakers(root: Path) -> dict[str, dict]:
    """name → {"cond", "ref_mel", "bos_token"} (transformers' ``speaker_map``): from
    ``spk_dict.safetensors`` + ``spk_dict.json`` (what ``omni-make-model`` writes). A real checkpoint's
    ``spk_dict.pt`` is a pickle, which we never load: convert it once to those two files."""
    if (root / "spk_dict.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(root / "spk_dict.safetensors"))
        meta = json.loads((root / "spk_dict.json").read_text())
        return {name: {"cond": tensors[f"{name}.cond"], "ref_mel": tensors[f"{name}.ref_mel"],
                       "bos_token": int(info["bos_token"])} for name, info in meta.items()}
    raise FileNotFoundError(f"{root} has no speaker table spk_dict.safetensors + spk_dict.json (a pickled "
                            "spk_dict.pt is not loaded: convert it to those two files)")


def load_talker(root: Path, talker: torch.nn.Module, vocoder: torch.nn.Module, vocoder_prefix: str, *,
                dtype: torch.dtype, device: str,
                talker_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda weights: weights,
                ) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """The checkpoint's ``talker.*`` and ``<vocoder_prefix>*`` tensors loaded into the modules built
    from its config (``talker_layout`` maps the checkpoint's names to the talker module's), and the
    thinker's embedding table. Returns the talker and the table in ``dtype`` and the vocoder in
    float32 — always, as transformers forces it (token2wav's ODE solver needs the range) — on ``device``."""
    weights = _load_prefixed(root, ("talker.", vocoder_prefix, "thinker.model.embed_tokens."))
    _load_module(talker, talker_layout(weights), "talker.")
    _load_module(vocoder, weights, vocoder_prefix)
    embed = weights["thinker.model.embed_tokens.weight"].to(device=device, dtype=dtype)
    return talker.to(device=device, dtype=dtype).eval(), vocoder.to(device=device).float().eval(), embed


def _load_module(module: torch.nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False)
    # Non-persistent buffers (rotary frequencies) are rebuilt by the constructor, never saved.
    missing = [k for k in missing if not k.endswith(("inv_freq", "original_inv_freq"))]
    if missing or unexpected:
        raise ValueError(f"{prefix[:-1]} weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def _change_speed(wav: torch.Tensor, speed: float) -> torch.Tensor:
    """Play ``speed`` times faster by resampling (linear interpolation; the pitch moves with it)."""
    target = max(1, int(round(wav.numel() / speed)))
    return torch.nn.functional.interpolate(wav[None, None], size=target, mode="linear",
                                           align_corners=False)[0, 0]
