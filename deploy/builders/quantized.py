"""``omni-make-model quantize SRC OUT --scheme W8A8``: a quantized copy of a causal LM directory, in
compressed-tensors' format as llm-compressor writes it.

The checkpoint is written by the ``compressed-tensors`` package itself, the library llm-compressor
saves through: the scheme's preset (``W8A8``: int8 weights with one symmetric scale per output
channel, int8 activations per token at run time; ``W8A16`` / ``W4A16``: int8 / int4 weights per
group of 128; ``FP8_DYNAMIC``: FP8 E4M3 weights per channel) is applied to every ``Linear`` but
``lm_head`` (llm-compressor's usual ``ignore``), each weight's scale is its min-max (what
llm-compressor's data-free schemes compute: no calibration data), and ``ModelCompressor`` compresses
the state dict and writes ``quantization_config`` into config.json. Tokenizer and generation files
are copied from SRC.

The ``quant`` extra installs compressed-tensors (``pip install -e ".[quant]"``; the test extra has it).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys

SCHEMES = ("W8A8", "W8A16", "W4A16", "FP8_DYNAMIC")


def _complete(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def build_quantized(source: str | os.PathLike, path: str | os.PathLike, *, scheme: str = "W8A8",
                    force: bool = False) -> pathlib.Path:
    """Write ``source`` quantized with ``scheme`` to ``path`` (atomically) and return it."""
    from omnirelay.deploy.builders.llm import build_atomically

    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    source = pathlib.Path(source)
    return build_atomically(path, lambda out: _quantize_into(source, out, scheme), force=force,
                            complete=_complete, what=f"{scheme} model")


def _quantize_into(source: pathlib.Path, out: pathlib.Path, scheme: str) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            quant = getattr(module, "quantization_scheme", None)
            if quant is None or quant.weights is None:
                continue
            weight, args = module.weight, quant.weights
            if args.strategy == "group":
                grouped = weight.view(weight.shape[0], -1, args.group_size)
                low, high = grouped.amin(dim=2), grouped.amax(dim=2)
            else:
                low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype).view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.view_as(module.weight_zero_point))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for item in source.iterdir():   # tokenizer, chat template, generation config
        if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json",) \
                and not item.name.endswith(".safetensors.index.json") and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="omni-make-model quantize",
                                     description="Write a compressed-tensors quantized copy of a causal LM directory.")
    parser.add_argument("source", help="the float model directory (e.g. one written by omni-make-model)")
    parser.add_argument("dir", help="output directory (created atomically)")
    parser.add_argument("--scheme", default="W8A8", choices=SCHEMES,
                        help="llm-compressor's preset: W8A8 (int8 GEMMs), W8A16 / W4A16 (weight-only), "
                             "FP8_DYNAMIC (default W8A8)")
    parser.add_argument("--force", action="store_true", help="replace an existing directory")
    args = parser.parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    try:
        out = build_quantized(args.source, args.dir, scheme=args.scheme, force=args.force)
    except (FileExistsError, ValueError) as exc:
        print(f"omni-make-model: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
