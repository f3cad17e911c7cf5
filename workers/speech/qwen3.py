"""The Qwen3-Omni speech family (:class:`Qwen3OmniFamily`, a ``SpeechFamily``): thinker tokens → talker
codes → code2wav waveform.

Life of a request through it (the queue, the synthesis thread, cancellation, deadlines and the
per-request seeded random stream are :class:`~omnirelay.workers.speech.engine.GenerateSpeechEngine`'s,
which runs this family as it runs every family)::

    add(SpeechTask: prompt ids (+ the thinker's states at media tokens), reply ids, SpeechParams)
        ──▶ waiting ──step(): the oldest live request──▶
    talker prompt, built exactly as transformers' ``Qwen3OmniMoeForConditionalGeneration.generate``
        builds it: every user turn (text tokens through ``text_projection`` of their thinker
        embeddings, media tokens through ``hidden_projection`` of the thinker's states at layer
        ``accept_hidden_layer``), then the assistant header + tts pads/bos + the first reply token
        over the codec control tokens and the speaker's codec id; the rest of the reply is read one
        token per codec step (``trailing_text_hidden``, closed by tts eos, then tts pads)
    ──▶ ``Qwen3OmniMoeTalkerForConditionalGeneration``, stepped as its ``generate`` steps it (top-k 50,
        temperature 0.9, repetition penalty 1.05, the control range suppressed, EOS = codec eos; the
        decode steps of every request held batched: qwen3_talker.py): the first codebook per step,
        the code predictor fills the other ``num_code_groups - 1`` ──▶ ``Qwen3OmniMoeCode2Wav``
        ``chunked_decode`` (300 codes per chunk, 25 of left context) ──▶ SpeechOutput (24 kHz)

What the talker reads, for a prompt of ``n`` tokens and a reply ``t0 … t(m-1)``:

* token ids only, for text: the thinker's input embeddings at text tokens are rows of its
  embedding table, which this engine loads (one matrix); the thinker's states are not needed;
* ``prompt_hidden`` [n, H] at media tokens: prefill's capture of the thinker's layer
  ``accept_hidden_layer`` (the compact model captures that layer for Qwen3-Omni); other rows unused;
* ``reply_hidden``: unused (shape-checked only: decode sends it for every omni model).

Determinism: the request's own generator seeded with its seed, drawn in the order transformers'
``generate`` with a greedy thinker draws from ``torch.manual_seed(seed)``, so a request's codes
equal transformers' for the same seed (the tests check it), batched or alone (the engine's
contract). The talker's decode steps ride the worker's step batch (``qwen3_talker.py``) and read
their trailing text one row per step (:class:`TrailingRows`), so a reply
streamed in by decode is read as it arrives and gives the same rows, hence the same codes, as a
whole one. Streamed requests (``SpeechTask.stream``) run code2wav on each chunk of codes as soon as
the code predictor has filled it in (:class:`StreamedCode2Wav`: :data:`STREAM_FIRST_CODES` codes
first, then :data:`STREAM_CHUNK_CODES`, each with :data:`CODE2WAV_LEFT_CONTEXT` codes of left
context, each piece also finishing the previous one's last samples), so audio leaves while the
talker speaks; the pieces follow a fixed plan, the same on every worker, and join into the one-shot's
waveform to within float rounding (measured: 1e-4 at most on the tiny model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

import torch

from omnirelay.errors import BadRequest

from omnirelay.workers.speech import qwen3_talker
from omnirelay.workers.speech.engine import GenerateSpeechEngine, SpeechTask
from omnirelay.workers.speech.family import PieceSink
from omnirelay.workers.speech.loading import load_talker
from omnirelay.workers.speech.qwen2_5_omni import check_omni_task
from omnirelay.workers.speech.reply_source import ReplySource
from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.talker_batch import BatchKV

log = logging.getLogger("omnirelay.worker.speech")

CODE2WAV_CHUNK, CODE2WAV_LEFT_CONTEXT = 300, 25
# A streamed request's code2wav plan: its first piece after this many codes (a fraction of a second of
# speech at 12.5 codes/s), then pieces of the second size.
STREAM_FIRST_CODES, STREAM_CHUNK_CODES = 6, 25


def load_voices(root: Path, talker_config) -> dict[str, dict]:
    """name → {"speaker_id": codec id}: ``spk_dict.json`` beside the weights (what the gateway lists)
    when present, else the config's ``talker_config.speaker_id`` (names as the config spells them)."""
    path = root / "spk_dict.json"
    if path.is_file():
        table = json.loads(path.read_text())
        return {name: {"speaker_id": int(info["speaker_id"])} for name, info in table.items()}
    return {name: {"speaker_id": int(i)} for name, i in (talker_config.speaker_id or {}).items()}


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint MoE experts in the hub layout (``…mlp.experts.<e>.{gate,up,down}_proj.weight``)
    → transformers 5's module layout (``…mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``),
    as its loader converts them; every other tensor as it is."""
    out, experts = {}, {}
    for name, tensor in weights.items():
        head, sep, tail = name.partition(".mlp.experts.")
        index, _, rest = tail.partition(".")
        if sep and index.isdigit() and rest in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            experts.setdefault(head, {})[(int(index), rest)] = tensor
        else:
            out[name] = tensor
    for head, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((parts[(e, "gate_proj.weight")], parts[(e, "up_proj.weight")])) for e in range(count)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj.weight")] for e in range(count)])
    return out


class Qwen3Talk:
    """One request's Qwen3-Omni talker (family.py ``Talk``): its codes are [1, groups] tensors, each
    complete once the code predictor filled in its step."""

    def __init__(self, row: qwen3_talker.Qwen3Row, task: SpeechTask, rows: "TrailingRows", eos: int):
        self.row, self.rows, self._eos = row, rows, eos
        self.reply: ReplySource | None = task.reply()
        self._budget = task.codes_budget()
        self._stepped = False

    def spoken(self) -> list[torch.Tensor]:
        if not self._stepped:   # the prompt forward sampled a first codebook only
            return []
        return [self.row.codes[None]]

    def done(self) -> bool:
        return self.row.first_codes[-1] == self._eos or self._budget(self.row.sampled)

    def prepare(self) -> None:
        step = self.row.sampled - 1
        text = self.rows.through(step)
        self.row.text_row = text[0, step] if step < text.shape[1] else self.rows.tts_pad
        self._stepped = True


class Qwen3OmniFamily:
    """The Qwen3-Omni speech family (a :class:`~omnirelay.workers.speech.family.SpeechFamily`; what it
    computes: the module docstring)."""

    def __init__(self, talker, code2wav, thinker_embed: torch.Tensor, speakers: dict, config, *,
                 device: str = "cpu"):
        self.talker = talker
        self.token2wav = code2wav
        self.thinker_embed = thinker_embed
        self.speakers = speakers
        self.config = config
        self.device = torch.device(device)
        thinker = config.thinker_config
        self.media_token_ids = (thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id)
        eos = config.thinker_config.text_config.eos_token_id
        self.thinker_eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        vocab = config.talker_config.text_config.vocab_size
        self.suppress = [i for i in range(vocab - 1024, vocab) if i != config.talker_config.codec_eos_token_id]

    @property
    def voices(self) -> list[str]:
        return sorted(self.speakers)

    def check(self, task: SpeechTask) -> None:
        """The omni checks, and an assistant turn to speak in the prompt (the talker's prompt starts
        at its header)."""
        ids, cfg = task.prompt_token_ids, self.config
        if not any(a == cfg.im_start_token_id and b == cfg.assistant_token_id for a, b in zip(ids, ids[1:])):
            raise BadRequest("the prompt has no assistant turn for the talker to speak")
        check_omni_task(task, self.speakers, self.thinker_embed.shape[1])

    def prompt(self, task: SpeechTask) -> tuple[dict, "TrailingRows"]:
        return self._talker_inputs(task)

    def start(self, task: SpeechTask, prompt: tuple[dict, "TrailingRows"], generator: torch.Generator) -> Qwen3Talk:
        inputs, rows = prompt
        row = qwen3_talker.start(self.talker, inputs, generator, self.suppress)
        return Qwen3Talk(row, task, rows, self.config.talker_config.codec_eos_token_id)

    def step(self, batch_kv: BatchKV, seats: list[Seat]) -> None:
        qwen3_talker.step(self.talker, batch_kv, seats)

    def vocode(self, task: SpeechTask, codes: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        stacked = torch.stack(codes, dim=1).transpose(1, 2)            # [1, groups, codes]
        wav = self.token2wav.chunked_decode(stacked, chunk_size=CODE2WAV_CHUNK, left_context_size=CODE2WAV_LEFT_CONTEXT)
        return wav.reshape(-1).float().cpu()

    def vocoder(self, task: SpeechTask, on_piece: PieceSink) -> "StreamedCode2Wav":
        return StreamedCode2Wav(self.token2wav, on_piece)

    def _talker_inputs(self, task: SpeechTask) -> tuple[dict, "TrailingRows"]:
        """The talker's generate() prompt for one request, as transformers' ``generate`` builds it,
        and the rows it reads after it, one per step (:class:`TrailingRows`, waiting for a streamed
        reply's tokens as it needs them)."""
        dev, talker, cfg = self.device, self.talker, self.config
        embed = self.thinker_embed
        ids = torch.tensor(task.prompt_token_ids, dtype=torch.long, device=dev)
        n = ids.shape[0]
        # User turns: every token whose latest <|im_start|> opens a "user" turn (that one included).
        pos = torch.arange(n, device=dev)
        starts = torch.where(ids == cfg.im_start_token_id, pos, torch.full_like(pos, -1))
        latest = torch.cummax(starts, dim=0).values.clamp_min(0)
        user = ids[(latest + 1).clamp_max(n - 1)] == cfg.user_token_id
        media = torch.isin(ids, torch.tensor(self.media_token_ids, device=dev))
        parts = torch.empty(n, cfg.talker_config.text_config.hidden_size, device=dev, dtype=embed.dtype)
        text = ~media
        parts[text] = talker.text_projection(embed[ids[text]])
        if bool(media.any()):
            parts[media] = talker.hidden_projection(task.prompt_hidden.to(dev, embed.dtype)[media])
        user_embeds, user_ids = parts[user], ids[user]
        # The assistant turn: its header, pads, bos and the first reply token over the codec controls.
        header = int(torch.nonzero((ids[:-1] == cfg.im_start_token_id) & (ids[1:] == cfg.assistant_token_id))
                     .flatten()[-1])
        rows = TrailingRows(self, task, header)
        # The reply's last token was never fed back into the thinker, so transformers has no input
        # embedding of it and the talker's text stops one token short; so does ours.
        assistant = rows.assistant(4)
        special = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id], device=dev)
        tts_bos, tts_eos, tts_pad = talker.text_projection(embed[special]).chunk(3, dim=0)
        text_rows = torch.cat((assistant[:3], tts_pad.expand(4, -1), tts_bos, assistant[3:4]))
        tc = cfg.talker_config
        controls = torch.tensor([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id,
                                 self.speakers[task.params.voice]["speaker_id"], tc.codec_pad_id, tc.codec_bos_id],
                                device=dev)
        codec_rows = torch.cat((torch.zeros(3, text_rows.shape[1], device=dev, dtype=text_rows.dtype),
                                talker.get_input_embeddings()(controls)))
        rows.specials = (tts_eos, tts_pad)
        inputs_embeds = torch.cat((user_embeds, text_rows + codec_rows))[None]
        talker_ids = torch.cat((user_ids, torch.full((text_rows.shape[0],), cfg.tts_pad_token_id, device=dev)))[None]
        out = {"inputs_embeds": inputs_embeds, "trailing_text_hidden": rows.through(-1),
               "tts_pad_embed": tts_pad[None], "talker_input_ids": talker_ids,
               "attention_mask": torch.ones_like(talker_ids)}
        if task.image_grids:
            out["image_grid_thw"] = torch.tensor(task.image_grids, dtype=torch.long, device=dev)
        if task.audio_lengths:
            out["audio_feature_lengths"] = torch.tensor(task.audio_lengths, dtype=torch.long, device=dev)
        return out, rows


