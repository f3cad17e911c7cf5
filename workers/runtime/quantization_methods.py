"""What ``--quantization`` may name, checked where the flag is parsed (the worker's config, before
any engine loads); how each is served lives beside the kernels (workers/llm/quantization.py)."""

from __future__ import annotations

# "int8" quantizes a float checkpoint at load (W8A8); "compressed-tensors" names the checkpoint's
# own format (what leaving the flag out detects). vLLM's other names are recognised so that asking
# for one is refused by name rather than mistaken for a typo.
ONLINE_METHODS = ("int8",)
CHECKPOINT_METHODS = ("compressed-tensors",)
CHOICES = (*ONLINE_METHODS, *CHECKPOINT_METHODS)
REFUSED_METHODS = ("fp8", "gptq", "gptq_marlin", "awq", "awq_marlin", "bitsandbytes", "gguf", "marlin",
                   "experts_int8", "modelopt", "mxfp4", "torchao", "hqq", "quark", "auto-round", "fbgemm_fp8")


class QuantizedCheckpointError(ValueError):
    """A quantized checkpoint (or a ``--quantization``) the engine cannot serve: refused at start-up,
    naming the method, rather than loading its packed integers as weights (garbage answers)."""


def check_requested(requested: str | None) -> None:
    """Refuse, by name, a ``--quantization`` that is not served (before any weight is read)."""
    if requested in REFUSED_METHODS:
        raise QuantizedCheckpointError(
            f"--quantization {requested}: not served (served: {', '.join(CHOICES)}; GPTQ/AWQ checkpoints "
            f"convert to compressed-tensors W4A16 with llm-compressor)")
    if requested not in (None, *CHOICES):
        raise QuantizedCheckpointError(f"--quantization {requested!r}: unknown (served: {', '.join(CHOICES)})")
