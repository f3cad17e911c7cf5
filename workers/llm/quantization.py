"""Quantized weights for the compact engine: what a checkpoint's ``quantization_config`` says, what
``--quantization`` asks for, how stored integers become weights, and the int8 linear kernel.

What is served, and how (docs/DESIGN.md, "Quantized weights"):

* **W8A8 int8** — compressed-tensors' ``int-quantized`` format as llm-compressor's ``W8A8`` preset
  writes it (int8 weights, one symmetric scale per output channel; activations int8, one symmetric
  scale per token, computed at run time) — runs int8 GEMMs on the CPU (fbgemm through torch: VNNI
  dot products, int32 accumulation). The weights stay int8 in memory: half the bytes of bf16.
* **Online int8** (``--quantization int8``): any float checkpoint's linear weights quantized at load
  the same way (round to nearest, one scale per output channel), then served as W8A8.
* **Weight-only and FP8 checkpoints** — compressed-tensors ``pack-quantized`` (W4A16, W8A16: int4 or
  int8 weights, per channel or per group, symmetric) and ``float-quantized`` (FP8 E4M3) — are
  dequantized at load into the compute dtype and logged as such: right answers, none of the memory
  or speed gain (this CPU has no kernel for them that beats bf16).
* GPTQ, AWQ, bitsandbytes, GGUF and the other methods are refused at start-up by name: the engine
  never reads packed integers as if they were weights.

Where there is no int8 kernel (a CUDA device; a CPU build without fbgemm) W8A8 weights are
dequantized at load too. Embeddings, norms and ``lm_head`` stay in the compute dtype (the presets
leave ``lm_head`` unquantized). The MoE experts of a quantized checkpoint are dequantized at load.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Callable

import torch

from omnirelay.workers.runtime.quantization_methods import CHOICES, QuantizedCheckpointError, check_requested

log = logging.getLogger(__name__)

__all__ = ["CHOICES", "QuantizedCheckpointError", "check_requested", "Int8Linear", "Quantization", "WeightQuant",
           "checkpoint_quantization", "dequantize", "int8_available", "quantize_per_channel", "resolve"]


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How one checkpoint stores its quantized linear weights (compressed-tensors' terms)."""

    format: str                  # "int-quantized" | "pack-quantized" | "float-quantized"
    num_bits: int
    strategy: str                # "channel" | "group" | "tensor"
    group_size: int | None
    dynamic_token_activations: bool   # W8A8: activations quantized per token at run time

    @property
    def int8_kernel(self) -> bool:
        """Whether the stored weights are what the int8 linear runs on as they are."""
        return (self.format == "int-quantized" and self.num_bits == 8 and self.strategy == "channel"
                and self.dynamic_token_activations)

    def describe(self) -> str:
        what = {"int-quantized": f"int{self.num_bits}", "pack-quantized": f"int{self.num_bits} packed",
                "float-quantized": "fp8"}[self.format]
        per = f"group {self.group_size}" if self.strategy == "group" else self.strategy
        acts = "int8 per-token activations" if self.dynamic_token_activations else "float activations"
        return f"compressed-tensors {what} weights (per {per}), {acts}"


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What a model's linear layers run: ``int8`` (W8A8 kernels; from the checkpoint, or quantized
    at load when ``online``) or ``dequantize`` (the checkpoint's integers or FP8 turned into the
    compute dtype at load, then the float kernels). ``checkpoint`` is how the file stores them (None
    for an online quantization of a float checkpoint)."""

    mode: str                         # "int8" | "dequantize"
    checkpoint: WeightQuant | None
    online: bool = False

    def describe(self) -> str:
        if self.online:
            return "int8 W8A8, quantized at load (--quantization int8)"
        assert self.checkpoint is not None
        how = "int8 GEMMs" if self.mode == "int8" else "dequantized at load to the compute dtype"
        return f"{self.checkpoint.describe()}: {how}"


def _sections(raw: dict) -> list[dict]:
    """config.json and an omni checkpoint's thinker / text configs: where quantization_config may be."""
    thinker = raw.get("thinker_config") or {}
    return [raw, raw.get("text_config") or {}, thinker, thinker.get("text_config") or {}]


