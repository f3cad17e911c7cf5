"""A compact Llama/Qwen2/Qwen3/Qwen3-MoE causal LM that reads the Hugging Face directory directly.

Why our own: the engines keep KV in a paged block pool and batch sequences of different lengths
(and prompt chunks next to decode tokens) in one pass; transformers' modules assume one contiguous
cache per batch. The math follows transformers' Llama/Qwen2 (RMSNorm, rotary embedding with
``rotate_half``, grouped-query attention through ``scaled_dot_product_attention``, SwiGLU MLP) so
greedy output matches ``generate()`` on the same directory; the tests check that token for token.

Life of a forward pass (:meth:`LlamaModel.forward`, one per engine step): the engine packs the
step into a :class:`~omnirelay.workers.llm.forward_batch.ForwardBatch` → embed (first pipeline stage)
→ per layer: RMSNorm, one fused QKV matmul, rotary on q and k together, K/V written into their
cache slots, attention (decode: one gather of the batch's blocks, GQA without repeating K/V;
prefill: per sequence, causal over its own keys, or over prefix + new keys from the pool when part
of the prompt was cached or computed by an earlier chunk), o_proj (+ all-reduce under TP), fused
gate/up matmul, down (+ all-reduce) → final norm and logits of each sequence's last new token
(last pipeline stage; other stages return the hidden states for the next one).

Sharding (:class:`Shard`): under tensor parallelism a rank holds its slice of the query and KV
heads and of the MLP's intermediate columns, and its KV cache holds only its KV heads; o_proj and
down_proj are row-parallel and their partial outputs are summed with ``comm.all_reduce``. Under
pipeline parallelism a rank holds a contiguous range of layers. Embedding and lm_head are
replicated (they are small next to the layers for the models we serve on CPU).

Device: the model lives on one device (``device``: the CPU, or the rank's ``cuda:<id>``); weights
are read from safetensors and moved there once, the rotary tables are built there, and a batch must
already be there (the runner moves it). The native decode kernel and oneDNN weight packing are
CPU-only and are off on any other device; logits come back on the model's device.

Qwen3 (``Qwen3ForCausalLM``): the same layer plus a per-head RMSNorm of q and k (``q_norm``,
``k_norm`` over ``head_dim``, before rotary) and an explicit ``head_dim``; no q/k/v biases.
Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, and in its sparse layers the MLP is a routed
mixture of experts (:mod:`.moe`: router, top-k, batched experts; under tensor parallelism either
every expert's intermediate slice per rank or, with ``Shard.expert_parallel``, whole experts per
rank reached by all-to-all, :mod:`omnirelay.workers.llm.expert_parallel`). Sliding-window attention
(``use_sliding_window``) is refused at load.

Qwen2.5-Omni: the thinker's language model is this same Qwen2 (weights under ``thinker.model.*`` and
``thinker.lm_head``; its encoders, talker and vocoder are not loaded here). Two optional batch
fields carry what differs (:class:`~omnirelay.workers.llm.forward_batch.ForwardBatch`): ``embeds``
replaces the token embeddings at media placeholder rows right after the embedding lookup (so ``h``
there is the prompt's merged input embedding), and ``rope_positions`` gives 3-row M-RoPE positions
(each rotary column takes the axis of its ``mrope_section``) or, in decode, index + rope delta.
Without them a batch runs exactly the text path.

Qwen3-Omni: the thinker's language model is a Qwen3-MoE under the same ``thinker.`` prefix, with
two differences: its M-RoPE interleaves the axes (height on rotary columns 1, 4, 7, .., width on
2, 5, 8, .., temporal on the rest, instead of three contiguous sections), and DeepStack: the batch's
``deepstack`` field carries the vision encoder's extra features, which are added to the image
tokens' hidden states after the first decoder layers (feature ``i`` after layer ``i``). Its talker
reads the thinker's states at layer ``accept_hidden_layer`` (``LlamaConfig.capture_layer``), so for
it a :class:`HiddenCapture` keeps that layer's output instead of the final-norm states.

:meth:`LlamaModel.prefill` is the cache-free convenience path (one sequence → logits and the whole
KV as ``[layers, 2, seq, kv_heads, head_dim]``) kept for callers that want contiguous KV.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from omnirelay.workers.runtime.load_progress import LoadProgress

from omnirelay.workers.llm import lora as lora_terms
from omnirelay.workers.llm import native_attention
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.llm.expert_parallel import check_expert_parallel
from omnirelay.workers.llm.models.moe import MoeConfig, SparseMoE, load_moe
from omnirelay.workers.llm.prompt_logprobs import PromptCapture
from omnirelay.workers.llm import quantization as quantized_weights
from omnirelay.workers.llm.quantization import Int8Linear, WeightQuant

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Per-head q/k RMSNorm before rotary (Qwen3 and Qwen3-MoE).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Qwen2.5-Omni: the thinker's language model is a Qwen2 with M-RoPE, stored under "thinker.".
OMNI_ARCHITECTURES = ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniThinkerForConditionalGeneration")
# Qwen3-Omni: the thinker's language model is a Qwen3-MoE with interleaved M-RoPE and DeepStack.
QWEN3_OMNI_ARCHITECTURES = ("Qwen3OmniMoeForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration")


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
    weight_prefix: str = ""              # "thinker." for Qwen2.5-Omni checkpoints
    mrope_section: tuple[int, ...] = ()  # M-RoPE sections over head_dim / 2 (temporal, height, width)
    mrope_interleaved: bool = False      # Qwen3-Omni: H and W take every third rotary column (see _mrope_axis)
    # Speech capture (:class:`HiddenCapture`): 0 keeps the final-norm states (Qwen2.5-Omni's
    # talker reads those); k > 0 the output of decoder layer k - 1 (Qwen3-Omni's accept_hidden_layer).
    capture_layer: int = 0
    qk_norm: bool = False                # Qwen3: RMSNorm of each q and k head before rotary
    moe: MoeConfig | None = None         # Qwen3-MoE: the experts of the sparse layers
    weight_quant: WeightQuant | None = None   # how a quantized checkpoint stores its linear weights

    @classmethod
    def from_dir(cls, path: Path) -> "LlamaConfig":
        raw = json.loads((path / "config.json").read_text())
        weight_quant = quantized_weights.checkpoint_quantization(path, raw)   # refuses what is not served
        arch = (raw.get("architectures") or ["?"])[0]
        prefix, mrope, interleaved, capture = "", (), False, 0
        if arch in OMNI_ARCHITECTURES or arch in QWEN3_OMNI_ARCHITECTURES:
            thinker = raw.get("thinker_config", raw)
            text = thinker["text_config"]
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            mrope = tuple(rope.get("mrope_section") or ())
            prefix = "thinker." if "thinker_config" in raw else ""
            # Qwen3-Omni's thinker is a Qwen3-MoE (a dense Qwen3 without experts) whose rotary
            # embedding always interleaves the M-RoPE axes (transformers' recomposition_frequencies).
            interleaved = arch in QWEN3_OMNI_ARCHITECTURES
            if interleaved and "talker_config" in raw:
                capture = int(raw["talker_config"].get("accept_hidden_layer", 0))
            text_arch = "Qwen2ForCausalLM"
            if interleaved:
                text_arch = "Qwen3MoeForCausalLM" if text.get("num_experts") else "Qwen3ForCausalLM"
            raw = {**text, "architectures": [text_arch],
                   "eos_token_id": thinker.get("eos_token_id", text.get("eos_token_id"))}
            arch = text_arch
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path}: architecture {arch} is not supported by the compact engine "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{path}: sliding-window attention is not supported by the compact engine")
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
            eos_token_ids=eos, weight_prefix=prefix, mrope_section=mrope, mrope_interleaved=interleaved,
            capture_layer=capture,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            moe=MoeConfig.from_raw(raw) if arch == "Qwen3MoeForCausalLM" else None, weight_quant=weight_quant)


def _eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    ids = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)



@dataclasses.dataclass
class HiddenCapture:
    """Speech output: a forward given one leaves here the thinker states of every token it ran,
    on the host, ``[T, hidden]`` in packed order: the final-norm states (Qwen2.5-Omni's talker reads
    those) or, when the config names a ``capture_layer``, that decoder layer's output (Qwen3-Omni)."""

    states: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Shard:
    """The part of the model one rank holds. ``last_layer`` is exclusive; None means the end.
    ``expert_parallel``: the MoE blocks place whole experts on the tensor ranks (contiguous blocks,
    :func:`~omnirelay.workers.llm.expert_parallel.expert_range`) instead of slicing every expert."""

    tp_rank: int = 0
    tp_size: int = 1
    first_layer: int = 0
    last_layer: int | None = None
    expert_parallel: bool = False

    def layer_range(self, num_layers: int) -> range:
        return range(self.first_layer, num_layers if self.last_layer is None else self.last_layer)


