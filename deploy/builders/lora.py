"""``omni-make-model tiny-lora BASE_DIR OUT``: a random-weight LoRA adapter for a tiny base model.

The adapter is written by the ``peft`` package itself (``get_peft_model`` + ``save_pretrained``), so
the files are exactly PEFT's format: ``adapter_config.json`` (r, lora_alpha, target_modules,
use_rslora, base_model_name_or_path) and ``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`` (A ``[r, in]``,
B ``[out, r]``). PEFT initialises B to zero (an adapter that changes nothing); here every A and B is
drawn from a seeded normal instead, scaled so the adapter visibly moves greedy output of the tiny
base while keeping clear margins between logits (parity tests then compare something real).

An omni base (a ``thinker_config`` in its config.json: Qwen2.5-Omni, Qwen3-Omni) gets an adapter for
its thinker, as peft applies one to transformers' thinker class (``…ThinkerForConditionalGeneration``,
whose language model is ``model.language_model``): the audio and vision encoders, which have
``q_proj`` … modules of their own, are excluded (``exclude_modules``), and the tensors are named
``base_model.model.model.language_model.layers.…``. Qwen3-Omni's thinker is a mixture of experts
in every layer and experts carry no LoRA here, so its adapters target the attention projections
only (the MLP targets are dropped).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Std of the random A and B entries: large enough that the product changes the tiny model's greedy
# tokens, small enough that activations stay in the base's range.
LORA_STD = 0.08


def _complete(path: pathlib.Path) -> bool:
    return (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()


def build_tiny_lora(base_dir: str | os.PathLike, path: str | os.PathLike, *, rank: int = 8, alpha: float = 16.0,
                    targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0, use_rslora: bool = False,
                    force: bool = False) -> pathlib.Path:
    """Write the adapter for the causal LM at ``base_dir`` to ``path`` (atomically) and return it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from omnirelay.deploy.builders.llm import build_atomically

    base_dir = pathlib.Path(base_dir).expanduser().absolute()
    thinker = thinker_class(base_dir)

    def write(tmp: pathlib.Path) -> None:
        modules, exclude = list(targets), None
        if thinker is None:
            base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        else:   # the language model's layers only
            cls, experts = thinker
            base, exclude = cls.from_pretrained(base_dir, dtype=torch.float32), r".*\b(audio_tower|visual)\b.*"
            if experts:
                modules = [t for t in modules if t not in ("gate_proj", "up_proj", "down_proj")]
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, exclude_modules=exclude,
                            lora_dropout=0.0, use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
        model.save_pretrained(tmp)
        # save_pretrained records the path it was given; keep the base's real location.
        cfg = tmp / "adapter_config.json"
        import json
        raw = json.loads(cfg.read_text())
        raw["base_model_name_or_path"] = str(base_dir)
        cfg.write_text(json.dumps(raw, indent=2, sort_keys=True))

    return build_atomically(path, write, force=force, complete=_complete, what="adapter")


# An omni model_type → its thinker class in transformers, and whether its MLPs are experts.
THINKERS = {"qwen2_5_omni": ("Qwen2_5OmniThinkerForConditionalGeneration", False),
            "qwen3_omni_moe": ("Qwen3OmniMoeThinkerForConditionalGeneration", True)}


def thinker_class(base_dir: pathlib.Path) -> tuple[type, bool] | None:
    """(transformers' thinker class, experts) of an omni checkpoint at ``base_dir``; None for a causal LM."""
    import json

    raw = json.loads((base_dir / "config.json").read_text())
    if "thinker_config" not in raw:
        return None
    if raw.get("model_type") not in THINKERS:
        raise ValueError(f"{base_dir}: no LoRA builder for omni model_type {raw.get('model_type')!r}")
    import transformers
    name, experts = THINKERS[raw["model_type"]]
    return getattr(transformers, name), experts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="omni-make-model tiny-lora",
                                     description="Write a random-weight LoRA adapter (PEFT's format) for a tiny base.")
    parser.add_argument("base_dir", help="the base model directory (e.g. one written by omni-make-model tiny-llm)")
    parser.add_argument("dir", help="output directory (created atomically)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (default 16)")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated target modules among " + ",".join(DEFAULT_TARGETS))
    parser.add_argument("--rslora", action="store_true", help="scale by alpha/sqrt(r) instead of alpha/r")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace an existing directory")
    args = parser.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    unknown = sorted(set(targets) - set(DEFAULT_TARGETS))
    if unknown or args.rank < 1:
        parser.error(f"unsupported targets {unknown}" if unknown else "--rank must be at least 1")
    import torch
    torch.set_num_threads(1)
    try:
        out = build_tiny_lora(args.base_dir, args.dir, rank=args.rank, alpha=args.alpha, targets=targets,
                              seed=args.seed, use_rslora=args.rslora, force=args.force)
    except FileExistsError as exc:
        print(f"omni-make-model: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