def checkpoint_quantization(path, raw: dict) -> WeightQuant | None:
    """The checkpoint's weight quantization read from ``config.json`` (``raw``), None for a float
    checkpoint; :class:`QuantizedCheckpointError` naming what is not served."""
    quant = next((s["quantization_config"] for s in _sections(raw) if s.get("quantization_config")), None)
    if quant is None:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    if method != "compressed-tensors":
        raise QuantizedCheckpointError(
            f"{path}: quantization_config.quant_method {method!r} is not served; served: compressed-tensors "
            f"(llm-compressor's W8A8 runs int8 GEMMs; W4A16, W8A16 and FP8 are dequantized at load). "
            f"Convert the model with llm-compressor, or serve the unquantized checkpoint")
    groups = [g for g in (quant.get("config_groups") or {}).values() if g.get("weights")]
    if not groups:
        raise QuantizedCheckpointError(f"{path}: compressed-tensors config without weight quantization "
                                       f"(config_groups) is not served")
    kinds = {_weight_quant(path, quant, g) for g in groups}
    if len(kinds) > 1:
        raise QuantizedCheckpointError(f"{path}: compressed-tensors config_groups with different weight schemes "
                                       f"are not served: {sorted(k.describe() for k in kinds)}")
    if quant.get("kv_cache_scheme"):
        raise QuantizedCheckpointError(f"{path}: a quantized KV cache (kv_cache_scheme) is not served")
    return kinds.pop()