class Collective(Protocol):
    """Sums a tensor in place across the tensor-parallel ranks (gloo on CPU, NCCL on GPU), or takes
    its element-wise maximum (the per-token activation scales of a row-parallel int8 linear). Under
    expert parallelism it must also be an
    :class:`~omnirelay.workers.llm.expert_parallel.ExpertCollective` (``all_to_all``)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_reduce_max(self, tensor: torch.Tensor) -> None: ...


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused kernel; bitwise equal to the float32 formula below on the CPU build.
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of ``x [T, heads, D]`` with ``weight [heads, D]``: transformers'
    Qwen3 RMSNorm formula (float32 statistics, weight applied in the input dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Linear:
    """``x @ weight.T + bias`` where ``weight`` is the row-wise concatenation of ``parts`` (q, k, v;
    gate, up; or one matrix). Three ways to hold it, chosen per model (``LlamaModel(kernels=...)``):

    * ``packed``: the parts concatenated and reordered once into oneDNN's blocked layout. On CPU
      that runs 1.3-1.6x faster than ``F.linear`` in float32 at decode batch sizes (M=16) and
      ~1.25x at prefill sizes (M=256); in bfloat16, where ``F.linear`` reorders the weight on every
      call, 2-3x at decode sizes and ~1.1x at prefill sizes (BENCHMARKS.md, decode profile). A
      private copy of the weight.
    * ``mapped``: each part used in place (one ``F.linear`` a part, outputs side by side), so a part
      that is a view of the checkpoint's memory map stays a page of the file, shared by every
      process of the host that maps it: the weights cost this process no private memory.
    * neither: the parts concatenated once (one ``F.linear``).

    Results differ between them only by summation order (bf16 products are accumulated in float32
    either way)."""

    def __init__(self, parts: list[torch.Tensor], bias: torch.Tensor | None, packed: bool, mapped: bool = False,
                 scratch: "_Scratch | None" = None):
        self.bias = bias
        self.packed = packed
        self.parts = parts if mapped and not packed and len(parts) > 1 else None
        if packed:
            # Fused in a reused scratch buffer, then packed: a fresh concatenation per layer, freed
            # right after packing, left ~200 MB of freed heap behind at the 0.5B geometry.
            weight = parts[0] if len(parts) == 1 else (scratch or _Scratch()).concat(parts)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT[weight.dtype])
        else:
            self.weight = parts[0] if len(parts) == 1 or self.parts is not None else torch.cat(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.parts is not None:
            out = torch.cat([F.linear(x, part) for part in self.parts], dim=-1)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class _Scratch:
    """One buffer, grown as needed, that the weights to be packed are concatenated into while a model
    loads (the packed copy is what stays)."""

    def __init__(self):
        self._buffer = torch.empty(0)

    def concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        rows = sum(p.shape[0] for p in parts)
        need = rows * parts[0].shape[1]
        if self._buffer.numel() < need or self._buffer.dtype != parts[0].dtype or self._buffer.device != parts[0].device:
            self._buffer = torch.empty(need, dtype=parts[0].dtype, device=parts[0].device)
        return torch.cat(parts, out=self._buffer[:need].view(rows, parts[0].shape[1]))


# Linear weights packed for oneDNN in these dtypes (bfloat16 only where the CPU has native bf16
# dot products: AVX512-BF16 or AMX; elsewhere oneDNN would emulate them), each with the batch-size
# hint its blocked layout is chosen for. Measured on 24 distinct 9,728 x 896 weights (read from
# memory, not cache; AVX512-BF16, one thread): bf16 with hint 1 runs 1.9-3x faster than hint 16 at
# every M from 1 to 256 (M=8: 15.6 vs 34 ms; M=256: 265 vs 790 ms); float32 keeps 16.
PACK_HINT = {torch.float32: 16, torch.bfloat16: 1}
PACKED_DTYPES = tuple(PACK_HINT)


def _can_pack(dtype: torch.dtype) -> bool:
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:   # internal ops (the ones inductor's CPU freezing uses): probe before trusting them
        probe = _Linear([torch.ones(2, 2, dtype=dtype)], None, True)
        return torch.equal(probe(torch.ones(1, 2, dtype=dtype)), torch.full((1, 2), 2.0, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False


@dataclasses.dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: "_Linear | Int8Linear"   # [q; k; v] rows of this rank's heads (+ biases), one matmul instead of three
    o: "_Linear | Int8Linear"     # this rank's input columns (row-parallel); a bias only on rank 0, so the
    #                       all-reduce counts it once
    post_norm: torch.Tensor
    gate_up: "_Linear | Int8Linear | None"   # [gate; up] rows of this rank's intermediate slice (dense MLP layers)
    down: "_Linear | Int8Linear | None"      # this rank's input columns (row-parallel)
    moe: SparseMoE | None = None           # instead of gate_up/down in a Qwen3-MoE sparse layer
    qk_norm: torch.Tensor | None = None    # [q heads + kv heads, head_dim]: q_norm rows, then k_norm
    lora: dict | None = None               # fused linear → (A, B) slot stacks (:class:`~omnirelay.workers.llm.lora.LoraSlots`)


class _Weights:
    """Reads tensors (or one rank's slice of them) from the directory's safetensors files. A weight
    a quantized checkpoint stores as integers or FP8 (``quant``) reads as its float value (dequantized:
    what every reader gets unless it asks :meth:`get_int8` for the integers themselves)."""

    def __init__(self, path: Path, dtype: torch.dtype, prefix: str = "", device: torch.device = torch.device("cpu"),
                 quant: WeightQuant | None = None):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights found")
        self.dtype = dtype
        self.device = device
        self.quant = quant
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        # ``prefix``: only the tensors under it, named without it (an omni checkpoint's
        # "thinker.model.layers.0..." reads as "model.layers.0..."; its encoders, talker and
        # vocoder are not ours to load).
        self._where = {name[len(prefix):]: (h, name) for h in self._handles for name in h.keys()
                       if name.startswith(prefix) and (not prefix or name[len(prefix):].startswith(("model.", "lm_head.")))}
        self.progress = LoadProgress(f"loading {path.name}", len(self._where))

    def has(self, name: str) -> bool:
        return name in self._where or self._stored_quantized(name)

    def _stored_quantized(self, name: str) -> bool:
        return (self.quant is not None and name.endswith(".weight")
                and name[: -len("weight")] + "weight_scale" in self._where)

    def _read(self, name: str, dim: int | None = None, rank: int = 0, parts: int = 1) -> torch.Tensor:
        """The stored tensor (or its slice ``rank`` of ``parts`` along ``dim``) in the file's dtype."""
        self.progress.advance()
        handle, name = self._where[name]
        if dim is None or parts == 1:
            return handle.get_tensor(name)
        sl = handle.get_slice(name)
        size = sl.get_shape()[dim] // parts
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(rank * size, (rank + 1) * size)
        return sl[tuple(index)]

    def get(self, name: str, dim: int | None = None, rank: int = 0, parts: int = 1) -> torch.Tensor:
        if self._stored_quantized(name):
            assert self.quant is not None
            whole = quantized_weights.dequantize(self._read, name, self.quant, self.dtype)
            return _slice(whole, dim, rank, parts).to(self.device).contiguous()
        return self._read(name, dim, rank, parts).to(self.device, self.dtype).contiguous()

    def get_int8(self, name: str, dim: int, rank: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight ``name`` (or its slice) as int8 values [N, K] and one float32 scale per row: as
        a W8A8 checkpoint stores them, else quantized now from the file's own precision."""
        if self._stored_quantized(name):
            scale = self._read(name[: -len("weight")] + "weight_scale").float().reshape(-1)
            if dim == 0:
                scale = _slice(scale, 0, rank, parts)
            return self._read(name, dim, rank, parts).contiguous(), scale.contiguous()
        return quantized_weights.quantize_per_channel(self._read(name, dim, rank, parts))


def _slice(tensor: torch.Tensor, dim: int | None, rank: int, parts: int) -> torch.Tensor:
    if dim is None or parts == 1:
        return tensor
    return tensor.chunk(parts, dim=dim)[rank]


class LlamaModel:
    def __init__(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32, *,
                 shard: Shard = Shard(), comm: Collective | None = None, attention: str = "auto",
                 kernels: str = "auto", device: torch.device | str = "cpu", quantization: str | None = None):
        """``attention``: ``"auto"`` reads decode KV in place with the native kernel where it
        builds (float32 or bfloat16 on the CPU), else ``"torch"`` (gather + SDPA). ``kernels``:
        ``"auto"`` packs the linear weights for oneDNN where available (float32, and bfloat16 on a CPU
        with native bf16, on the CPU; a private copy of the weights), ``"torch"`` keeps ``F.linear``
        over fused copies, ``"mapped"`` runs ``F.linear`` on the checkpoint's tensors in place where
        the dtype matches the file's (no fusion, no packing: the weights stay shared pages of the
        safetensors memory map, so a second process of the host serving the same directory costs
        no second copy; the prefill role's choice, see role_builders.model_runner). ``device``: where weights, rotary tables and activations live.
        ``quantization``: ``--quantization`` (None: as the checkpoint stores its weights; ``"int8"``
        quantizes a float checkpoint's linear weights at load); int8 linears run int8 kernels,
        fbgemm-packed, or in place where ``kernels`` is ``"mapped"`` (workers/llm/quantization.py)."""
        if attention not in ("auto", "torch") or kernels not in ("auto", "torch", "mapped"):
            raise ValueError(f"attention must be 'auto' or 'torch' and kernels 'auto', 'torch' or 'mapped', "
                             f"got {attention!r}, {kernels!r}")
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        self._packed = kernels == "auto" and on_cpu and _can_pack(dtype)
        self._mapped = kernels == "mapped"
        self.path = Path(path)
        self.config = cfg = LlamaConfig.from_dir(self.path)
        self.quantization = quantized_weights.resolve(self.path, cfg.weight_quant, quantization, self.device)
        if self.quantization is not None:
            log.info("%s: linear weights %s", self.path.name, self.quantization.describe())
        self.dtype = dtype
        self.shard = shard
        self.comm = comm
        tp, rank = shard.tp_size, shard.tp_rank
        if cfg.num_heads % tp or cfg.num_kv_heads % tp or cfg.intermediate_size % tp:
            raise ValueError(f"tensor parallel size {tp} must divide the heads ({cfg.num_heads}), KV heads "
                             f"({cfg.num_kv_heads}) and intermediate size ({cfg.intermediate_size})")
        if tp > 1 and comm is None:
            raise ValueError("tensor parallelism needs a collective for the all-reduce")
        if shard.expert_parallel:   # refused before any weight is read
            check_expert_parallel(cfg.moe, tp)
        self.layer_ids = shard.layer_range(cfg.num_layers)
        if not 0 <= self.layer_ids.start < self.layer_ids.stop <= cfg.num_layers:
            raise ValueError(f"layer range {self.layer_ids} outside the model's {cfg.num_layers} layers")
        self.num_heads = cfg.num_heads // tp          # on this rank
        self.num_kv_heads = cfg.num_kv_heads // tp    # on this rank: what its KV cache holds
        self.first_stage = self.layer_ids.start == 0
        self.last_stage = self.layer_ids.stop == cfg.num_layers
        w = _Weights(self.path, dtype, cfg.weight_prefix, self.device, cfg.weight_quant)
        self._scratch = _Scratch() if self._packed else None
        self.embed = w.get("model.embed_tokens.weight") if self.first_stage else None
        self.layers = [self._load_layer(w, i, rank, tp) for i in self.layer_ids]
        self.norm = self.lm_head = None
        if self.last_stage:
            self.norm = w.get("model.norm.weight")
            untied = w.has("lm_head.weight") and not cfg.tie_word_embeddings
            if untied:
                head = w.get("lm_head.weight")
            else:   # tied: one tensor for both ends where this rank holds both
                head = self.embed if self.embed is not None else w.get("model.embed_tokens.weight")
            self.lm_head = _Linear([head], None, self._packed)
        self._scratch = None
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        # One table for every position: a step indexes it instead of recomputing cos/sin. Same
        # float32 products as transformers' rotary embedding, so the values are identical.
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.device, dtype), emb.sin().to(self.device, dtype)
        # M-RoPE: rotary column c takes its angle from position axis _mrope_axis[c] (0 temporal,
        # 1 height, 2 width), the sections repeating over both halves as transformers lays them out.
        # Interleaved (Qwen3-Omni): column c is height for c = 1, 4, .. < 3 * sections[1], width
        # for c = 2, 5, .. < 3 * sections[2], temporal otherwise.
        self._mrope_axis = None
        if cfg.mrope_section and cfg.mrope_interleaved:
            axis = torch.zeros(cfg.head_dim // 2, dtype=torch.long)
            axis[1: 3 * cfg.mrope_section[1]: 3] = 1
            axis[2: 3 * cfg.mrope_section[2]: 3] = 2
            self._mrope_axis = torch.cat((axis, axis)).to(self.device)
        elif cfg.mrope_section:
            axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(cfg.mrope_section)])
            self._mrope_axis = torch.cat((axis, axis)).to(self.device)
        native = attention == "auto" and dtype in native_attention.DTYPES and on_cpu
        self._native = native_attention.load() if native else None
        self._scale = cfg.head_dim ** -0.5
        # LoRA (off unless a LoraSlots attaches itself): the step's adapter segments, set per forward.
        self.lora = None
        self._lora_groups: list = []

    def _load_layer(self, w: _Weights, i: int, rank: int, tp: int) -> _Layer:
        pre = f"model.layers.{i}."
        att = pre + "self_attn."
        names = [att + "q_proj", att + "k_proj", att + "v_proj"]
        bias = None
        if w.has(att + "q_proj.bias"):
            bias = torch.cat([w.get(n + ".bias", 0, rank, tp) for n in names])
        o_bias = w.get(att + "o_proj.bias") if w.has(att + "o_proj.bias") and rank == 0 else None
        mlp = pre + "mlp."
        qk_norm = None
        if self.config.qk_norm:   # one weight row per head this rank holds: q heads, then KV heads
            qk_norm = torch.cat((w.get(att + "q_norm.weight").expand(self.num_heads, -1),
                                 w.get(att + "k_norm.weight").expand(self.num_kv_heads, -1)))
        moe = self.config.moe
        if moe is not None and moe.is_sparse(i):
            block = load_moe(w, mlp, moe, rank=rank, size=tp, expert_parallel=self.shard.expert_parallel,
                             comm=self.comm)
            gate_up = down = None
        else:
            block = None
            gate_up = self._linear(w, [mlp + "gate_proj", mlp + "up_proj"], 0, rank, tp, None)
            down = self._linear(w, [mlp + "down_proj"], 1, rank, tp, None)
        return _Layer(
            input_norm=w.get(pre + "input_layernorm.weight"), qkv=self._linear(w, names, 0, rank, tp, bias),
            o=self._linear(w, [att + "o_proj"], 1, rank, tp, o_bias),
            post_norm=w.get(pre + "post_attention_layernorm.weight"),
            gate_up=gate_up, down=down, moe=block, qk_norm=qk_norm)

    def _linear(self, w: _Weights, modules: list[str], dim: int, rank: int, tp: int,
                bias: torch.Tensor | None) -> "_Linear | Int8Linear":
        """One linear over the row-wise concatenation of ``modules``' weights (this rank's slice along
        ``dim``: 0 column-parallel, 1 row-parallel): int8 where the model runs W8A8, else float."""
        names = [m + ".weight" for m in modules]
        if self.quantization is not None and self.quantization.mode == "int8":
            # A row-parallel rank sees a slice of each activation row: the ranks agree on the row's
            # scale (a max all-reduce of T floats), so their int32 partial sums add up to exactly
            # what one process computes and TP answers as TP1 does.
            agree = self.comm.all_reduce_max if dim == 1 and tp > 1 and self.comm is not None else None
            return Int8Linear([w.get_int8(name, dim, rank, tp) for name in names], bias, packed=not self._mapped,
                              agree_on_scale=agree)
        return _Linear([w.get(name, dim, rank, tp) for name in names], bias, self._packed, self._mapped,
                       self._scratch if len(names) > 1 else None)

    # ------------------------------------------------------------------ one layer

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [T, hidden] → q [T, H, D], k and v [T, Hkv, D], rotary applied to q and k at once."""
        cfg = self.config
        t, d = h.shape[0], cfg.head_dim
        x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
        qkv = layer.qkv(x)
        if self._lora_groups:
            qkv = lora_terms.apply(layer, "qkv", x, qkv, self._lora_groups)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : heads * d].view(t, heads, d)
        if layer.qk_norm is not None:
            qk = _head_norm(qk, layer.qk_norm, cfg.rms_norm_eps)
        qk = qk * cos + _rotate_half(qk) * sin
        v = qkv[:, heads * d:].view(t, self.num_kv_heads, d)
        return qk[:, : self.num_heads], qk[:, self.num_heads:], v

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm is not None and self.shard.tp_size > 1:
            self.comm.all_reduce(x)
        return x

    def _finish_layer(self, layer: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        groups = self._lora_groups
        o = layer.o(attn)
        if groups:
            o = lora_terms.apply(layer, "o", attn, o, groups)
        h = h + self._reduce(o)
        x = _rms_norm(h, layer.post_norm, self.config.rms_norm_eps)
        if layer.moe is not None:
            return h + layer.moe(x)   # the block reduces (TP) or combines (EP) by itself
        gate_up = layer.gate_up(x)
        if groups:
            gate_up = lora_terms.apply(layer, "gate_up", x, gate_up, groups)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = layer.down(act)
        if groups:
            down = lora_terms.apply(layer, "down", act, down, groups)
        return h + self._reduce(down)

    def _decode_attention(self, q, index, cache, batch: ForwardBatch) -> torch.Tensor:
        """q [B, H, D] against each sequence's cached keys (including the one just written)."""
        if self._native is not None:
            return self._native(q, cache.keys[index], cache.values[index], batch.block_tables,
                                batch.context_lens, self._scale)
        flat_tables, mask = batch.decode_plan()
        b = q.shape[0]
        keys, values = cache.gather(index, flat_tables, b)                # [B, span, Hkv, D]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        return out.reshape(b, -1)

    def _prefill_attention(self, q, k, v, index, cache, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads * self.config.head_dim, dtype=q.dtype, device=q.device)
        for start, end, blocks, mask in batch.prefill_plan():
            qs = q[start:end].transpose(0, 1)[None]
            if blocks is None:
                ks, vs = k[start:end], v[start:end]
                causal = True
            else:   # prefix from the pool: keys of earlier chunks or of a prefix-cache hit
                ctx = mask.shape[1]
                ks, vs = cache.gather(index, blocks, 1)
                ks, vs = ks[0, :ctx], vs[0, :ctx]
                causal = False
            att = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                                 attn_mask=mask, is_causal=causal, enable_gqa=True)
            out[start:end] = att[0].transpose(0, 1).reshape(end - start, -1)
        return out

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for positions ``[T]`` or M-RoPE positions ``[3, T]``."""
        if positions.dim() == 1:
            return self._cos.index_select(0, positions)[:, None, :], self._sin.index_select(0, positions)[:, None, :]
        per_col = positions.index_select(0, self._mrope_axis).T            # [T, head_dim]
        cols = torch.arange(per_col.shape[1], device=per_col.device)
        return self._cos[per_col, cols][:, None, :], self._sin[per_col, cols][:, None, :]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms_norm(h, self.norm, self.config.rms_norm_eps)).float()

    # ------------------------------------------------------------------ entry points

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache, hidden: torch.Tensor | None = None,
                on_layer: Callable[[int], None] | None = None, capture: HiddenCapture | None = None,
                prompt: PromptCapture | None = None) -> torch.Tensor:
        """Run one step. ``cache`` holds this rank's layers and KV heads; the new tokens' K/V go to
        ``batch.slots``. Returns logits ``[B, vocab]`` of each sequence's last new token on the last
        pipeline stage, else the hidden states ``[T, hidden]`` for the next stage (``hidden`` is
        the previous stage's output; the first stage embeds ``batch.input_ids``). ``on_layer(i)``
        runs as soon as layer ``i`` (of this rank's cache) holds the step's K/V, so a caller can
        start moving it while the later layers compute (the prefill's layerwise KV export).
        ``capture``: keep the states the speech stage reads (see :class:`HiddenCapture`). ``prompt``:
        score the prompt tokens that follow its rows (workers/llm/prompt_logprobs.py)."""
        cos, sin = self._rotary(batch.positions if batch.rope_positions is None else batch.rope_positions)
        # LoRA: tokens grouped by adapter slot once per step; empty (the base path) without slots.
        self._lora_groups = ([] if batch.lora_slots is None or self.lora is None
                             else self.lora.groups(batch.lora_slots))
        h = self.embed.index_select(0, batch.input_ids) if self.first_stage else hidden
        if batch.embeds is not None and self.first_stage:
            index, values = batch.embeds   # encoder outputs at media placeholders (prompt embeddings)
            h[index] = values.to(h.dtype)
        deep_rows, deep_values = batch.deepstack if batch.deepstack is not None else (None, None)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.write(index, batch.slots, k, v)
            if on_layer is not None:
                on_layer(index)
            if batch.is_decode:
                attn = self._decode_attention(q, index, cache, batch)
            else:
                attn = self._prefill_attention(q, k, v, index, cache, batch)
            h = self._finish_layer(layer, h, attn)
            layer_id = self.layer_ids[index]
            if capture is not None and layer_id == self.config.capture_layer - 1:
                # The layer's own output, before DeepStack, as transformers records hidden_states.
                capture.states = h.to("cpu", copy=True)
            if deep_values is not None and layer_id < deep_values.shape[0]:
                h[deep_rows] += deep_values[layer_id].to(h.dtype)   # DeepStack: image features into layer i's output
        if not self.last_stage:
            return h
        if capture is not None and not self.config.capture_layer:
            # On the host: these states only leave through a connector (speech requests only).
            capture.states = _rms_norm(h, self.norm, self.config.rms_norm_eps).cpu()
        if prompt is not None:
            prompt.read(h, self._logits)
        return self._logits(h.index_select(0, batch.last_index))

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], start_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence without a paged cache (single-rank models only). Returns (logits of the
        last position ``[vocab]``, kv ``[layers, 2, seq, kv_heads, head_dim]``)."""
        cfg = self.config
        if not (self.first_stage and self.last_stage and self.shard.tp_size == 1):
            raise ValueError("the cache-free prefill runs on an unsharded model only")
        n = len(token_ids)
        positions = torch.arange(start_position, start_position + n, device=self.device)
        cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]
        h = self.embed[torch.tensor(token_ids, dtype=torch.long, device=self.device)]
        kv = torch.empty(cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            kv[i, 0], kv[i, 1] = k, v
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            h = self._finish_layer(layer, h, attn[0].transpose(0, 1).reshape(n, -1))
        return self._logits(h[-1:])[0], kv

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, block_tables: torch.Tensor,
               context_lens: torch.Tensor | None = None) -> torch.Tensor:
        """One new token for each of B sequences at ``positions`` (their KV is written there);
        ``block_tables`` [B, W] padded with block 0. Returns logits [B, vocab]."""
        batch = ForwardBatch.decode(input_ids, positions, block_tables, cache.block_size)
        return self.forward(batch.to(self.device), cache)
