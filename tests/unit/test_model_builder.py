"""Tests for omnirelay.deploy.builders.llm: the tiny offline Qwen2 the rest of the suite uses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from omnirelay.deploy.builders import llm as mb

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Hello, how are you today?",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Explain how a computer stores text.",
    "Can you help me plan a trip to the mountains?",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return mb.build_tiny_llm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _no_leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")] == []


def test_files_and_config(model_dir, tok):
    assert mb.is_complete(model_dir)
    assert _no_leftovers(model_dir.parent)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    expect = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048,
                  rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  torch_dtype="float32")
    assert {k: cfg[k] for k in expect} == expect
    assert cfg["vocab_size"] % 64 == 0 and len(tok) <= cfg["vocab_size"] < len(tok) + 64
    assert 1000 <= len(tok) <= 2000
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert cfg["eos_token_id"] == im_end and cfg["bos_token_id"] == eot
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, eot] and gen["do_sample"] is False


def test_tokenizer_specials_and_chat_template(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert len(set(ids)) == 3 and tok.unk_token_id not in ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, tokenize=False).endswith("Hi!<|im_end|>\n")
    # Specials are single ids, not spelled out byte by byte.
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False)[0] == ids[1]


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — naïve café, ¿qué tal? ½ × 3 ≠ 2",
    "日本語のテキスト、中文字符 и русский текст 🙂🚀",
    "  leading spaces,\ttabs\nand\r\nnewlines  ",
])
def test_unicode_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_greedy_output_is_not_degenerate(tok, model):
    eos = model.generation_config.eos_token_id
    for prompt in PROMPTS:
        msgs = [{"role": "user", "content": prompt}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        n = enc["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=64, min_new_tokens=64,
                                 pad_token_id=tok.pad_token_id)
            new = out[0, n:]
            assert new.numel() == 64
            assert len(set(new.tolist())) >= 8, (prompt, new.tolist())
            assert int(new.max()) < len(tok)  # never a padding row of the embedding matrix
            # Clear argmax margins: a float32 re-implementation must reproduce these tokens.
            logits = model(out).logits[0, n - 1 : -1]
            logits[:, eos] = float("-inf")
            assert logits.argmax(-1).tolist() == new.tolist()
            top2 = logits.topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, prompt


def test_cli_builds_is_deterministic_and_refuses_existing(model_dir, tmp_path, capsys):
    threads = torch.get_num_threads()  # main() sets 1 thread; keep the rest of the session intact
    try:
        out = tmp_path / "cli"
        weights = (model_dir / "model.safetensors").read_bytes()
        assert mb.main(["tiny-llm", str(out)]) == 0
        assert mb.is_complete(out) and _no_leftovers(tmp_path)
        # Same seed, same bytes as the fixture built through the library call.
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name

        capsys.readouterr()
        assert mb.main(["tiny-llm", str(out), "--seed", "1"]) == 2
        assert "--force" in capsys.readouterr().err
        assert (out / "model.safetensors").read_bytes() == weights  # untouched

        assert mb.main(["tiny-llm", str(out), "--seed", "1", "--force"]) == 0
        assert (out / "model.safetensors").read_bytes() != weights
        assert mb.is_complete(out) and _no_leftovers(tmp_path)
    finally:
        torch.set_num_threads(threads)


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(out_dir, seed):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(mb, "_build_into", boom)
    with pytest.raises(RuntimeError):
        mb.build_tiny_llm(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def _copy_builder(src):
    def fake(out_dir, seed):
        for f in src.iterdir():
            shutil.copy(f, out_dir / f.name)
    return fake


def test_default_model_dir_builds_once(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIRELAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(mb, "_build_into", _copy_builder(model_dir))
    first = mb.default_model_dir()
    assert first.parent == tmp_path / "cache" and mb.is_complete(first)

    monkeypatch.setattr(mb, "_build_into", lambda *a: pytest.fail("rebuilt a cached model"))
    assert mb.default_model_dir() == first


def test_default_model_dir_race_loser_discards_its_copy(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("OMNIRELAY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    copy = _copy_builder(model_dir)

    def slow_builder(out_dir, seed):
        # The other process finishes first, while we are still building.
        target = tmp_path / "omnirelay" / f"{mb.MODEL_KIND}-v{mb.RECIPE_VERSION}-seed0"
        shutil.copytree(model_dir, target)
        copy(out_dir, seed)

    monkeypatch.setattr(mb, "_build_into", slow_builder)
    got = mb.default_model_dir()
    assert got.parent == tmp_path / "omnirelay" and mb.is_complete(got)
    assert _no_leftovers(got.parent)