def _weight_quant(path, quant: dict, group: dict) -> WeightQuant:
    weights, acts = group["weights"], group.get("input_activations")
    fmt = group.get("format") or quant.get("format") or "unknown"
    bits, kind = int(weights.get("num_bits", 0)), weights.get("type", "int")
    strategy, size = weights.get("strategy", "tensor"), weights.get("group_size")

    def refuse(what: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(f"{path}: compressed-tensors {fmt} with {what} is not served")

    if fmt not in ("int-quantized", "pack-quantized", "float-quantized", "naive-quantized"):
        raise refuse(f"format {fmt!r}")
    fmt = "int-quantized" if fmt == "naive-quantized" else fmt
    if not weights.get("symmetric", True):
        raise refuse("asymmetric weights (a zero point)")
    if weights.get("actorder") or weights.get("block_structure") or weights.get("dynamic"):
        raise refuse("activation-ordered, block or dynamic weight quantization")
    if strategy not in ("channel", "group", "tensor") or (strategy == "group" and not size):
        raise refuse(f"weight strategy {strategy!r}")
    if fmt == "float-quantized":
        if kind != "float" or bits != 8:
            raise refuse(f"{kind}{bits} weights")
    elif kind != "int" or bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
        raise refuse(f"{kind}{bits} weights")
    token_acts = False
    if acts:
        static = not acts.get("dynamic", False)
        if static or not acts.get("symmetric", True) or acts.get("strategy") not in ("token", "tensor"):
            if fmt != "float-quantized":
                raise refuse("static or asymmetric activation quantization")
        token_acts = (fmt == "int-quantized" and acts.get("type", "int") == "int" and int(acts.get("num_bits", 0)) == 8
                      and acts.get("strategy") == "token")
    return WeightQuant(format=fmt, num_bits=bits, strategy=strategy, group_size=size if strategy == "group" else None,
                       dynamic_token_activations=token_acts)


def resolve(path, stored: WeightQuant | None, requested: str | None, device: torch.device) -> Quantization | None:
    """What the linear layers run, from how the checkpoint stores them (:func:`checkpoint_quantization`)
    and ``--quantization`` (None: as stored). Refuses, naming it, a method not served or one the
    checkpoint contradicts."""
    check_requested(requested)
    if stored is None:
        if requested == "compressed-tensors":
            raise QuantizedCheckpointError(f"--quantization compressed-tensors: {path} is not a quantized "
                                           f"checkpoint (no quantization_config); use --quantization int8")
        if requested == "int8":
            return Quantization("int8" if int8_available(device) else "dequantize", None, online=True)
        return None
    if requested == "int8":
        raise QuantizedCheckpointError(f"--quantization int8: {path} is already quantized ({stored.describe()}); "
                                       f"leave --quantization out to serve it as stored")
    mode = "int8" if stored.int8_kernel and int8_available(device) else "dequantize"
    return Quantization(mode, stored)


# ----------------------------------------------------------------------------- stored tensors


def stored_names(name: str) -> tuple[str, ...]:
    """The tensors of the file that hold a quantized weight named ``name`` (``....weight``)."""
    base = name[: -len("weight")]
    return (name, base + "weight_packed", base + "weight_scale", base + "weight_shape")


def unpack_int32(packed: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized rows → int8 values: element i of a row sits at bit
    ``i * num_bits`` of the row's little-endian int32 words, offset by ``2 ** (num_bits - 1)``."""
    data = packed.contiguous().view(torch.uint8)      # little-endian bytes, low element first
    if num_bits == 8:
        values = data
    elif num_bits == 4:
        values = torch.stack((data & 0xF, data >> 4), dim=-1).view(data.shape[0], -1)
    else:
        raise QuantizedCheckpointError(f"unpacking int{num_bits} weights is not served")
    return (values[:, :columns].to(torch.int16) - (1 << (num_bits - 1))).to(torch.int8)


def dequantize(read: Callable[[str], torch.Tensor], name: str, quant: WeightQuant, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``name`` of a checkpoint stored as ``quant``; ``read`` reads a stored tensor."""
    base = name[: -len("weight")]
    scale = read(base + "weight_scale").float()
    if quant.format == "pack-quantized":
        rows, columns = (int(v) for v in read(base + "weight_shape").tolist())
        values = unpack_int32(read(base + "weight_packed"), quant.num_bits, columns).float()
    else:
        values = read(name).float()
        rows, columns = values.shape
    if scale.numel() == 1:
        weight = values * scale.reshape(())
    elif quant.strategy == "group":
        weight = (values.view(rows, -1, quant.group_size) * scale.view(rows, -1, 1)).view(rows, columns)
    else:
        weight = values * scale.view(rows, 1)
    return weight.to(dtype)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] → int8 values and one float32 scale per row, rounded to nearest, as
    llm-compressor's W8A8 preset writes them (compressed-tensors' symmetric min-max: the scale is the
    row's largest magnitude over half the int8 range, 127.5, values clamped to [-128, 127]), so an
    online quantization serves the same weights as that checkpoint."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.5).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp_(-128, 127).to(torch.int8), scale


# ----------------------------------------------------------------------------- the int8 linear


class Int8Linear:
    """``x @ (q * scale).T + bias`` over int8 weights ``q`` [N, K] (the row-wise concatenation of
    ``parts``: q, k, v; gate, up; or one matrix) with a float32 ``scale`` [N] per output channel,
    activations quantized per token: row t of ``x`` becomes int8 with scale ``amax|x_t| / 127``
    (``agree_on_scale``: where ``x`` is one rank's slice of the row, the ranks' maximum). Products are
    summed in int32, exactly; the result is float32 scaled back, returned in ``x``'s dtype. Two ways
    to hold the weights, as :class:`~omnirelay.workers.llm.models.llama._Linear` has for floats:

    * ``packed``: fbgemm's blocked layout (a private copy). Its kernel quantizes its float input with
      one scale and zero point; handing it ``x_t / scale_t`` with scale 1 and zero point 128 makes
      that exactly the per-token symmetric quantization. The decode role's choice: fastest at small M.
    * mapped: ``torch._int_mm`` on each part in place, so int8 weights that are views of a W8A8
      checkpoint's memory map stay shared pages of the file (no private copy). The prefill role's
      choice: within ~10 % of packed at M=256 and still well ahead of the bf16 kernels there.

    ``benchmarks/int8_linear.py`` on this host's AVX512-VNNI core, one thread, eight distinct
    9,728 x 896 weights read from memory (Qwen2.5-0.5B's gate_up), ms for all eight (BENCHMARKS.md,
    "Quantized weights"): M=1: packed 3.5, mapped 6.6, bf16 oneDNN-packed 8.6; M=8: 5.3, 12.2, 9.9;
    M=256: 123, 134, 166 (bf16 ``F.linear`` 174)."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], bias: torch.Tensor | None, *,
                 packed: bool = True, agree_on_scale: Callable[[torch.Tensor], None] | None = None):
        for q, scale in parts:
            if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
                raise ValueError(f"Int8Linear needs int8 [N, K] weights and [N] scales, got {q.dtype} "
                                 f"{tuple(q.shape)}, {tuple(scale.shape)}")
        self.in_features = parts[0][0].shape[1]
        self.out_features = sum(q.shape[0] for q, _ in parts)
        self.scale = torch.cat([scale.float() for _, scale in parts])
        self.bias = None if bias is None else bias.float()
        self.agree_on_scale = agree_on_scale   # a row-parallel rank: max-reduce the token scales in place
        self.packed = packed
        self.parts: list[torch.Tensor] = []
        self.weight = None
        if packed:
            q = parts[0][0] if len(parts) == 1 else torch.cat([q for q, _ in parts])
            # The quantized-tensor API is the one way into fbgemm's packed int8 GEMM from Python.
            channel_scale = self.scale.double()
            with warnings.catch_warnings():   # torch marks quantized tensors deprecated; 2.13 (pinned) has them
                warnings.simplefilter("ignore", UserWarning)
                qtensor = torch._make_per_channel_quantized_tensor(q, channel_scale,
                                                                   torch.zeros_like(q[:, 0], dtype=torch.long), 0)
                self.weight = torch.ops.quantized.linear_prepack(qtensor, None)
        else:
            self.parts = [q.t() for q, _ in parts]   # [K, n] views: _int_mm's right operand, no copy

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        token_scale = flat.abs().amax(dim=1, keepdim=True)
        if self.agree_on_scale is not None:
            self.agree_on_scale(token_scale)
        token_scale.div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)
        if self.packed:
            out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                flat / token_scale, 1.0, 128, self.weight)
            out.mul_(token_scale)
        else:
            values = torch.round(flat / token_scale).clamp_(-127, 127).to(torch.int8)
            sums = [torch._int_mm(values, part) for part in self.parts]
            out = (sums[0] if len(sums) == 1 else torch.cat(sums, dim=1)).float()
            out.mul_(token_scale).mul_(self.scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


@functools.cache
def _int8_kernel_works() -> bool:
    try:   # internal ops: probe once before trusting them (a CPU build without fbgemm lacks them)
        q = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        expected = torch.tensor([[-0.5, 1.75]])
        return all(torch.allclose(Int8Linear([(q, torch.tensor([0.5, 0.25]))], None, packed=packed)(
            torch.tensor([[1.0, 1.0]])), expected, atol=1e-2) for packed in (True, False))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def int8_available(device: torch.device) -> bool:
    """Whether the int8 linear runs on ``device`` (the CPU with fbgemm); elsewhere W8A8 weights are
    dequantized at load."""
    if torch.device(device).type != "cpu":
        return False
    if not _int8_kernel_works():
        log.warning("this torch build has no fbgemm int8 GEMM: W8A8 weights are dequantized at load")
        return False
    return True
