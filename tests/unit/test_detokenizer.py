"""The streaming detokenizer: what it hands out, token by token, adds up to the whole decode."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from omnirelay.gateway.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int) -> str:
    out = []
    for i in range(0, len(ids), step):
        final = i + step >= len(ids)
        detok.add(ids[i: i + step], final=final)
        out.append(detok.take(final=final))
    return "".join(out)


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_the_whole_decode(tokenizer, step):
    rng = random.Random(step)
    # Byte-level BPE pieces of multi-byte characters split across tokens are the hard case.
    text = "naïve café — 東京 🚀 " * 3
    for trial in range(20):
        ids = tokenizer.encode(text) if trial == 0 else [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert _stream(IncrementalDetokenizer(tokenizer), ids, step) == expected


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma delta")
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    streamed = _stream(detok, ids, 1)
    assert detok.stopped
    assert streamed == "alpha beta "
    assert "STOP" not in streamed and "gamma" not in streamed


@pytest.mark.parametrize("step", [1, 4, 64])
def test_tokens_used_end_with_the_one_that_completed_the_stop(tokenizer, step):
    """A step's tokens past a stop string belong to no answer: add_until_stop says how many the
    text used, the same whatever the grouping of tokens into steps."""
    ids = tokenizer.encode("alpha beta STOP gamma delta epsilon")
    needed = next(n for n in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:n]))
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    used = 0
    for i in range(0, len(ids), step):
        chunk = ids[i: i + step]
        taken = detok.add_until_stop(chunk, final=i + step >= len(ids))
        used += taken
        if detok.stopped:
            break
        assert taken == len(chunk)
    assert detok.stopped and used == needed and detok.take(final=True) == "alpha beta "
