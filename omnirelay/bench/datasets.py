"""Prompts to send: a random dataset and a file dataset, both deterministic for a given seed.

* ``random``: prompts of exactly ``input_len`` tokens of the model's tokenizer (random non-special
  token ids, decoded to text and re-encoded until the text is ``input_len`` tokens long, as
  ``vllm bench serve`` does), or ``input_len`` random English words when there is no tokenizer.
* ``file``: a JSONL file (or one JSON array) of ``{"prompt": "..."}`` records, optionally with
  ``"output_len"``, or ShareGPT-like ``{"conversations": [{"from": "human", "value": "..."}, ...]}``
  records (the first human or user turn is the prompt). Records are taken in file order and reused
  from the start when the file holds fewer than ``num_prompts``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import tokenizers

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this have not are but had which "
    "one all were when there can an their been has more if will would who so no time about out up into "
    "than them only other new some could these two may first then do any like my now over such our man me "
    "even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three river light music garden"
).split()


class DatasetError(ValueError):
    """The dataset cannot be built (a missing file, no usable record, a tokenizer that does not load)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    prompt_len: int | None      # tokens under the benchmark's tokenizer; None without one
    output_len: int             # max_tokens to ask for


class Tokenizer:
    """The few tokenizer operations a dataset needs, over a Hugging Face ``tokenizers.Tokenizer``."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self._backend = backend
        special = set(backend.get_added_tokens_decoder())
        ids = [i for i in range(backend.get_vocab_size(with_added_tokens=True)) if i not in special]
        # Ids that decode to whole characters: a lone byte of a multi-byte character decodes to U+FFFD,
        # which re-encodes to several tokens and keeps random prompts from reaching their length.
        texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        self.ordinary_ids = [i for i, text in zip(ids, texts) if text and "\ufffd" not in text] or ids

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """``tokenizer.json`` in ``path``; else transformers' fast tokenizer for that directory."""
        file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(file):
            return cls(tokenizers.Tokenizer.from_file(file))
        try:
            from transformers import AutoTokenizer   # slow import: only when there is no tokenizer.json
            loaded = AutoTokenizer.from_pretrained(path, use_fast=True)
        except Exception as exc:   # transformers raises many types for a directory it cannot read
            raise DatasetError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        if not loaded.is_fast:
            raise DatasetError(f"the tokenizer in {path!r} has no fast (tokenizers) implementation")
        return cls(loaded.backend_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)


def random_prompts(num: int, input_len: int, output_len: int, tokenizer: Tokenizer | None,
                   seed: int = 0) -> list[Prompt]:
    if num < 1 or input_len < 1 or output_len < 1:
        raise DatasetError("num_prompts, input_len and output_len must be >= 1")
    rng = random.Random(seed)
    if tokenizer is None:
        return [Prompt(" ".join(rng.choice(_WORDS) for _ in range(input_len)), None, output_len)
                for _ in range(num)]
    return [_random_token_prompt(rng, tokenizer, input_len, output_len) for _ in range(num)]


def _random_token_prompt(rng: random.Random, tokenizer: Tokenizer, input_len: int, output_len: int,
                         max_rounds: int = 10) -> Prompt:
    """Random ids decoded to text; the text re-encodes to other ids, so trim or extend, at most ``max_rounds``."""
    ids = [rng.choice(tokenizer.ordinary_ids) for _ in range(input_len)]
    for _ in range(max_rounds):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text)
        if len(encoded) == input_len:
            break
        if len(encoded) > input_len:
            ids = encoded[:input_len]
        else:
            ids = encoded + [rng.choice(tokenizer.ordinary_ids) for _ in range(input_len - len(encoded))]
    text = tokenizer.decode(ids)
    return Prompt(text, len(tokenizer.encode(text)), output_len)


def file_prompts(path: str, num: int, output_len: int, tokenizer: Tokenizer | None) -> list[Prompt]:
    if num < 1 or output_len < 1:
        raise DatasetError("num_prompts and output_len must be >= 1")
    records = _read_records(path, limit=num)
    prompts = []
    for record in records:
        text = _prompt_of(record)
        if not text:
            continue
        own = record.get("output_len")
        length = own if isinstance(own, int) and not isinstance(own, bool) and own >= 1 else output_len
        prompts.append(Prompt(text, len(tokenizer.encode(text)) if tokenizer else None, length))
    if not prompts:
        raise DatasetError(f"{path}: no record with a 'prompt' string or a human/user turn in 'conversations'")
    return [prompts[i % len(prompts)] for i in range(num)]


def _read_records(path: str, limit: int) -> list[dict]:
    """JSON array, or JSONL read up to ``limit`` usable records."""
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot open dataset {path!r}: {exc}") from exc
    with handle:
        head = handle.read(1)
        while head and head.isspace():
            head = handle.read(1)
        if head == "[":
            handle.seek(0)
            try:
                data = json.load(handle)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: not valid JSON: {exc}") from exc
            return [r for r in data if isinstance(r, dict)]
        handle.seek(0)
        records = []
        for number, line in enumerate(handle, 1):
            if len(records) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON: {exc}") from exc
            if isinstance(record, dict) and _prompt_of(record):
                records.append(record)
        return records


def _prompt_of(record: dict) -> str | None:
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt
    turns = record.get("conversations")
    if isinstance(turns, list):
        for turn in turns:
            if not isinstance(turn, dict):
                continue
            speaker = turn.get("from", turn.get("role"))
            text = turn.get("value", turn.get("content"))
            if speaker in ("human", "user") and isinstance(text, str) and text:
                return text
    return None
