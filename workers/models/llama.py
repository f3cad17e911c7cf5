"""A compact Llama/Qwen2 causal LM that reads the Hugging Face directory directly.

Why our own: the decode engine keeps KV in a paged block pool and batches sequences of different
lengths in one step; transformers' modules assume one contiguous cache per batch. The math follows
transformers' Llama/Qwen2 (RMSNorm, rotary embedding with ``rotate_half``, grouped-query attention
through ``scaled_dot_product_attention``, SwiGLU MLP) so greedy output matches ``generate()`` on
the same directory; the tests check that token for token.

Two entry points, both without autograd:

* :meth:`LlamaModel.prefill` — one sequence, contiguous; returns the last position's logits and the
  whole KV as one tensor ``[layers, 2, seq, kv_heads, head_dim]`` (the connector payload).
* :meth:`LlamaModel.decode` — one new token for each of B sequences whose past KV lives in a
  :class:`~omnirelay.workers.kv_cache.PagedKVCache`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: Path) -> "LlamaConfig":
        raw = json.loads((path / "config.json").read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path}: architecture {arch} is not supported by the compact engine "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{path}: rope scaling {rope_type!r} is not supported by the compact engine")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        eos = _eos_ids(path, raw)
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama has them only with attention_bias.
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            eos_token_ids=eos)


def _eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    ids = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclasses.dataclass
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    def __init__(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32):
        self.path = Path(path)
        self.config = LlamaConfig.from_dir(self.path)
        self.dtype = dtype
        weights = _load_safetensors(self.path, dtype)
        cfg = self.config

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            if name not in weights and not required:
                return None
            return weights.pop(name)

        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            bias = cfg.attention_bias
            self.layers.append(_Layer(
                input_norm=take(pre + "input_layernorm.weight"),
                q=take(pre + "self_attn.q_proj.weight"), k=take(pre + "self_attn.k_proj.weight"),
                v=take(pre + "self_attn.v_proj.weight"),
                q_bias=take(pre + "self_attn.q_proj.bias", bias), k_bias=take(pre + "self_attn.k_proj.bias", bias),
                v_bias=take(pre + "self_attn.v_proj.bias", bias),
                o=take(pre + "self_attn.o_proj.weight"), post_norm=take(pre + "post_attention_layernorm.weight"),
                gate=take(pre + "mlp.gate_proj.weight"), up=take(pre + "mlp.up_proj.weight"),
                down=take(pre + "mlp.down_proj.weight")))
        self.norm = take("model.norm.weight")
        lm_head = weights.pop("lm_head.weight", None)
        self.lm_head = self.embed if (cfg.tie_word_embeddings or lm_head is None) else lm_head
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        self._inv_freq = inv

    # ------------------------------------------------------------------ helpers

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h: [T, hidden] → q [T, H, D], k/v [T, Hkv, D] with rotary applied to q and k."""
        cfg = self.config
        x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
        q = F.linear(x, layer.q, layer.q_bias).view(-1, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, layer.k, layer.k_bias).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, layer.v, layer.v_bias).view(-1, cfg.num_kv_heads, cfg.head_dim)
        c, s = cos[:, None, :], sin[:, None, :]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        return q, k, v

    def _finish_layer(self, layer: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        h = h + F.linear(attn, layer.o)
        x = _rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
        return h + F.linear(F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up), layer.down)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(h, self.norm, self.config.rms_norm_eps), self.lm_head).float()

    # ------------------------------------------------------------------ entry points

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], start_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one sequence from scratch. Returns (logits of the last position ``[vocab]``,
        kv ``[layers, 2, seq, kv_heads, head_dim]``)."""
        cfg = self.config
        ids = torch.tensor(token_ids, dtype=torch.long)
        positions = torch.arange(start_position, start_position + len(token_ids))
        cos, sin = self._rope(positions)
        h = self.embed[ids]
        kv = torch.empty(cfg.num_layers, 2, len(token_ids), cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype)
        groups = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            kv[i, 0], kv[i, 1] = k, v
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None].repeat_interleave(groups, 1),
                v.transpose(0, 1)[None].repeat_interleave(groups, 1), is_causal=True)
            h = self._finish_layer(layer, h, attn[0].transpose(0, 1).reshape(len(token_ids), -1))
        return self._logits(h[-1:])[0], kv

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, block_tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """One step for B sequences. ``input_ids``/``positions``: [B]; ``block_tables``: [B, max_blocks]
        (padded with any valid block id); ``context_lens``: [B] tokens in cache *including* the new
        one, whose KV this call writes at ``positions``. Returns logits [B, vocab]."""
        cfg = self.config
        batch = input_ids.shape[0]
        cos, sin = self._rope(positions)
        h = self.embed[input_ids]
        slots = cache.slots_for(block_tables, positions)
        span = block_tables.shape[1] * cache.block_size
        valid = torch.arange(span)[None, :] < context_lens[:, None]        # [B, span]
        mask = valid[:, None, None, :]                                     # [B, 1, 1, span]
        groups = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.write(i, slots, k, v)
            keys, values = cache.gather(i, block_tables)                   # [B, span, Hkv, D]
            keys = keys.permute(0, 2, 1, 3).repeat_interleave(groups, 1)
            values = values.permute(0, 2, 1, 3).repeat_interleave(groups, 1)
            attn = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask)
            h = self._finish_layer(layer, h, attn.reshape(batch, -1))
        return self._logits(h)


def _load_safetensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights found")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                weights[name] = handle.get_tensor(name).to(dtype)
    return weights
