"""Incremental token2wav for streamed speech: audio chunks while the talker is still speaking.

Life of a streamed request (``SpeechTask.stream``) inside the engine's synthesis thread::

    the talker's step loop (engine.py ``_talk``) ──each codec token spoken──▶
        ChunkedToken2Wav.feed(codes so far): for every chunk whose codes (and look-ahead) exist:
            DiT on a window of code blocks (left context ─ chunk ─ look-ahead) ──▶ the chunk's mel
            ──▶ BigVGAN on (left mel context ─ chunk mel ─ look-ahead mel), cropped to the chunk
            ──▶ on_chunk(waveform piece, codes produced so far, final=False)
    talker done (codec EOS or ``max_codes``) ──▶ finish(): the remaining blocks, no look-ahead

Why the window works: Qwen2.5-Omni's token2wav DiT attends block-wise (``block_size`` mel frames per
block): each layer listed in ``look_ahead_layers`` sees the next block, each in
``look_backward_layers`` the previous one, and none sees further. So one DiT pass over a chunk reads
at most ``len(look_backward_layers)`` blocks before it and ``len(look_ahead_layers)`` after it — the
window we give it. Windows start on block boundaries (the attention pattern is the one the model
was trained with), and the DiT's rotary positions only enter attention as differences, so a
window's own positions from 0 are as good as the utterance's.

How streamed audio differs from the one-shot (``synthesize``), and why:

* the codec tokens are the same: the talker samples from the request's seeded stream exactly as in
  the one-shot, and nothing else draws from that stream while it runs (the noise below has its own
  generator), so cancelling aside the talker says the same thing;
* the ODE's starting noise comes from a separate CPU generator seeded with the request's seed, one
  ``[block_size, mel_dim]`` draw per block in block order — a frame's noise is the same in every
  window that contains it and does not depend on how the blocks were grouped into chunks — instead
  of the one-shot's single draw from the talker's stream after the talker ends (which a stream,
  drawing before the talker ends, cannot reproduce);
* a one-shot DiT integrates the whole utterance: over the ODE's 36 evaluations a block's mel is
  influenced (weakly) by blocks far beyond one pass's reach; a window cuts that at its edges;
* BigVGAN sees ``vocoder_context_frames`` of real mel on the left (the previous chunks' final mel,
  as much as its convolutions reach, so the left edge matches a one-pass vocoding of that mel)
  and, on the right, the window's look-ahead mel, a draft of the next chunk's first frames (at
  most one block: a little short of BigVGAN's reach): the samples just before a chunk boundary
  are computed against that draft, which is where a faint seam can remain;
* ``speed`` != 1 resamples each piece on its own (lengths round per piece).

The chunks' samples still follow one deterministic plan (first chunk ``first_chunk_blocks`` blocks,
then ``chunk_blocks`` each, the rest at the end), so a request re-synthesised elsewhere with the
same seed and inputs yields the very same pieces, which is what lets the gateway resume a stream
by chunk index.

No thread here: everything runs on the request's synthesis thread between its talker steps; while
a chunk is vocoded the thread is away from the step batch, so the other requests' steps go on.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


class SynthesisCancelled(Exception):
    """Raised inside the talker's step loop to stop a cancelled request between codes."""


