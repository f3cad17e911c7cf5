"""The Qwen3-TTS (12 Hz CustomVoice) speech family (:class:`Qwen3TTSFamily`, a ``SpeechFamily``):
text → codec frames → waveform.

Life of a request through it::

    add(TTSTask: the text's ids as the package builds them — ``<|im_start|>assistant\\n`` TEXT
        ``<|im_end|>\\n<|im_start|>assistant\\n`` —, SpeechParams) ──▶ waiting (FIFO)
        ──step(): the oldest live request, on the synthesis thread──▶
    talker: the package's ``Qwen3TTSForConditionalGeneration.generate`` (speaker = the voice, language
        "auto", the checkpoint's ``generation_config.json`` sampling), stepped by us as it steps
        (qwen3_tts_talker.py: the prompt forward alone, the decode steps of every request held as
        one batch), up to ``frames_budget`` codec frames; each frame is NUM_CODE_GROUPS codes (the
        talker samples the first, its code predictor the rest)
    ──▶ codec decoder (the package's ``Qwen3TTSTokenizerV2Decoder``, as ``Qwen3TTSTokenizerV2Model.decode``
        runs it): 1920 samples per frame at 24 kHz ──▶ SpeechOutput to the role adapter

A streamed request (``TTSTask.stream``) runs the same talker and sees every frame as soon as the
code predictor has filled it in (the same codes the package's generate collects), and decodes them
in chunks: the first after FIRST_CHUNK_FRAMES frames, then every CHUNK_FRAMES, the rest at
the end, each chunk decoded with up to LEFT_CONTEXT_FRAMES earlier frames before it and the context's
samples dropped — the package's own ``chunked_decode`` scheme (its decoder is causal: convolutions
padded on the left, attention over a sliding window), so the pieces differ from a one-shot decode
only where the decoder would reach further back than the context. The plan is fixed, so a request
re-synthesised elsewhere with the same seed yields the very same pieces (the gateway resumes a
stream by chunk index). A cancelled request, streamed or one-shot, stops at its next frame.

Why not the package's ``generate`` itself: under transformers 5.25 its KV caches never reach its
models (``generate`` passes ``cache=``, the package's talker and code predictor read
``past_key_values``), so every talker and code-predictor step ran without its history. Ours keeps
them; the test compares with the package's ``generate`` given its caches.

Determinism: each request samples from its own generator seeded with its seed, in the order the
package's ``generate`` draws from ``torch.manual_seed(seed)`` (tested: the same frames), so its
codes depend on its seed, voice and text only, batched or alone (the contract of the omni engines,
engine.py); streamed and one-shot requests sample the same codes.

Queue, synthesis thread, cancellation, deadlines and ``close`` are the engine's
(:class:`~omnirelay.workers.speech.engine.GenerateSpeechEngine`, which runs this family as it runs
every family; :func:`load_qwen3_tts` builds one); the family loads the model and computes. It
holds no sockets.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from omnirelay.errors import BadRequest
from omnirelay.speech_params import MAX_CODES, SpeechParams

from omnirelay.workers.speech import qwen3_tts_talker
from omnirelay.workers.speech.engine import SAMPLE_RATE, GenerateSpeechEngine
from omnirelay.workers.speech.family import PieceSink
from omnirelay.workers.speech.loading import load_prefixed
from omnirelay.workers.speech.qwen3_talker import Qwen3Row
from omnirelay.workers.speech.qwen3_tts_package import check_supported, load_classes
from omnirelay.workers.speech.reply_source import ReplySource
from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.talker_batch import BatchKV

log = logging.getLogger("omnirelay.worker.speech")

FIRST_CHUNK_FRAMES = 4       # ~0.3 s of audio before the first piece goes out
CHUNK_FRAMES = 12            # ~1 s per piece after that
LEFT_CONTEXT_FRAMES = 25     # as the package's chunked_decode
# The automatic frame budget (``max_audio_tokens`` 0): 12.5 frames/s and ~0.3 s per text token, with
# room; a trained talker ends on its codec EOS well before, an untrained one stops in proportion.
FRAMES_PER_TOKEN, FRAMES_MARGIN = 5, 12
PROMPT_HEAD, PROMPT_TAIL = 3, 5   # <|im_start|>assistant\n … <|im_end|>\n<|im_start|>assistant\n
SAMPLING_KEYS = ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty", "subtalker_dosample",
                 "subtalker_top_k", "subtalker_top_p", "subtalker_temperature")


@dataclasses.dataclass
class TTSTask:
    request_id: str
    prompt_token_ids: list[int]       # the text wrapped as the package wraps it (see the module docstring)
    params: SpeechParams
    deadline: float
    stream: bool = False
    priority: int = 0   # Task.priority: the waiting queue's order (request_queue.py)

    def bind_stop(self, stop: threading.Event) -> None:
        """Nothing to bind: the task waits for no input (the engine polls ``stop`` between frames)."""

    def frames_budget(self) -> int:
        text = len(self.prompt_token_ids) - PROMPT_HEAD - PROMPT_TAIL
        return self.params.max_codes or min(MAX_CODES, FRAMES_PER_TOKEN * max(1, text) + FRAMES_MARGIN)


def _load_state(module: torch.nn.Module, root: Path, prefix: str = "") -> None:
    """``module``'s tensors from the safetensors checkpoint in ``root`` (sharded or not), those whose
    names start with ``prefix`` (stripped); every parameter must be there."""
    state = {k[len(prefix):]: v for k, v in load_prefixed(root, (prefix,)).items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    # Non-persistent buffers (rotary frequencies) are rebuilt by the constructor, never saved.
    missing = [k for k in missing if not k.endswith(("inv_freq", "original_inv_freq"))]
    if missing or unexpected:
        raise ValueError(f"{root} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")


class Qwen3TTSTalk:
    """One request's Qwen3-TTS talker (family.py ``Talk``): its codes are frames, [groups] tensors,
    each complete once the code predictor filled in its step."""

    reply: ReplySource | None = None   # the whole text is in the prompt: nothing to wait for

    def __init__(self, row: Qwen3Row, eos: int, budget: int):
        self.row, self._eos, self._budget = row, eos, budget
        self._stepped = False

    def spoken(self) -> list[torch.Tensor]:
        return [self.row.codes] if self._stepped else []   # the prompt forward sampled a first code only

    def done(self) -> bool:
        return self.row.first_codes[-1] == self._eos or self.row.sampled >= self._budget

    def prepare(self) -> None:
        self._stepped = True   # non-streaming mode: every step reads the tts pad row set at start


class Qwen3TTSFamily:
    """The Qwen3-TTS speech family (a :class:`~omnirelay.workers.speech.family.SpeechFamily`; what it
    computes: the module docstring)."""

    def __init__(self, model: Any, decoder: Any, *, upsample: int, device: str = "cpu"):
        self.model = model
        self.decoder = decoder
        self.upsample = upsample
        self.device = torch.device(device)
        talker = model.config.talker_config
        self.speakers = {name.lower(): spk for name, spk in talker.spk_id.items()}
        self.eos = int(talker.codec_eos_token_id)
        defaults = model.generate_config or {}
        self.sampling = {k: defaults[k] for k in SAMPLING_KEYS if k in defaults}
        self.im_start = int(model.config.im_start_token_id)
        self.im_end = int(model.config.im_end_token_id)
        self.head: list[int] = []    # <|im_start|>assistant\n
        self.tail: list[int] = []    # <|im_end|>\n<|im_start|>assistant\n

    def set_template(self, tokenizer: Any) -> None:
        """The ids around the text, as the package's processor tokenizes its prompt string."""
        self.head = list(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
        self.tail = list(tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
        if len(self.head) != PROMPT_HEAD or len(self.tail) != PROMPT_TAIL or self.head[0] != self.im_start:
            raise ValueError(f"the tokenizer does not split the Qwen3-TTS prompt as the model expects "
                             f"({len(self.head)} + {len(self.tail)} tokens around the text)")

    def wrap(self, text_ids: list[int]) -> list[int]:
        """The talker's prompt for a text's ids: ``<|im_start|>assistant\\n`` TEXT ``<|im_end|>\\n<|im_start|>assistant\\n``
        (``Qwen3TTSModel._build_assistant_text``; the text tokenized on its own, as the gateway does)."""
        return self.head + list(text_ids) + self.tail

    @property
    def voices(self) -> list[str]:
        return sorted(self.speakers)

    def check(self, task: TTSTask) -> None:
        if task.params.voice.lower() not in self.speakers:
            raise BadRequest(f"voice {task.params.voice!r} is not one of this model's speakers: "
                             f"{', '.join(self.voices)}", param="voice")
        ids = task.prompt_token_ids
        if len(ids) < PROMPT_HEAD + PROMPT_TAIL + 1 or ids[0] != self.im_start:
            raise BadRequest("the prompt must be <|im_start|>assistant\\n TEXT <|im_end|>\\n<|im_start|>assistant\\n "
                             "with a non-empty TEXT", param="input")

    def prompt(self, task: TTSTask) -> TTSTask:
        """Nothing to build outside the turn: the prompt's embeddings come from the talker module's
        tables and are built with its forward (:meth:`start`)."""
        return task

    def start(self, task: TTSTask, prompt: TTSTask, generator: torch.Generator) -> Qwen3TTSTalk:
        embeds, tts_pad = qwen3_tts_talker.prompt(self.model, prompt.prompt_token_ids, task.params.voice.lower(),
                                                  self.device)
        row = qwen3_tts_talker.start(self.model, embeds, generator, self.sampling)
        row.text_row = tts_pad   # non-streaming mode: the whole text is in the prompt
        return Qwen3TTSTalk(row, self.eos, task.frames_budget())

    def step(self, batch_kv: BatchKV, seats: list[Seat]) -> None:
        qwen3_tts_talker.step(self.model, batch_kv, seats)

    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """``frames`` [n, groups] → float32 waveform [n * upsample] (``Qwen3TTSTokenizerV2Model.decode``)."""
        if frames.shape[0] == 0:
            return torch.zeros(0)
        wav = self.decoder.chunked_decode(frames.clamp(min=0).T[None].to(self.device))
        return wav.reshape(-1)[: frames.shape[0] * self.upsample].float().cpu()

    def vocode(self, task: TTSTask, codes: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        return self.decode(torch.stack(codes))

    def vocoder(self, task: TTSTask, on_piece: PieceSink) -> "_FrameChunker":
        return _FrameChunker(self, on_piece)


def load_qwen3_tts(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   max_batch_size: int = 1) -> GenerateSpeechEngine:
    """A speech engine for a Qwen3-TTS 12 Hz CustomVoice directory: the package's classes built from
    the directory's configs, its safetensors loaded (why not the package's own ``from_pretrained``:
    workers/speech/qwen3_tts_package.py)."""
    return GenerateSpeechEngine(load_family(path, dtype=dtype, device=device), device=device,
                                max_batch_size=max_batch_size)


def load_family(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Qwen3TTSFamily:
    classes = load_classes()
    root = Path(path)
    raw = json.loads((root / "config.json").read_text())
    check_supported(raw)
    config = classes.config.from_pretrained(str(root))
    predictor = config.talker_config.code_predictor_config
    if "pad_token_id" not in predictor.__dict__:
        predictor.pad_token_id = None   # transformers 5 no longer defaults it (qwen3_tts_package.py)
    model = classes.model._from_config(config)
    _load_state(model, root)
    model.load_generate_config(json.loads((root / "generation_config.json").read_text()))
    codec = classes.tokenizer_config.from_pretrained(str(root / "speech_tokenizer"))
    if codec.output_sample_rate != SAMPLE_RATE:
        raise ValueError(f"the codec outputs {codec.output_sample_rate} Hz; this server encodes {SAMPLE_RATE} Hz")
    decoder = classes.codec_decoder._from_config(codec.decoder_config)
    _load_state(decoder, root / "speech_tokenizer", "decoder.")
    model = model.to(device=device, dtype=dtype).eval()
    decoder = decoder.to(device=device).float().eval()   # the waveform in float32, as the package decodes
    from transformers import AutoTokenizer
    family = Qwen3TTSFamily(model, decoder, upsample=int(codec.decode_upsample_rate), device=device)
    family.set_template(AutoTokenizer.from_pretrained(str(root)))
    return family


class _FrameChunker:
    """Collects a streamed request's frames and emits the waveform piece by piece (the fixed plan
    in the module docstring; a StreamingVocoder)."""

    def __init__(self, family: Qwen3TTSFamily, on_piece: PieceSink):
        self.family, self.on_piece = family, on_piece
        self.frames: list[torch.Tensor] = []
        self.sent = 0          # frames whose samples went out
        self.pieces = 0        # emitted so far

    def ready(self, count: int) -> bool:
        """Whether :meth:`feed` bringing the frames to ``count`` would decode a piece."""
        return count - self.sent >= (FIRST_CHUNK_FRAMES if self.pieces == 0 else CHUNK_FRAMES)

    def feed(self, frames: Sequence[torch.Tensor]) -> None:
        self.frames.extend(frame.detach().to("cpu", torch.long) for frame in frames[len(self.frames):])
        size = FIRST_CHUNK_FRAMES if self.pieces == 0 else CHUNK_FRAMES
        if len(self.frames) - self.sent >= size:
            self._piece(self.sent + size, final=False)

    def finish(self) -> None:
        self._piece(len(self.frames), final=True)

    def _piece(self, end: int, *, final: bool) -> None:
        start = self.sent
        context = min(LEFT_CONTEXT_FRAMES, start)
        wav = torch.zeros(0)
        if end > start:
            window = torch.stack(self.frames[start - context:end])
            wav = self.family.decode(window)[context * self.family.upsample:]
        self.pieces += 1
        self.sent = end
        self.on_piece(wav, len(self.frames), final)
