"""Loading a speech family's weights from a checkpoint directory (safetensors only; a pickle is never
loaded): the tensors under some prefixes, a module filled from them, the Qwen2.5-Omni speaker table.
Shared by the families' loaders (qwen2_5_omni.py, qwen3.py, qwen3_tts.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

def load_prefixed(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint whose names start with one of ``prefixes`` (safetensors only)."""
    from safetensors import safe_open
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    return out



def load_speakers(root: Path) -> dict[str, dict]:
    """name → {"cond", "ref_mel", "bos_token"} (transformers' ``speaker_map``): from
    ``spk_dict.safetensors`` + ``spk_dict.json`` (what ``omni-make-model`` writes). A real checkpoint's
    ``spk_dict.pt`` is a pickle, which we never load: convert it once to those two files."""
    if (root / "spk_dict.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(root / "spk_dict.safetensors"))
        meta = json.loads((root / "spk_dict.json").read_text())
        return {name: {"cond": tensors[f"{name}.cond"], "ref_mel": tensors[f"{name}.ref_mel"],
                       "bos_token": int(info["bos_token"])} for name, info in meta.items()}
    raise FileNotFoundError(f"{root} has no speaker table spk_dict.safetensors + spk_dict.json (a pickled "
                            "spk_dict.pt is not loaded: convert it to those two files)")


def load_talker(root: Path, talker: torch.nn.Module, vocoder: torch.nn.Module, vocoder_prefix: str, *,
                dtype: torch.dtype, device: str,
                talker_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda weights: weights,
                ) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """The checkpoint's ``talker.*`` and ``<vocoder_prefix>*`` tensors loaded into the modules built
    from its config (``talker_layout`` maps the checkpoint's names to the talker module's), and the
    thinker's embedding table. Returns the talker and the table in ``dtype`` and the vocoder in
    float32 — always, as transformers forces it (token2wav's ODE solver needs the range) — on ``device``."""
    weights = load_prefixed(root, ("talker.", vocoder_prefix, "thinker.model.embed_tokens."))
    load_module(talker, talker_layout(weights), "talker.")
    load_module(vocoder, weights, vocoder_prefix)
    embed = weights["thinker.model.embed_tokens.weight"].to(device=device, dtype=dtype)
    return talker.to(device=device, dtype=dtype).eval(), vocoder.to(device=device).float().eval(), embed


def load_module(module: torch.nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False)
    # Non-persistent buffers (rotary frequencies) are rebuilt by the constructor, never saved.
    missing = [k for k in missing if not k.endswith(("inv_freq", "original_inv_freq"))]
    if missing or unexpected:
        raise ValueError(f"{prefix[:-1]} weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
