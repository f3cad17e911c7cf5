"""The generate role for speech, between the bus and :class:`GenerateSpeechEngine` (every family:
Qwen2.5-Omni, Qwen3-Omni; Qwen3-TTS too, reading its tasks another way: qwen3_tts_role.py).

Life of a request through this adapter::

    Task (params: a spoken answer's TextParams.speech or a SpeechParams; inputs = a SpeechHandoff:
          the thinker's hidden states)
        ──accept: read the prompt states (prefill's) and the reply states (decode's) from the
          connector, queue a SpeechTask──▶ engine (the keys are deleted once the audio is out, the
          request failed or was cancelled: a retry after this worker's death still finds them)
        ──step: the waveform ──encode (wav | pcm | flac)──▶ byte chunks of ≤ CHUNK_BYTES──▶
    one MediaResult per chunk to the gateway's ``reply_to`` (index = chunk number, ``finish`` on the
    last one), then StageDone(finished=True) to the broker — after the last chunk, so the broker
    never forgets a request whose audio is still on its way; or one StageFailed (``bad_request``
    for an unknown voice or malformed inputs, ``deadline_exceeded``, ``transfer_failed`` …).

Streamed requests (``SpeechParams.stream``, wav or pcm): the engine hands out waveform pieces while
the talker still speaks; each piece is sent at once as 16-bit PCM (the first behind a streamed WAV
header, :data:`WAV_STREAM_HEADER`) in MediaResults of ≤ CHUNK_BYTES, numbered on from the previous
piece's; ``finish`` on the last of the final piece, then StageDone. A failure mid-stream is one
StageFailed after the pieces already sent. The pieces follow a fixed plan from the seed, so a retry
elsewhere sends the same bytes under the same indexes and the gateway skips what it delivered.
FLAC is not streamed (its header wants the length): such a request is synthesised whole.

Per request the adapter keeps one :class:`~omnirelay.workers.speech.delivery.Delivery` record (the
format, the input hand-off to release, a streamed reply's chunks read, the next MediaResult index),
in its ``deliveries``; how a task is read is an :class:`~omnirelay.workers.speech.inputs.SpeechInputs`.

What the stages before leave in ``Task.inputs``, a :class:`~omnirelay.handoffs.SpeechHandoff`:

* ``speech_prompt_key``/``speech_prompt_handle``: prefill's ``{"hidden": [n, H], "image_grids",
  "audio_lengths"}``, the last-layer states of every prompt token and the prompt's media shapes
  (the talker's M-RoPE positions need them);
* ``speech_reply_key``/``speech_reply_handle`` (chat only): decode's ``{"hidden": [m-1, H],
  "token_ids": [m]}``, the reply tokens and the states of all but the last one.

For ``/v1/audio/speech`` (``SpeechParams.reply_start >= 0``) there is no decode stage: the text was
teacher-forced into the prompt from ``reply_start`` on, so the reply and its states are the prompt's tail.

Chunks: a bus message has a size limit (:data:`~omnirelay.broker.protocol.MAX_BODY_BYTES`), so audio
of any length travels as several MediaResults; concatenating the chunks' bytes in index order gives
the encoded file (a WAV/FLAC file, or raw PCM).
"""

from __future__ import annotations

import base64
import io
import logging
import wave
from typing import Callable

import msgspec
import torch

from omnirelay.broker import protocol as p
from omnirelay.connectors import Connector
from omnirelay.errors import BadRequest, OmniError
from omnirelay.handoffs import SpeechHandoff
from omnirelay.request_params import speech_of

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.speech.delivery import Deliveries, Delivery, DeliveryStatus
from omnirelay.workers.speech.engine import SAMPLE_RATE, GenerateSpeechEngine, SpeechChunk, SpeechTask
from omnirelay.workers.speech.inputs import OmniInputs, SpeechInputs
from omnirelay.workers.speech.qwen2_5_omni import load_qwen2_5_omni
from omnirelay.workers.speech.qwen3 import load_qwen3_omni
from omnirelay.workers.runtime.assembly import BuiltRole, closed_on_error, open_connector
from omnirelay.workers.runtime.roles import Outbound, RoleAdapter

