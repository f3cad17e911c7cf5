"""Which dtype a worker runs its model in: ``--dtype auto`` reads the checkpoint, as vLLM does.

``auto`` takes the dtype the checkpoint was saved in (``config.json``'s ``torch_dtype``, or the
``dtype`` transformers 5 writes, at the top level or in the text/thinker config of a multimodal
checkpoint); real checkpoints are bfloat16, our tiny builders write float32. Then, where it runs:

* bfloat16 on a CPU without native bf16 dot products (no AVX512-BF16 or AMX) runs in float32:
  there oneDNN would emulate bf16 and the engine's fast paths (packed bf16 linears, the native
  bf16 decode attention) are off, so float32 is both faster and exact;
* float16 on the CPU runs in bfloat16 where the CPU has it (the same range as float32, so a
  float16 checkpoint cannot overflow there), else float32; on CUDA it stays float16;
* a checkpoint that names no dtype (diffusers pipelines, some TTS checkpoints) runs in float32.

An explicit ``--dtype float32|bfloat16|float16`` is taken as given.
"""

from __future__ import annotations

import json
import pathlib

DTYPES = ("float32", "bfloat16", "float16")
CHOICES = ("auto", *DTYPES)


def checkpoint_dtype(model_path: str | pathlib.Path) -> str | None:
    """The dtype ``config.json`` names (top level first, then a nested text or thinker config)."""
    path = pathlib.Path(model_path) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for section in (raw, raw.get("text_config") or {}, raw.get("thinker_config") or {},
                    (raw.get("thinker_config") or {}).get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            value = section.get(key)
            if isinstance(value, str) and value.replace("torch.", "") in DTYPES:
                return value.replace("torch.", "")
    return None


def cpu_has_native_bf16() -> bool:
    import torch
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(requested: str, model_path: str | pathlib.Path, on_cuda: bool) -> str:
    """The dtype name a worker loads its model in (see the module docstring)."""
    if requested != "auto":
        return requested
    saved = checkpoint_dtype(model_path) or "float32"
    if on_cuda or saved == "float32":
        return saved
    return "bfloat16" if cpu_has_native_bf16() else "float32"
