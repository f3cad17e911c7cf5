"""Speech engine of the generate role: thinker hidden states → talker codec tokens → token2wav waveform.

Life of a request through this engine::

    add(SpeechTask: prompt ids + hidden states, reply ids + hidden states, SpeechParams)
        ──▶ waiting (FIFO) ──step(): the oldest live request──▶
    talker: its prompt is built exactly as transformers' ``Qwen2_5OmniForConditionalGeneration.generate``
        builds it, then sampled with the same settings (top-k 40, top-p 0.8, temperature 0.9,
        repetition penalty 1.05, codec BOS suppressed, EOS = codec pad/end) up to ``max_codes`` (by
        default in proportion to the reply's length: ``SpeechParams.codes_for``)
    ──▶ token2wav: DiT (10 Runge-Kutta steps from Gaussian noise, speaker ``cond`` + ``ref_mel``)
        + BigVGAN ──▶ SpeechOutput(float waveform at :data:`SAMPLE_RATE`) to the role adapter

A streamed request (``SpeechTask.stream``: the client reads the audio as it comes) runs the same
talker, but token2wav runs per chunk of codec tokens inside the talker's loop
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

Determinism: each request runs under its own seeded random stream (``torch.random.fork_rng`` +
``manual_seed(seed)``), consumed in transformers' order — talker sampling, then token2wav's noise —
so a request's audio depends on its seed and inputs only, never on what else the worker runs, and
equals ``torch.manual_seed(seed); model.generate(...)`` of transformers with a greedy thinker.
A streamed request's talker samples from that same stream (the same codes); its token2wav noise
comes from its own generator seeded with the seed, so its pieces too depend on seed and inputs only.

Batching: requests are not merged into one talker forward. transformers draws a batch's samples
from one random stream (so a request's audio would depend on its neighbours) and decodes token2wav
one sample at a time for the same reason; per-request determinism wins over the batching gain.

Threads: one request's synthesis (transformers' ``generate`` + token2wav) runs whole, for seconds,
so it runs on the engine's one synthesis thread; ``step()`` starts the next request there and
returns at once (or after a short wait for the running one), so the worker's loop keeps
heartbeating and taking cancels meanwhile. A streamed request's pieces pass from that thread to
``step()`` through a deque (appended there, taken here). A cancelled running request is dropped:
a streamed one stops at its next codec token (its ``CodeTap`` raises), a one-shot finishes first.
:meth:`close` joins the thread (the worker runtime owns the engine and closes it on shutdown).

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
from omnirelay.speech_params import SpeechParams

from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.speech.stream import ChunkedToken2Wav, CodeTap, SynthesisCancelled

log = logging.getLogger("omnirelay.worker.speech")

SAMPLE_RATE = 24000                                   # Qwen2.5-Omni's token2wav output rate
TALKER_SAMPLING = {"do_sample": True, "top_k": 40, "top_p": 0.8, "temperature": 0.9,
                   "repetition_penalty": 1.05}        # transformers' generate() defaults for the talker


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
        self._init_queue(max_batch_size)

    def _init_queue(self, max_batch_size: int) -> None:
        """The queue, synthesis thread and counters that step()/cancel()/close() run on (shared with
        the Qwen3-TTS engine, qwen3_tts.py, which synthesises differently)."""
        self.max_batch_size = max_batch_size
        self.waiting: RequestQueue[SpeechTask] = RequestQueue()
        self.running: tuple[SpeechTask, concurrent.futures.Future] | None = None
        self._dropped: set[str] = set()   # cancelled while running: their result is discarded
        self._cancelled = threading.Event()   # set to stop the running streamed request between tokens
        # Streamed pieces, appended by the synthesis thread, taken by step() (deque ends are thread-safe).
        self._chunks: collections.deque[SpeechChunk] = collections.deque()
        self._first_chunk_codes: dict[str, int] = {}
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="speech-synth")
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
        return len(self.waiting) + (self.running is not None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.running is not None

    def load(self) -> dict:
        return {"running": int(self.running is not None), "waiting": len(self.waiting)}

    def wake(self) -> None:
        """Nothing to wake: step() never waits idle."""

    def close(self) -> None:
        """Stop taking work and join the synthesis thread (a running request finishes first)."""
        self.waiting.clear()
        self._thread.shutdown(wait=True, cancel_futures=True)

    def add(self, task: SpeechTask) -> None:
        """Validate and queue ``task``; raises :class:`BadRequest` for what this model cannot speak."""
        if task.params.voice not in self.speakers:
            raise BadRequest(f"voice {task.params.voice!r} is not one of this model's speakers: "
                             f"{', '.join(self.voices)}", param="voice")
        m = len(task.reply_token_ids)
        hidden = self.thinker_embed.shape[1]
        if m < 2:
            raise BadRequest("the reply to speak has fewer than 2 tokens")
        if tuple(task.reply_hidden.shape) != (m - 1, hidden):
            raise BadRequest(f"reply hidden states are {tuple(task.reply_hidden.shape)}, expected {(m - 1, hidden)}")
        if tuple(task.prompt_hidden.shape) != (len(task.prompt_token_ids), hidden):
            raise BadRequest(f"prompt hidden states are {tuple(task.prompt_hidden.shape)}, "
                             f"expected {(len(task.prompt_token_ids), hidden)}")
        self.waiting.add(task)

    def cancel(self, request_id: str) -> bool:
        if self.waiting.remove(request_id) is not None:
            return True
        if self.running is not None and self.running[0].request_id == request_id:
            self._dropped.add(request_id)
            self._cancelled.set()   # a streamed request stops at its next token; a one-shot runs out
            return True
        return False

    # ------------------------------------------------------------------ one step

    def step(self, wait_s: float = 0.05) -> SpeechStep:
        """Expire waiting requests, start the next one on the synthesis thread when it is free,
        collect the pieces a streamed request has produced so far, and collect the running request
        if it finishes within ``wait_s``."""
        out = SpeechStep()
        for task in self.waiting.pop_expired():
            out.failed.append(RequestFailure(task.request_id, DeadlineExceeded.error_type, "deadline passed before speech"))
        if self.running is None and self.waiting:
            task = self.waiting.popleft()
            self._cancelled = threading.Event()
            self.running = (task, self._thread.submit(self._synthesize_any, task, self._cancelled))
        if self.running is None:
            return out
        task, future = self.running
        try:
            waveform, codes = future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            self._collect_chunks(out)
            return out
        except SynthesisCancelled:
            pass   # a cancelled stream stopped between tokens: dropped below
        except torch.cuda.OutOfMemoryError as exc:
            out.failed.append(RequestFailure(task.request_id, OutOfMemory.error_type, str(exc)))
        except Exception as exc:   # a bug in synthesis fails this request, not the worker
            log.exception("speech synthesis failed for %s", task.request_id)
            out.failed.append(RequestFailure(task.request_id, OmniError.error_type, f"{type(exc).__name__}: {exc}"))
        else:
            self.stats["speech_requests"] += 1
            self.stats["talker_codes"] += codes
            if waveform is not None:
                self.stats["audio_samples"] += int(waveform.numel())
                out.outputs.append(SpeechOutput(task.request_id, waveform, codes))
        finally:
            if future.done():
                self.running = None
        # The thread queued every piece before it finished: these are the last ones (before any failure).
        self._collect_chunks(out)
        self._first_chunk_codes.pop(task.request_id, None)
        if task.request_id in self._dropped:
            self._dropped.discard(task.request_id)
            out.outputs = [o for o in out.outputs if o.request_id != task.request_id]
            out.chunks = [c for c in out.chunks if c.request_id != task.request_id]
            out.failed = [f for f in out.failed if f.request_id != task.request_id]
        return out

    def _collect_chunks(self, out: SpeechStep) -> None:
        """Move the streamed pieces the synthesis thread queued into ``out`` (the dropped request's
        are discarded) and count them. ``speech_stream_early_first_chunks`` counts streamed requests
        whose first piece went out before the talker's last code: the point of streaming."""
        while self._chunks:
            chunk = self._chunks.popleft()
            if chunk.request_id in self._dropped:
                continue
            self.stats["speech_stream_chunks"] += 1
            self.stats["audio_samples"] += int(chunk.waveform.numel())
            if chunk.index == 0:
                self._first_chunk_codes[chunk.request_id] = chunk.codes
            if chunk.final:
                self.stats["speech_stream_requests"] += 1
                first = self._first_chunk_codes.get(chunk.request_id, chunk.codes)
                self.stats["speech_stream_first_chunk_codes"] += first
                self.stats["speech_stream_codes"] += chunk.codes
                self.stats["speech_stream_early_first_chunks"] += int(first < chunk.codes)
            out.chunks.append(chunk)

    def _synthesize_any(self, task: SpeechTask, cancelled: threading.Event) -> tuple[torch.Tensor | None, int]:
        """On the synthesis thread: the one-shot waveform, or (None, codes) for a streamed request
        whose pieces went to ``self._chunks``."""
        if task.stream:
            return None, self.synthesize_stream(task, self._chunks.append, cancelled)
        return self.synthesize(task)

    @torch.inference_mode()
    def synthesize(self, task: SpeechTask) -> tuple[torch.Tensor, int]:
        """The waveform of one request (float32, 1-D) and the number of codec tokens spoken."""
        talker_inputs = self._talker_inputs(task)
        speaker = self.speakers[task.params.voice]
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(task.params.seed)
            talker = self.talker
            result = talker.generate(
                **talker_inputs, suppress_tokens=[talker.codec_bos_token],
                max_new_tokens=task.params.codes_for(len(task.reply_token_ids)),
                eos_token_id=[talker.codec_pad_token, talker.codec_eos_token], pad_token_id=talker.codec_pad_token,
                use_audio_in_video=False, **TALKER_SAMPLING)
            codes = result[:, talker_inputs["input_ids"].shape[1]:]
            eos = (codes == talker.codec_pad_token) | (codes == talker.codec_eos_token)
            length = int(eos[0].nonzero()[0, 0]) if bool(eos.any()) else codes.shape[1]
            if length == 0:
                return torch.zeros(0), 0
            cond = speaker["cond"].to(self.device).float().expand(1, -1)
            ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
            wav = self.token2wav(codes[:, :length], conditioning=cond, reference_mel=ref_mel)
        wav = wav.reshape(-1).float().cpu()
        if task.params.speed != 1.0:
            wav = _change_speed(wav, task.params.speed)
        return wav, length

    @torch.inference_mode()
    def synthesize_stream(self, task: SpeechTask, emit: Callable[[SpeechChunk], None],
                          cancelled: threading.Event | None = None) -> int:
        """A streamed request: ``emit`` each waveform piece as soon as the codes it depends on exist
        (stream.py); returns the number of codec tokens spoken. The talker runs as in
        :meth:`synthesize` (same inputs, sampling and seeded stream, so the same codes); token2wav
        runs per chunk inside its loop. ``cancelled`` set: raises :class:`SynthesisCancelled` at the
        next token (or before the last piece)."""
        cancelled = cancelled or threading.Event()
        talker_inputs = self._talker_inputs(task)
        speaker = self.speakers[task.params.voice]
        talker, index = self.talker, 0

        def on_piece(wav: torch.Tensor, codes: int, final: bool) -> None:
            nonlocal index
            if task.params.speed != 1.0 and wav.numel():
                wav = _change_speed(wav, task.params.speed)
            emit(SpeechChunk(task.request_id, index, wav, codes, final))
            index += 1

        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(task.params.seed)
            cond = speaker["cond"].to(self.device).float().expand(1, -1)
            ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
            token2wav = ChunkedToken2Wav(self.token2wav, cond, ref_mel, task.params.seed, on_piece)
            tap = CodeTap((talker.codec_pad_token, talker.codec_eos_token), token2wav.feed, cancelled)
            talker.generate(
                **talker_inputs, suppress_tokens=[talker.codec_bos_token],
                max_new_tokens=task.params.codes_for(len(task.reply_token_ids)),
                eos_token_id=[talker.codec_pad_token, talker.codec_eos_token], pad_token_id=talker.codec_pad_token,
                use_audio_in_video=False, streamer=tap, **TALKER_SAMPLING)
            if cancelled.is_set():
                raise SynthesisCancelled()
            token2wav.feed(tap.codes, final=True)
        return len(tap.codes)

    def _talker_inputs(self, task: SpeechTask) -> dict:
        """The talker's inputs for one request, built as transformers' ``generate`` builds them."""
        dev, talker = self.device, self.talker
        dtype = self.thinker_embed.dtype
        ids = torch.tensor([task.prompt_token_ids], dtype=torch.long, device=dev)
        reply = torch.tensor(task.reply_token_ids, dtype=torch.long, device=dev)
        embed = self.thinker_embed
        prompt_embeds = embed[ids[0]]
        media = torch.isin(ids[0], torch.tensor(self.media_token_ids, device=dev))
        prompt_embeds = prompt_embeds.masked_fill(media[:, None], 0.0)
        prompt_hidden = task.prompt_hidden.to(device=dev, dtype=dtype)
        reply_part = task.reply_hidden.to(device=dev, dtype=dtype) + embed[reply[:-1]]   # [m-1, H]
        bos_token = int(self.speakers[task.params.voice]["bos_token"])
        inputs_embeds = torch.cat([prompt_hidden + prompt_embeds, embed[bos_token][None], reply_part[:1]])
        # What the talker reads after its prompt, one row per codec token: the rest of the reply,
        # then the text EOS embedding, then text pads (the last one repeats once exhausted).
        rest = torch.cat([reply_part[1:], embed[talker.text_eos_token][None], embed[talker.text_pad_token][None]])
        n = ids.shape[1]
        codec_prompt = torch.tensor([[talker.codec_mask_token] * n + [talker.codec_pad_token, talker.codec_bos_token]],
                                    dtype=torch.long, device=dev)
        text_ids = torch.cat([ids, torch.tensor([[bos_token, task.reply_token_ids[0]]], device=dev)], dim=1)
        # As transformers' generate() called the documented way (``**processor(...)``, so with the
        # prompt's attention mask, extended by 2 for the codec pad and bos): every position attends.
        # (Without a mask, generate() would infer one from the codec pad id and hide that position.)
        grids = torch.tensor(task.image_grids, dtype=torch.long, device=dev) if task.image_grids else None
        audio = torch.tensor(task.audio_lengths, dtype=torch.long, device=dev) if task.audio_lengths else None
        return {"input_ids": codec_prompt, "input_text_ids": text_ids, "inputs_embeds": inputs_embeds[None],
                "thinker_reply_part": rest[None], "attention_mask": torch.ones_like(codec_prompt),
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