log = logging.getLogger("omnirelay.worker.speech")

# Raw bytes per MediaResult: a quarter second of 24 kHz 16-bit mono, the granularity a streaming client
# receives (16 KiB of base64, far under one bus message).
CHUNK_BYTES = SAMPLE_RATE // 4 * 2
# A streamed WAV's header is sent before the length is known: RIFF and data sizes say 0xFFFFFFFF,
# the usual "unknown length" of streamed WAV (readers take the data up to the end of the stream).
WAV_STREAM_HEADER = (b"RIFF" + (0xFFFFFFFF).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
                     + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + SAMPLE_RATE.to_bytes(4, "little")
                     + (SAMPLE_RATE * 2).to_bytes(4, "little") + (2).to_bytes(2, "little")
                     + (16).to_bytes(2, "little") + b"data" + (0xFFFFFFFF).to_bytes(4, "little"))
MIMES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


def flac_available() -> bool:
    """FLAC needs the optional ``soundfile`` package (libsndfile); WAV and PCM need nothing."""
    try:
        import soundfile  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def encode_audio(waveform: torch.Tensor, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """``waveform`` (float, [-1, 1]) as a mono 16-bit file: ``wav`` (RIFF), ``pcm`` (raw LE) or ``flac``."""
    pcm16 = (waveform.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16).numpy().astype("<i2")
    if fmt == "pcm":
        return pcm16.tobytes()
    buf = io.BytesIO()
    if fmt == "wav":
        with wave.open(buf, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(pcm16.tobytes())
        return buf.getvalue()
    if fmt == "flac":
        import soundfile
        soundfile.write(buf, pcm16, sample_rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()
    raise BadRequest(f"unknown audio format {fmt!r}", param="response_format")


class GenerateSpeechRole(RoleAdapter):
    role = "generate"

    def __init__(self, worker_id: str, engine: GenerateSpeechEngine, connector: Connector | None,
                 transfer_timeout_s: float = 30.0, chunk_bytes: int = CHUNK_BYTES,
                 inputs: SpeechInputs | None = None):
        """``inputs``: how a task is read (inputs.py); by default the omni models' hidden states on
        ``connector``. A role without a connector (Qwen3-TTS) reads nothing from one and releases nothing."""
        super().__init__(worker_id, engine, connector)
        self.engine: GenerateSpeechEngine = engine
        self.chunk_bytes = chunk_bytes
        if inputs is None:
            if connector is None:
                raise ValueError("a speech role reading hidden states needs a connector")
            inputs = OmniInputs(connector, transfer_timeout_s)
        self.inputs = inputs
        self.deliveries = Deliveries()   # what this role keeps per request held (delivery.py)

    def accept(self, task: p.Task) -> list[Outbound]:
        # A re-dispatched request we still hold: the new attempt wins, and may read the same keys.
        old = self.deliveries.get(task.request_id)
        if old is not None:
            old.inputs = None   # the cancel below releases nothing of them
        self._replace_held(task)
        try:
            params = speech_of(task.params)
            if params is None:
                raise BadRequest(f"a speech worker speaks, it cannot serve a {type(task.params).__name__} request")
            if params.format == "flac" and not flac_available():
                raise BadRequest("flac needs the soundfile package on the generate worker; use wav or pcm",
                                 param="response_format")
            speech = self.inputs.read(task, params)
            speech.stream = params.stream and params.format != "flac"
            speech.priority = task.priority   # the waiting queue's order (omnirelay/scheduling.py)
            self.engine.add(speech)
        except BadRequest as exc:
            self.release(task.inputs)
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid speech request: {exc.message}",
                                 attempt=task.attempt)]
        except OmniError as exc:   # the connector could not deliver the hidden states
            self.release(task.inputs)
            return [self.failure(task.request_id, task.stage, exc.error_type, str(exc), attempt=task.attempt)]
        except (KeyError, TypeError, ValueError) as exc:
            self.release(task.inputs)
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid speech task: {exc!r}",
                                 attempt=task.attempt)]
        self._hold(task)
        streamed = isinstance(task.inputs, SpeechHandoff) and task.inputs.reply_stream is not None
        reply = speech.reply_stream if streamed and isinstance(speech, SpeechTask) else None
        self.deliveries.add(Delivery(task.request_id, params.format, task.inputs, reply))
        return []

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        delivery = self.deliveries.pop(request_id)
        if delivery is None:
            return
        inputs = delivery.inputs
        if delivery.reply is not None and isinstance(inputs, SpeechHandoff) and inputs.reply_stream is not None \
                and self.connector is not None:
            # What decode may still have written past what was read (the chunks read are deleted).
            inputs.reply_stream.release(self.connector, first=delivery.reply.chunks_read)
            inputs = msgspec.structs.replace(inputs, reply_stream=None)
        self.release(inputs)

    def step(self) -> list[Outbound]:
        result = self.engine.step()
        out: list[Outbound] = []
        for speech in result.outputs:
            reply_to = self._reply_to.get(speech.request_id)
            delivery = self.deliveries.get(speech.request_id)
            self._forget(speech.request_id)
            if reply_to is None or delivery is None:
                continue   # cancelled while it ran
            fmt = delivery.format
            data = encode_audio(speech.waveform, fmt)
            size = self.chunk_bytes
            chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
            for index, chunk in enumerate(chunks):
                out.append((reply_to, p.MediaResult(speech.request_id, index, MIMES[fmt],
                                                    base64.b64encode(chunk).decode("ascii"),
                                                    finish=index == len(chunks) - 1, worker_id=self.worker_id)))
            out.append(self._done(speech.request_id, None, True))
        for chunk in result.chunks:
            out += self._send_piece(chunk)
        out += [self._engine_failed(f.request_id, f.error_type, f.message) for f in result.failed]
        return out

    def _send_piece(self, chunk: SpeechChunk) -> list[Outbound]:
        """One streamed piece as MediaResults (and, after the final one, StageDone)."""
        reply_to = self._reply_to.get(chunk.request_id)
        delivery = self.deliveries.get(chunk.request_id)
        if reply_to is None or delivery is None:
            return []   # cancelled meanwhile
        fmt = delivery.format
        data = encode_audio(chunk.waveform, "pcm")
        if chunk.index == 0 and fmt == "wav":
            data = WAV_STREAM_HEADER + data
        size = self.chunk_bytes
        parts = [data[i:i + size] for i in range(0, len(data), size)] or ([b""] if chunk.final else [])
        first = delivery.next_index
        out: list[Outbound] = [
            (reply_to, p.MediaResult(chunk.request_id, first + k, MIMES[fmt], base64.b64encode(part).decode("ascii"),
                                     finish=chunk.final and k == len(parts) - 1, worker_id=self.worker_id))
            for k, part in enumerate(parts)]
        delivery.next_index = first + len(parts)
        delivery.status = DeliveryStatus.STREAMING
        if chunk.final:
            self._forget(chunk.request_id)
            out.append(self._done(chunk.request_id, None, True))
        return out


def build_speech_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A speech generate worker for a Qwen2.5-Omni directory."""
    return _build(config, load_qwen2_5_omni)


def build_qwen3_omni_speech_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """A speech generate worker for a Qwen3-Omni directory."""
    return _build(config, load_qwen3_omni)


def _build(config: WorkerConfig, load: Callable[..., GenerateSpeechEngine]) -> BuiltRole:
    """The role adapter, heartbeat stats and owned parts of a speech generate worker: the talker and
    token2wav (code2wav) run on the first CUDA device when there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    connector = open_connector(config)
    with closed_on_error(connector):
        engine = load(config.model_path, dtype=getattr(torch, config.dtype), device=device,
                      max_batch_size=config.capacity)
    log.info("speech generate worker: %s on %s, voices %s", config.model_path, device, ", ".join(engine.voices))

    def stats() -> dict:
        return {**engine.load(), **engine.stats}

    # The engine first: closing it joins its synthesis thread before the connector goes.
    return BuiltRole(GenerateSpeechRole(config.worker_id, engine, connector), stats, owned=(connector,))
