"""Structured outputs on the worker: xgrammar's token bitmask applied to the logits before sampling.

Contract. A request that asks for structured output carries ``sampling["structured"]``, a
:class:`~omnirelay.broker.protocol.StructuredOutput` (kind ``json_schema`` | ``json_object`` |
``regex`` | ``grammar`` and its text), checked by the gateway before it was submitted. The engine
that samples (prefill for the first token, decode for the rest) owns one :class:`GrammarSampler`
and calls it around :func:`~omnirelay.workers.llm.sampling.sample`::

    masked = grammars.mask(logits, rows)          # rows: one GrammarRow per batch row (None: free)
    tokens = sample(masked, params, positions)    # greedy or random, over the allowed tokens only
    ended  = grammars.accept(rows, tokens)        # per row: True once the grammar is complete
    ...
    grammars.release(request_id)                  # when the sequence leaves the engine

Per sequence one :class:`xgrammar.GrammarMatcher` lives here, keyed by request id. It is created
the first time a request is masked and brought up to date by **replaying** the tokens the request
already emitted (:attr:`GrammarRow.emitted`): on a decode worker the first token came from prefill,
and a stream resumed on another worker arrives with the tokens the client already has appended to
its prompt (``position_offset`` of them). So whichever worker samples a position, it masks with
the grammar state after every earlier output token.

A spec with ``after`` (a thinking model's end-of-reasoning token ids) leaves its row free until
those tokens appear in the output: the matcher is created then, and a replay starts after them.

The bitmask of all grammar rows of a step is filled in one batched xgrammar call (on as many
threads as torch uses in this process) into a buffer allocated once, and applied in place to a
copy of the logits: the raw logits stay as they were, so logprobs keep their documented meaning
(workers/llm/sampling.py: the model's distribution before any processing). The model's EOS tokens
are the grammar's stop tokens, so EOS is allowed only where the grammar may end; a row whose
grammar completed (EOS accepted, or nothing may follow) ends with finish reason ``stop``.

Compilation: one :class:`xgrammar.GrammarCompiler` per worker over the model's tokenizer (loaded
from the model directory on first use), with a cache per spec: a schema is compiled once per
worker process, whatever the number of requests that use it (stats ``grammar_compiles`` and
``grammar_cache_hits``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading

import torch

from omnirelay.request_params import StructuredOutput

log = logging.getLogger("omnirelay.worker")

MAX_CACHED_GRAMMARS = 256


@dataclasses.dataclass(frozen=True)
class GrammarRow:
    """One batch row under a grammar: its request, its spec and the output tokens it already
    emitted before the position being sampled (replayed into a fresh matcher)."""

    request_id: str
    spec: StructuredOutput
    emitted: tuple[int, ...] = ()


class GrammarCompilerCache:
    """Compiled grammars of one tokenizer, by spec, least recently used dropped past
    :data:`MAX_CACHED_GRAMMARS`. Thread-safe; the tokenizer is loaded on first use."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.stats: collections.Counter = collections.Counter()
        self._compiler = None
        self._cache: collections.OrderedDict[StructuredOutput, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, torch.get_num_threads()))
        return self._compiler

    def get(self, spec: StructuredOutput):
        """The compiled grammar of ``spec``; raises ``ValueError`` if xgrammar refuses it."""
        spec = StructuredOutput(spec.kind, spec.spec)   # the grammar is the same whatever its ``after``
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.stats["grammar_cache_hits"] += 1
                return compiled
            compiler = self._get_compiler()
            try:
                compiled = compile_spec(compiler, spec)
            except Exception as exc:   # xgrammar reports bad input as RuntimeError (others: the same to us)
                raise ValueError(f"structured output {spec.kind}: {exc}") from None
            self.stats["grammar_compiles"] += 1
            self._cache[spec] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled


def compile_spec(compiler, spec: StructuredOutput):
    """``spec`` compiled by an ``xgrammar.GrammarCompiler``. JSON is compact (no free whitespace):
    a model may otherwise spend its whole budget on blanks between tokens that the grammar allows
    (xgrammar's builtin JSON grammar does, and also allows a bare value where OpenAI's
    ``json_object`` promises an object)."""
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "json_object":   # OpenAI's json_object is an object, any keys (not strict)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    return compiler.compile_grammar(spec.spec)


