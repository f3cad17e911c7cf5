"""Tiny random-weight Qwen3-Embedding- and Qwen3-Reranker-style models (``omni-make-model
tiny-qwen3-embedding | tiny-qwen3-reranker``).

``tiny-qwen3`` (:mod:`.qwen3`: ``Qwen3ForCausalLM``, 4 layers, hidden 256, q/k norms) laid out as
Qwen3-Embedding is published, an ordinary Hugging Face directory that sentence-transformers loads:

* ``modules.json`` -- Transformer → ``1_Pooling`` → ``2_Normalize``, and ``1_Pooling/config.json`` with
  ``pooling_mode_lasttoken`` (or, with ``pooling="mean"`` / ``"cls"``, that mode instead): what
  omnirelay's :func:`~omnirelay.pooling_params.resolve_pooler_config` reads;
* ``tokenizer.json`` -- its post-processor appends ``<|endoftext|>`` to every text, as
  Qwen3-Embedding's does, so the last token pooled is the end-of-text marker;
* ``config.json`` -- ``is_matryoshka: true`` (any ``dimensions`` from 1 to 256), as vLLM reads it.

``tiny-qwen3-reranker`` is ``tiny-qwen3`` as Qwen3-Reranker is served: a causal LM scored from its
"no"/"yes" logits at the last token. Its tokenizer gains ``yes`` and ``no`` as tokens of their own
(the tiny vocabulary spells them in pieces), with random embedding and lm_head rows, and its
``config.json`` says what vLLM's ``--hf-overrides`` say for the real one: ``classifier_from_token:
["no", "yes"]`` and ``is_original_qwen3_reranker: true``.
"""

from __future__ import annotations

import json
import os
import pathlib

from omnirelay.deploy.builders.llm import build_atomically, cached_model, is_complete
from omnirelay.deploy.builders.qwen3 import _build_into as _build_qwen3
from omnirelay.deploy.builders.qwen3 import NUM_EXPERTS

KIND = "tiny-qwen3-embedding"
RECIPE_VERSION = 1
EOS = "<|endoftext|>"
_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def _complete(path: pathlib.Path) -> bool:
    return is_complete(path) and (path / "modules.json").is_file() and (path / "1_Pooling" / "config.json").is_file()


def _build_into(out_dir: pathlib.Path, seed: int, pooling: str) -> None:
    _build_qwen3(out_dir, seed, False, NUM_EXPERTS)
    config = json.loads((out_dir / "config.json").read_text())
    config["is_matryoshka"] = True
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = json.loads((out_dir / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == EOS)
    sequence = [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": EOS, "type_id": 0}}]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": sequence,
        "pair": sequence + [{"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": EOS, "type_id": 1}}],
        "special_tokens": {EOS: {"id": EOS, "ids": [eos_id], "tokens": [EOS]}}}
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    hidden = config["hidden_size"]
    (out_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048, "do_lower_case": False}))
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{mode: name == pooling for name, mode in _MODES.items()},
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
         "pooling_mode_weightedmean_tokens": False, "include_prompt": True}, indent=2))
    (out_dir / "2_Normalize").mkdir()
    for path in [out_dir, out_dir / "1_Pooling", out_dir / "2_Normalize"]:
        os.chmod(path, 0o755)
    for f in out_dir.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o644)


def _build_reranker_into(out_dir: pathlib.Path, seed: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from omnirelay.deploy.builders.llm import INIT_STD

    _build_qwen3(out_dir, seed, False, NUM_EXPERTS)
    tokenizer = json.loads((out_dir / "tokenizer.json").read_text())
    first = 1 + max(max(tokenizer["model"]["vocab"].values()), *(t["id"] for t in tokenizer["added_tokens"]))
    labels = {"no": first, "yes": first + 1}
    for word, token_id in labels.items():
        tokenizer["added_tokens"].append({"id": token_id, "content": word, "single_word": True, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": False})
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    weights = load_file(str(out_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    for name, std in (("model.embed_tokens.weight", INIT_STD["embed_tokens"]), ("lm_head.weight", INIT_STD["lm_head"])):
        rows = weights[name]
        assert rows.shape[0] > first + 1, "the padded vocabulary has room for the label tokens"
        rows[first:first + 2] = torch.randn(2, rows.shape[1], generator=generator) * std
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config.update(classifier_from_token=["no", "yes"], is_original_qwen3_reranker=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def build_tiny_qwen3_reranker(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write ``tiny-qwen3-reranker`` to ``path``."""
    return build_atomically(path, lambda tmp: _build_reranker_into(tmp, seed), force=force, complete=is_complete,
                            what="model")


def cached_qwen3_reranker() -> pathlib.Path:
    return cached_model(f"tiny-qwen3-reranker-v{RECIPE_VERSION}-seed0", lambda tmp: _build_reranker_into(tmp, 0),
                        is_complete)


def build_tiny_qwen3_embedding(path: str | os.PathLike, seed: int = 0, *, pooling: str = "last",
                               force: bool = False) -> pathlib.Path:
    """Write ``tiny-qwen3-embedding`` to ``path``; ``pooling``: ``last`` (Qwen3-Embedding's), ``mean`` or ``cls``."""
    if pooling not in _MODES:
        raise ValueError(f"pooling must be one of {', '.join(_MODES)}")
    return build_atomically(path, lambda tmp: _build_into(tmp, seed, pooling), force=force, complete=_complete,
                            what="model")


def cached_qwen3_embedding(pooling: str = "last") -> pathlib.Path:
    """The cached seed-0 build (made on first use; safe under concurrent builders)."""
    return cached_model(f"{KIND}-v{RECIPE_VERSION}-{pooling}-seed0", lambda tmp: _build_into(tmp, 0, pooling),
                        _complete)
