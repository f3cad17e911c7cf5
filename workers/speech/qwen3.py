"""Speech engine of the generate role for Qwen3-Omni: thinker tokens → talker codes → code2wav waveform.

Life of a request through this engine (the queue, the synthesis thread, cancellation, deadlines and
the per-request seeded random stream are :class:`~omnirelay.workers.speech.engine.GenerateSpeechEngine`'s;
only the synthesis differs)::

    add(SpeechTask: prompt ids (+ the thinker's states at media tokens), reply ids, SpeechParams)
        ──▶ waiting ──step(): the oldest live request──▶
    talker prompt, built exactly as transformers' ``Qwen3OmniMoeForConditionalGeneration.generate``
        builds it: every user turn (text tokens through ``text_projection`` of their thinker
        embeddings, media tokens through ``hidden_projection`` of the thinker's states at layer
        ``accept_hidden_layer``), then the assistant header + tts pads/bos + the first reply token
        over the codec control tokens and the speaker's codec id; the rest of the reply is read one
        token per codec step (``trailing_text_hidden``, closed by tts eos, then tts pads)
    ──▶ ``Qwen3OmniMoeTalkerForConditionalGeneration.generate`` (top-k 50, temperature 0.9, repetition
        penalty 1.05, the control range suppressed, EOS = codec eos): the first codebook per step,
        the code predictor fills the other ``num_code_groups - 1`` ──▶ ``Qwen3OmniMoeCode2Wav``
        ``chunked_decode`` (300 codes per chunk, 25 of left context) ──▶ SpeechOutput (24 kHz)

What the talker reads, for a prompt of ``n`` tokens and a reply ``t0 … t(m-1)``:

* token ids only, for text: the thinker's input embeddings at text tokens are rows of its
  embedding table, which this engine loads (one matrix); the thinker's states are not needed;
* ``prompt_hidden`` [n, H] at media tokens: prefill's capture of the thinker's layer
  ``accept_hidden_layer`` (the compact model captures that layer for Qwen3-Omni); other rows unused;
* ``reply_hidden``: unused (shape-checked only: decode sends it for every omni model).

Determinism: ``torch.manual_seed(seed)`` then the talker's sampling, as transformers' ``generate``
with a greedy thinker consumes the stream, so a request's codes equal transformers' for the same
seed (the tests check it). Streamed requests (``SpeechTask.stream``) are synthesised whole and sent
as one final piece (not yet incremental: a streamer sees only the first codebook, so running code2wav
per chunk needs the residual codes from a hook on the talker's forward).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable

import torch

from omnirelay.errors import BadRequest

from omnirelay.workers.speech.engine import GenerateSpeechEngine, SpeechChunk, SpeechTask, _change_speed, load_talker

log = logging.getLogger("omnirelay.worker.speech")

TALKER_SAMPLING = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9,
                   "repetition_penalty": 1.05}        # transformers' generate() defaults for the talker
CODE2WAV_CHUNK, CODE2WAV_LEFT_CONTEXT = 300, 25


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


class Qwen3SpeechEngine(GenerateSpeechEngine):
    def __init__(self, talker, code2wav, thinker_embed: torch.Tensor, speakers: dict, config, *,
                 device: str = "cpu", max_batch_size: int = 4):
        super().__init__(talker, code2wav, thinker_embed, speakers, config, device=device,
                         max_batch_size=max_batch_size)
        eos = config.thinker_config.text_config.eos_token_id
        self.thinker_eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    @staticmethod
    def _media_token_ids(thinker) -> tuple[int, int, int]:
        return thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        max_batch_size: int = 4) -> "Qwen3SpeechEngine":
        from transformers import GenerationConfig, Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCode2Wav, Qwen3OmniMoeTalkerForConditionalGeneration)
        root = Path(path)
        config = Qwen3OmniMoeConfig.from_pretrained(root)
        talker, code2wav, embed = load_talker(root, Qwen3OmniMoeTalkerForConditionalGeneration._from_config(
            config.talker_config), Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config), "code2wav.",
            dtype=dtype, device=device, talker_layout=fuse_experts)
        engine = cls(talker, code2wav, embed, load_voices(root, config.talker_config), config, device=device,
                     max_batch_size=max_batch_size)
        gen = root / "generation_config.json"
        if gen.is_file():   # the thinker's stop tokens end the spoken text as generate() is told they do
            eos = GenerationConfig.from_pretrained(root).eos_token_id
            if eos is not None:
                engine.thinker_eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
        return engine

    def add(self, task: SpeechTask) -> None:
        """Validate and queue ``task``: the base checks, and an assistant turn to speak in the prompt
        (the talker's prompt starts at its header)."""
        ids, cfg = task.prompt_token_ids, self.config
        if not any(a == cfg.im_start_token_id and b == cfg.assistant_token_id for a, b in zip(ids, ids[1:])):
            raise BadRequest("the prompt has no assistant turn for the talker to speak")
        super().add(task)

    # ------------------------------------------------------------------ synthesis

    @torch.inference_mode()
    def synthesize(self, task: SpeechTask) -> tuple[torch.Tensor, int]:
        inputs = self._talker_inputs(task)
        talker, cfg = self.talker, self.config.talker_config
        vocab = cfg.text_config.vocab_size
        suppress = [i for i in range(vocab - 1024, vocab) if i != cfg.codec_eos_token_id]
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(task.params.seed)
            result = talker.generate(**inputs, max_new_tokens=task.params.codes_for(len(task.reply_token_ids)),
                                     eos_token_id=cfg.codec_eos_token_id, suppress_tokens=suppress,
                                     output_hidden_states=True, return_dict_in_generate=True, **TALKER_SAMPLING)
        steps = [hid[-1] for hid in result.hidden_states if hid[-1] is not None]
        if not steps:
            return torch.zeros(0), 0
        codes = torch.stack(steps, dim=1).transpose(1, 2)            # [1, groups, codes]
        wav = self.token2wav.chunked_decode(codes, chunk_size=CODE2WAV_CHUNK, left_context_size=CODE2WAV_LEFT_CONTEXT)
        wav = wav.reshape(-1).float().cpu()
        if task.params.speed != 1.0:
            wav = _change_speed(wav, task.params.speed)
        return wav, int(codes.shape[-1])

    def synthesize_stream(self, task: SpeechTask, emit: Callable[[SpeechChunk], None],
                          cancelled: threading.Event | None = None) -> int:
        """Whole, then one final piece (see the module docstring)."""
        wav, codes = self.synthesize(task)
        emit(SpeechChunk(task.request_id, 0, wav, codes, True))
        return codes

    def _talker_inputs(self, task: SpeechTask) -> dict:
        """The talker's generate() inputs for one request, as transformers' ``generate`` builds them."""
        dev, talker, cfg = self.device, self.talker, self.config
        embed = self.thinker_embed
        ids = torch.tensor(task.prompt_token_ids, dtype=torch.long, device=dev)
        seq = torch.tensor(task.prompt_token_ids + task.reply_token_ids, dtype=torch.long, device=dev)
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
        header = torch.nonzero((ids[:-1] == cfg.im_start_token_id) & (ids[1:] == cfg.assistant_token_id)).flatten()
        # The reply's last token was never fed back into the thinker, so transformers has no input
        # embedding of it and the talker's text stops one token short; so does ours.
        assistant = talker.text_projection(embed[seq[int(header[-1]):-1]])
        special = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id], device=dev)
        tts_bos, tts_eos, tts_pad = talker.text_projection(embed[special]).chunk(3, dim=0)
        text_rows = torch.cat((assistant[:3], tts_pad.expand(4, -1), tts_bos, assistant[3:4]))
        tc = cfg.talker_config
        controls = torch.tensor([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id,
                                 self.speakers[task.params.voice]["speaker_id"], tc.codec_pad_id, tc.codec_bos_id],
                                device=dev)
        codec_rows = torch.cat((torch.zeros(3, text_rows.shape[1], device=dev, dtype=text_rows.dtype),
                                talker.get_input_embeddings()(controls)))
        trailing = torch.cat((assistant[4:], tts_eos))
        # The reply's first stop token: the text ends there (tts eos), pads after it.
        reply = torch.tensor(task.reply_token_ids, device=dev)
        is_eos = torch.isin(reply, torch.tensor(self.thinker_eos, device=dev))
        first = int(torch.nonzero(is_eos).flatten()[0]) if bool(is_eos.any()) else len(task.reply_token_ids)
        rows = torch.arange(trailing.shape[0], device=dev)[:, None]
        trailing = torch.where(rows > first, tts_pad, trailing)
        trailing = torch.where(rows == first, tts_eos, trailing)
        inputs_embeds = torch.cat((user_embeds, text_rows + codec_rows))[None]
        talker_ids = torch.cat((user_ids, torch.full((text_rows.shape[0],), cfg.tts_pad_token_id, device=dev)))[None]
        out = {"inputs_embeds": inputs_embeds, "trailing_text_hidden": trailing[None], "tts_pad_embed": tts_pad[None],
               "talker_input_ids": talker_ids, "attention_mask": torch.ones_like(talker_ids)}
        if task.image_grids:
            out["image_grid_thw"] = torch.tensor(task.image_grids, dtype=torch.long, device=dev)
        if task.audio_lengths:
            out["audio_feature_lengths"] = torch.tensor(task.audio_lengths, dtype=torch.long, device=dev)
        return out