class GrammarSampler:
    """The grammar state of every constrained sequence of one engine (see the module docstring).
    Used from the engine's step thread only."""

    def __init__(self, compilers: GrammarCompilerCache):
        self.compilers = compilers
        self.vocab_size = compilers.vocab_size
        self.stats = compilers.stats
        self._matchers: dict[str, object] = {}
        # Rows whose spec has an ``after`` marker not yet emitted: request id → the last tokens seen.
        self._waiting: dict[str, list[int]] = {}
        self._xgr = None       # xgrammar, imported by the first constrained request (it costs a second)
        self._batch = None
        self._bitmask: torch.Tensor | None = None

    def _load(self):
        if self._xgr is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
            self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
            self._xgr = xgr
        return self._xgr

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers or request_id in self._waiting

    def _matcher(self, row: GrammarRow):
        """The row's matcher, or None while its grammar waits for the end of the reasoning."""
        matcher = self._matchers.get(row.request_id)
        if matcher is None:
            if row.request_id in self._waiting:
                return None
            emitted = list(row.emitted)
            if row.spec.after:
                end = _find(emitted, row.spec.after)
                if end < 0:   # still reasoning: free until the marker (its tail kept to spot it)
                    self.compilers.get(row.spec)   # compiled now: a bad spec fails the request at once
                    self._waiting[row.request_id] = emitted[-len(row.spec.after):]
                    return None
                emitted = emitted[end:]
            matcher = self._load().GrammarMatcher(self.compilers.get(row.spec))
            for token in emitted:   # a hand-off or a resumed stream: catch up with the output so far
                if not matcher.accept_token(int(token)):
                    raise ValueError(f"replayed token {token} does not fit the {row.spec.kind} grammar")
            self.stats["grammar_replayed_tokens"] += len(emitted)
            self._matchers[row.request_id] = matcher
        return matcher

    def row(self, request_id: str, spec: StructuredOutput | None, prompt_token_ids: list[int],
            position_offset: int, generated: list[int] = ()) -> GrammarRow | None:
        """The :class:`GrammarRow` of a sequence about to be sampled (None: it has no grammar).
        Its emitted tokens, needed only to build a matcher, are the prompt's last
        ``position_offset`` (a resumed stream's) and then ``generated`` (what this worker was
        handed or produced: decode starts with prefill's first token)."""
        if spec is None:
            return None
        if request_id in self._matchers:
            return GrammarRow(request_id, spec)
        resumed = prompt_token_ids[len(prompt_token_ids) - position_offset:] if position_offset else []
        return GrammarRow(request_id, spec, (*resumed, *generated))

    def prepare(self, row: GrammarRow) -> None:
        """Create (compile, replay) the matcher of ``row`` now; ``ValueError`` if it cannot be. An
        engine calls this where it can still fail the request alone, before its batched step."""
        self._matcher(row)

    def mask(self, logits: torch.Tensor, rows: list[GrammarRow | None]) -> torch.Tensor:
        """``logits`` [B, vocab] with every token a row's grammar forbids at -inf (a copy; the
        input is left as it was), or ``logits`` itself when no row has a grammar."""
        indices = [i for i, row in enumerate(rows) if row is not None and self._matcher(row) is not None]
        if not indices:
            return logits
        matchers = [self._matcher(rows[i]) for i in indices]
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        # xgrammar's CPU kernel takes float32; elsewhere the logits' own dtype.
        masked = logits.float() if logits.device.type == "cpu" and logits.dtype != torch.float32 else logits.clone()
        self._xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device, non_blocking=True),
                                              vocab_size=min(self.vocab_size, masked.shape[-1]), indices=indices)
        self.stats["grammar_masked_rows"] += len(indices)
        return masked

    def accept(self, rows: list[GrammarRow | None], tokens: list[int]) -> list[bool]:
        """Advance each row's matcher by its sampled token; per row, whether its grammar is now
        complete (the sequence must end). A token the grammar refuses cannot be drawn from masked
        logits; should it happen the sequence ends too, logged, rather than go on unconstrained."""
        ended = []
        for row, token in zip(rows, tokens):
            if row is None:
                ended.append(False)
                continue
            tail = self._waiting.get(row.request_id)
            if tail is not None:   # reasoning: the grammar starts after the marker
                tail = (tail + [int(token)])[-len(row.spec.after):]
                if tail == list(row.spec.after):
                    del self._waiting[row.request_id]
                    self._matchers[row.request_id] = self._load().GrammarMatcher(self.compilers.get(row.spec))
                else:
                    self._waiting[row.request_id] = tail
                ended.append(False)
                continue
            matcher = self._matchers[row.request_id]
            if not matcher.accept_token(int(token)):
                log.error("request %s: sampled token %d is outside its %s grammar", row.request_id, token,
                          row.spec.kind)
                self.stats["grammar_rejected_tokens"] += 1
                ended.append(True)
                continue
            ended.append(bool(matcher.is_terminated()))
        return ended

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)


def _find(tokens: list[int], marker: tuple[int, ...]) -> int:
    """The index just past the first ``marker`` in ``tokens``, or -1."""
    n = len(marker)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i:i + n]) == marker:
            return i + n
    return -1