class ChunkedToken2Wav:
    """One request's incremental token2wav (see the module docstring). ``feed`` is called with the
    codes so far (each call may only extend them) and emits each chunk that became computable
    through ``on_chunk(waveform [samples] float32 on the CPU, codes_so_far, final)``."""

    def __init__(self, token2wav, cond: torch.Tensor, ref_mel: torch.Tensor, seed: int,
                 on_chunk: Callable[[torch.Tensor, int, bool], None], *, first_chunk_blocks: int = 1,
                 chunk_blocks: int = 4, vocoder_context_frames: int | None = None,
                 num_steps: int = 10, guidance_scale: float = 0.5, sway_coefficient: float = -1.0):
        dit = token2wav.code2wav_dit_model
        config = dit.config
        if config.block_size % config.repeats:
            raise ValueError(f"streamed token2wav needs block_size ({config.block_size}) to be a multiple of "
                             f"repeats ({config.repeats})")
        self.dit = dit
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.cond, self.ref_mel = cond, ref_mel
        self.on_chunk = on_chunk
        self.block = config.block_size                      # mel frames per block
        self.repeats = config.repeats                       # mel frames per codec token
        self.codes_per_block = self.block // self.repeats
        self.mel_dim = config.mel_dim
        self.back = len(config.look_backward_layers)        # blocks one DiT pass reads before a block
        self.ahead = len(config.look_ahead_layers)          # … and after it
        self.hop = math.prod(token2wav.config.bigvgan_config.upsample_rates)   # samples per mel frame
        self.first_chunk_blocks, self.chunk_blocks = first_chunk_blocks, chunk_blocks
        # Measured on this BigVGAN (upsampling 5·3·2·2·2·2, resblock kernels 3/7/11 × dilations 1/3/5):
        # one mel frame moves the output over ±27 frames. 32 frames of left context cover that; on
        # the right the window's look-ahead mel (len(look_ahead_layers) blocks) is all there is.
        self.context = 32 if vocoder_context_frames is None else vocoder_context_frames
        self.ode = dict(num_steps=num_steps, guidance_scale=guidance_scale, sway_coefficient=sway_coefficient)
        self._noise_gen = torch.Generator(device="cpu")
        self._noise_gen.manual_seed(seed)
        self._noise: list[torch.Tensor] = []                # per block, drawn in block order
        self._done_blocks = 0                               # blocks whose audio was emitted
        self._left_mel: torch.Tensor | None = None          # [1, mel_dim, ≤ context]: final mel before the next chunk
        self._codes: Sequence[int] = ()                   # every code so far (the engine's list)
        self.chunks = 0
        self.finished = False

    @property
    def pieces(self) -> int:
        """Pieces emitted so far (StreamingVocoder)."""
        return self.chunks

    def ready(self, count: int) -> bool:
        """Whether :meth:`feed` of ``count`` codes would vocode a piece (else it waits for more)."""
        size = self.first_chunk_blocks if self._done_blocks == 0 else self.chunk_blocks
        return not self.finished and count >= (self._done_blocks + size + self.ahead) * self.codes_per_block

    def feed(self, codes: Sequence[int]) -> None:
        """Every code so far (StreamingVocoder): vocodes each chunk whose codes and look-ahead exist."""
        self._codes = codes
        self._vocode(final=False)

    def finish(self) -> None:
        """The talker is done: the remaining blocks, no look-ahead, as the final piece."""
        self._vocode(final=True)

    def _vocode(self, final: bool) -> None:
        codes = self._codes
        while not self.finished:
            size = self.first_chunk_blocks if self._done_blocks == 0 else self.chunk_blocks
            end = self._done_blocks + size
            if len(codes) >= (end + self.ahead) * self.codes_per_block:
                self._emit(codes, end, self.ahead, len(codes), final=False)
            elif final:
                total_frames = len(codes) * self.repeats
                self._emit(codes, math.ceil(total_frames / self.block), 0, len(codes), final=True)
            else:
                return

    def _emit(self, codes: Sequence[int], end_block: int, ahead: int, produced: int, final: bool) -> None:
        start = self._done_blocks
        total_frames = len(codes) * self.repeats
        w0 = max(0, start - self.back) * self.block                 # window, in mel frames
        w1 = min((end_block + ahead) * self.block, total_frames)
        c1 = min(end_block * self.block, total_frames)              # the chunk is frames [start*block, c1)
        piece = torch.zeros(0)
        if c1 > start * self.block:
            device = self.cond.device
            window = torch.tensor([codes[w0 // self.repeats:w1 // self.repeats]], dtype=torch.long, device=device)
            mel = dit_sample(self.dit, window, self.cond, self.ref_mel,   # [1, mel_dim, w1 - w0]
                             self._noise_frames(w0, w1).to(device), **self.ode)
            new = mel[:, :, start * self.block - w0:c1 - w0]
            right = mel[:, :, c1 - w0:c1 - w0 + self.context]
            left = self._left_mel if self._left_mel is not None else new[:, :, :0]
            wav = self.vocoder(torch.cat([left, new, right], dim=2)).reshape(-1).float().cpu()
            piece = wav[left.shape[2] * self.hop:(left.shape[2] + new.shape[2]) * self.hop]
            self._left_mel = torch.cat([left, new], dim=2)[:, :, -self.context:] if self.context else None
        self._done_blocks = end_block
        self.finished = final
        self.chunks += 1
        self.on_chunk(piece, produced, final)

    def _noise_frames(self, f0: int, f1: int) -> torch.Tensor:
        """The ODE's starting noise for mel frames [f0, f1): [1, f1 - f0, mel_dim]."""
        while len(self._noise) * self.block < f1:
            self._noise.append(torch.randn(self.block, self.mel_dim, generator=self._noise_gen))
        first = f0 // self.block
        frames = torch.cat(self._noise[first:math.ceil(f1 / self.block)])
        return frames[f0 - first * self.block:f1 - first * self.block][None]


def dit_sample(dit, codes: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor, noise: torch.Tensor, *,
               num_steps: int = 10, guidance_scale: float = 0.5, sway_coefficient: float | None = -1.0
               ) -> torch.Tensor:
    """transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` with the starting ``noise`` [1, frames,
    mel_dim] given instead of drawn from the global stream (same ODE: Runge-Kutta over sway-warped
    time points, classifier-free guidance): the mel [1, mel_dim, frames] of ``codes`` [1, n]."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver
    frames = codes.shape[1] * dit.repeats
    if frames > dit.config.max_position_embeddings:
        raise ValueError(f"a token2wav window of {frames} mel frames exceeds the DiT's "
                         f"max_position_embeddings ({dit.config.max_position_embeddings})")
    cond = cond.unsqueeze(1).repeat(1, frames, 1)

    def ode_function(time_step, hidden_states):
        if guidance_scale < 1e-5:
            return dit(hidden_states=hidden_states, speaker_embedding=cond, condition_vector=ref_mel,
                       quantized_code=codes, time_step=time_step, drop_audio_conditioning=False,
                       drop_code=False, apply_cfg=False)
        output = dit(hidden_states=hidden_states, quantized_code=codes, speaker_embedding=cond,
                     condition_vector=ref_mel, time_step=time_step, apply_cfg=True)
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=codes.device, dtype=cond.dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    solution = RungeKutta4ODESolver(function=ode_function, initial_value=noise.to(cond.dtype)).integrate(times)
    return solution[-1].permute(0, 2, 1)
