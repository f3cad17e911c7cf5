"""The Qwen2.5-Omni speech family (a :class:`~omnirelay.workers.speech.family.SpeechFamily`): thinker
hidden states → talker codec ids → token2wav (DiT + BigVGAN) waveform.

What it does per request, in the engine's order (engine.py, family.py):

* ``prompt``: the talker's prompt, built exactly as transformers' ``Qwen2_5OmniForConditionalGeneration.generate``
  builds it (what it reads: engine.py's module docstring); waits for a streamed reply's first chunk;
* ``start``: the prompt forward (``qwen2_5_talker.start``) and the first code; a :class:`Qwen2_5Talk`
  then reads the rest of the reply one row per step (:meth:`Qwen2_5OmniFamily.reply_rows`) and stops
  at the codec pad/end or the reply's budget (``SpeechTask.codes_budget``);
* ``step``: the batched talker step (``qwen2_5_talker.step``, sampling as ``generate`` does);
* ``vocode``: token2wav on every code, its noise drawn from the request's generator where the talker
  left it (transformers draws it from the global stream there, seeded alike, so the same noise);
* ``vocoder``: :class:`~omnirelay.workers.speech.stream.ChunkedToken2Wav` for a streamed request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from omnirelay.errors import BadRequest

from omnirelay.workers.speech import qwen2_5_talker
from omnirelay.workers.speech.engine import GenerateSpeechEngine, SpeechTask
from omnirelay.workers.speech.family import PieceSink
from omnirelay.workers.speech.loading import load_speakers, load_talker
from omnirelay.workers.speech.reply_source import ReplySource
from omnirelay.workers.speech.step_batch import Seat
from omnirelay.workers.speech.stream import ChunkedToken2Wav, dit_sample
from omnirelay.workers.speech.talker_batch import BatchKV


class Qwen2_5Talk:
    """One request's Qwen2.5-Omni talker (family.py ``Talk``): its codes are ``int`` codec ids."""

    def __init__(self, row: qwen2_5_talker.Qwen2_5Row, task: SpeechTask, eos: tuple[int, int],
                 reply_row: Callable[[int], torch.Tensor]):
        self.row = row
        self.reply: ReplySource | None = task.reply()
        self._eos, self._reply_row, self._budget = eos, reply_row, task.codes_budget()

    def spoken(self) -> list[int]:
        return [] if self.row.last in self._eos else [self.row.last]

    def done(self) -> bool:
        return self.row.last in self._eos or self._budget(self.row.sampled)

    def prepare(self) -> None:
        self.row.reply_row = self._reply_row(self.row.sampled - 1)


class Qwen2_5OmniFamily:
    def __init__(self, talker, token2wav, thinker_embed: torch.Tensor, speakers: dict, config, *,
                 device: str = "cpu"):
        self.talker = talker
        self.token2wav = token2wav
        self.thinker_embed = thinker_embed
        self.speakers = speakers
        self.config = config
        self.device = torch.device(device)
        thinker = config.thinker_config   # Qwen2.5-Omni names its placeholder ids *_index
        self.media_token_ids = (thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index)

    @property
    def voices(self) -> list[str]:
        return sorted(self.speakers)

    def check(self, task: SpeechTask) -> None:
        check_omni_task(task, self.speakers, self.thinker_embed.shape[1])

    def prompt(self, task: SpeechTask) -> dict:
        """The talker's prompt for one request, built as transformers' ``generate`` builds it (the
        reply after its first token is read step by step: :meth:`reply_rows`)."""
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

    def start(self, task: SpeechTask, prompt: dict, generator: torch.Generator) -> Qwen2_5Talk:
        row = qwen2_5_talker.start(self.talker, prompt, generator)
        eos = (self.talker.codec_pad_token, self.talker.codec_eos_token)
        return Qwen2_5Talk(row, task, eos, self.reply_rows(task))

    def step(self, batch_kv: BatchKV, seats: list[Seat]) -> None:
        qwen2_5_talker.step(self.talker, batch_kv, seats)

    def reply_rows(self, task: SpeechTask) -> Callable[[int], torch.Tensor]:
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

    def _speaker(self, task: SpeechTask) -> tuple[torch.Tensor, torch.Tensor]:
        speaker = self.speakers[task.params.voice]
        cond = speaker["cond"].to(self.device).float().expand(1, -1)
        ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
        return cond, ref_mel

    def vocode(self, task: SpeechTask, codes: list[int], generator: torch.Generator) -> torch.Tensor:
        cond, ref_mel = self._speaker(task)
        code = torch.tensor([codes], dtype=torch.long, device=self.device)
        dit = self.token2wav.code2wav_dit_model
        # token2wav's noise: transformers draws it from the global stream after the talker's draws;
        # the request's generator is where that stream would be (seeded alike, drawn alike), so the
        # noise is the same without touching any process-global state.
        noise = torch.randn([1, code.shape[1] * dit.repeats, dit.mel_dim], dtype=ref_mel.dtype,
                            device=self.device, generator=generator)
        mel = dit_sample(dit, code, cond, ref_mel, noise)
        return self.token2wav.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()

    def vocoder(self, task: SpeechTask, on_piece: PieceSink) -> ChunkedToken2Wav:
        cond, ref_mel = self._speaker(task)
        return ChunkedToken2Wav(self.token2wav, cond, ref_mel, task.params.seed, on_piece)


def check_omni_task(task: SpeechTask, voices: dict, hidden: int) -> None:
    """The checks every omni family makes of a SpeechTask: a known voice, states of the right shapes."""
    if task.params.voice not in voices:
        raise BadRequest(f"voice {task.params.voice!r} is not one of this model's speakers: "
                         f"{', '.join(sorted(voices))}", param="voice")
    m = len(task.reply_token_ids)
    if task.reply_stream is not None:   # its reply arrives later: checked as it comes
        m = 2
    elif m < 2:
        raise BadRequest("the reply to speak has fewer than 2 tokens")
    if task.reply_stream is None and tuple(task.reply_hidden.shape) != (m - 1, hidden):
        raise BadRequest(f"reply hidden states are {tuple(task.reply_hidden.shape)}, expected {(m - 1, hidden)}")
    if tuple(task.prompt_hidden.shape) != (len(task.prompt_token_ids), hidden):
        raise BadRequest(f"prompt hidden states are {tuple(task.prompt_hidden.shape)}, "
                         f"expected {(len(task.prompt_token_ids), hidden)}")


def load_qwen2_5_omni(path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      max_batch_size: int = 4) -> GenerateSpeechEngine:
    """A speech engine for a Qwen2.5-Omni directory (its talker, token2wav and speaker table)."""
    from transformers import Qwen2_5OmniConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniTalkerForConditionalGeneration, Qwen2_5OmniToken2WavModel)
    root = Path(path)
    config = Qwen2_5OmniConfig.from_pretrained(root)
    talker, token2wav, embed = load_talker(root, Qwen2_5OmniTalkerForConditionalGeneration._from_config(
        config.talker_config), Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config), "token2wav.",
        dtype=dtype, device=device)
    family = Qwen2_5OmniFamily(talker, token2wav, embed, load_speakers(root), config, device=device)
    return GenerateSpeechEngine(family, device=device, max_batch_size=max_batch_size)