def load_qwen3_omni(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    max_batch_size: int = 4) -> GenerateSpeechEngine:
    """A speech engine for a Qwen3-Omni directory (its talker, code2wav and voices)."""
    from transformers import GenerationConfig, Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav, Qwen3OmniMoeTalkerForConditionalGeneration)
    root = Path(path)
    config = Qwen3OmniMoeConfig.from_pretrained(root)
    talker, code2wav, embed = load_talker(root, Qwen3OmniMoeTalkerForConditionalGeneration._from_config(
        config.talker_config), Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config), "code2wav.",
        dtype=dtype, device=device, talker_layout=fuse_experts)
    family = Qwen3OmniFamily(talker, code2wav, embed, load_voices(root, config.talker_config), config, device=device)
    gen = root / "generation_config.json"
    if gen.is_file():   # the thinker's stop tokens end the spoken text as generate() is told they do
        eos = GenerationConfig.from_pretrained(root).eos_token_id
        if eos is not None:
            family.thinker_eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
    return GenerateSpeechEngine(family, device=device, max_batch_size=max_batch_size)


class TrailingRows:
    """What Qwen3-Omni's talker reads after its prompt, one row per step, as transformers lays it out
    (``trailing_text_hidden``): the projected text of the assistant turn from its 5th token on, up
    to the reply's next-to-last token, then tts eos; rows after the reply's first stop token are tts
    pads (the one at it tts eos); past the end the talker reads tts pads by itself. Computed as the
    reply arrives: row ``j`` needs the reply up to two tokens past its own (to know it is not the
    last), or the reply's end."""

    def __init__(self, family: Qwen3OmniFamily, task: SpeechTask, header: int):
        self.family, self.task, self.header = family, task, header
        self.reply = task.reply()
        self.prompt = task.prompt_token_ids
        self.specials: tuple[torch.Tensor, torch.Tensor] | None = None   # tts eos, tts pad rows
        hidden = family.talker.config.text_config.hidden_size
        self._buffer = torch.empty(1, 64, hidden, device=family.device, dtype=family.thinker_embed.dtype)
        self._rows = 0

    def _token(self, index: int) -> int:
        """Token ``index`` of prompt + reply."""
        return self.prompt[index] if index < len(self.prompt) else self.reply.token_ids[index - len(self.prompt)]

    def _known(self, index: int) -> bool:
        """Whether prompt + reply has a token ``index`` (waiting for the reply as needed)."""
        return index < len(self.prompt) or self.reply.wait_tokens(index - len(self.prompt) + 1)

    def assistant(self, count: int) -> torch.Tensor:
        """The projected text of the assistant turn's first ``count`` tokens that are not the last."""
        ids = [self._token(self.header + i) for i in range(count) if self._known(self.header + i + 1)]
        family = self.family
        return family.talker.text_projection(family.thinker_embed[torch.tensor(ids, dtype=torch.long,
                                                                                device=family.device)])

    def _row(self, j: int) -> torch.Tensor | None:
        """Row ``j``, or None past the end."""
        tts_eos, tts_pad = self._specials()
        index = self.header + 4 + j
        if not self._known(index):   # the reply ended before: there is no such row
            return None
        if not self._known(index + 1):   # the reply's last token: never fed, the row is tts eos
            row = tts_eos[0]
        else:
            row = self.family.talker.text_projection(self.family.thinker_embed[self._token(index)][None])[0]
        stop = self._first_stop(j)
        if stop is not None and j > stop:
            return tts_pad[0]
        if stop is not None and j == stop:
            return tts_eos[0]
        return row

    def _specials(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.specials is None:
            raise RuntimeError("TrailingRows read before the prompt set its tts eos and pad rows")
        return self.specials

    @property
    def tts_pad(self) -> torch.Tensor:
        """The tts pad row [H]: what the talker reads past the end of the reply."""
        return self._specials()[1][0]

    def _first_stop(self, j: int) -> int | None:
        """The reply's first thinker stop token, if one is at or before index ``j`` (transformers
        compares that reply index with the row index)."""
        tokens = self.reply.token_ids
        for i, token in enumerate(tokens[:j + 1]):
            if token in self.family.thinker_eos:
                return i
        return None

    def through(self, step: int) -> torch.Tensor:
        """Rows 0 … ``step`` where they exist ([1, rows, H]; fewer once the reply ended), as a view."""
        while self._rows <= step:
            row = self._row(self._rows)
            if row is None:
                break
            if self._rows == self._buffer.shape[1]:
                self._buffer = torch.cat((self._buffer, torch.empty_like(self._buffer)), dim=1)
            self._buffer[0, self._rows] = row
            self._rows += 1
        return self._buffer[:, :self._rows]


class StreamedCode2Wav:
    """code2wav on the codes as they come: chunks of :data:`STREAM_FIRST_CODES`, then
    :data:`STREAM_CHUNK_CODES` codes, each decoded with :data:`CODE2WAV_LEFT_CONTEXT` codes of left
    context and cropped to its own samples (``Qwen3OmniMoeCode2Wav.chunked_decode``'s rule, with a
    fixed plan of smaller chunks: the same codes give the same pieces on any worker). The pieces
    add up to the one-shot's waveform to within float rounding: 25 codes of left context cover what
    code2wav reads before a code, and the tail it cannot compute without later codes is completed by
    the next piece."""

    def __init__(self, code2wav, on_piece: PieceSink):
        self.code2wav, self.on_piece = code2wav, on_piece
        self.codes: list[torch.Tensor] = []   # [1, groups] per code
        self.done = 0
        self.pieces = 0   # emitted so far (StreamingVocoder)

    def ready(self, count: int) -> bool:
        """Whether :meth:`feed` bringing the codes to ``count`` would vocode a piece."""
        return count - self.done >= (STREAM_FIRST_CODES if self.done == 0 else STREAM_CHUNK_CODES)

    def feed(self, codes: Sequence[torch.Tensor]) -> None:
        self.codes.extend(codes[len(self.codes):])
        size = STREAM_FIRST_CODES if self.done == 0 else STREAM_CHUNK_CODES
        if len(self.codes) - self.done >= size:
            self._emit(self.done + size, final=False)

    def finish(self) -> None:
        self._emit(len(self.codes), final=True)

    def _emit(self, end: int, final: bool) -> None:
        start = self.done
        piece = torch.zeros(0)
        if end > start:
            context = min(CODE2WAV_LEFT_CONTEXT, start)
            codes = torch.stack(self.codes[start - context:end], dim=1).transpose(1, 2)   # [1, groups, n]
            wav = self.code2wav(codes)
            hop = int(self.code2wav.total_upsample)
            # code2wav's output for n codes is n·hop less a fixed tail its last convolutions cannot
            # compute without later codes: that tail of the previous piece is computed here, from the
            # left context, so the pieces join without a gap (and add up to the one-shot's length).
            tail = (end - start + context) * hop - wav.shape[-1]
            first = context * hop - (tail if start else 0)
            piece = wav[..., max(0, first):]
        self.done = end
        self.pieces += 1
        self.on_piece(piece, len(self.codes), final)
