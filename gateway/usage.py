"""What a chat or completion answer reports in ``usage``, under the request's ``stream_options`` and
the server's flags, as vLLM 0.32 reports it (its ``should_include_usage`` and usage builders):

* a JSON answer always has ``usage``: the prompt tokens (each prompt once), the completion tokens
  (every choice's), their total, and ``prompt_tokens_details`` — ``{"cached_tokens": N}`` (the prompt
  tokens prefill took from its prefix cache) with ``--enable-prompt-tokens-details``, else null;
* a stream sends, after its last content chunk, one chunk with ``choices: []`` and that same usage
  (``prompt_tokens_details`` left out when off), when the request asked
  (``stream_options.include_usage``) or the server forces it (``--enable-force-include-usage``);
* ``stream_options.continuous_usage_stats`` (with ``include_usage``), and every stream under
  ``--enable-force-include-usage``, put on each chunk the usage of that chunk's own choice so far:
  its prompt's tokens and the tokens of that choice streamed up to and including this chunk (0 on
  chat's first, role-only chunk), never another choice's, and no ``prompt_tokens_details``; the
  last chunk's totals are the whole request's;
* without either, content chunks carry no ``usage`` key at all (vLLM's chunks leave it out; OpenAI's
  clients read the absent key as null).

Responses (``input_tokens_details``) and speech report their own usage (routes/responses.py,
routes/speech_responses.py): vLLM's Responses always carry ``cached_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import GatewayConfig
    from .schema import GenerationRequest


@dataclasses.dataclass(frozen=True)
class UsageReport:
    """How one answer reports usage: ``final`` (a stream's usage chunk), ``continuous`` (usage on
    every chunk of a stream) and ``details`` (``prompt_tokens_details.cached_tokens``)."""

    final: bool = False
    continuous: bool = False
    details: bool = False

    @classmethod
    def of(cls, include_usage: bool, continuous_usage: bool, *, force: bool, details: bool) -> UsageReport:
        """The request's ``stream_options`` (as parsed: ``continuous_usage`` only with ``include_usage``)
        under the server's ``--enable-force-include-usage`` (``force``: both, whatever was asked) and
        ``--enable-prompt-tokens-details`` (``details``)."""
        if force:
            return cls(final=True, continuous=True, details=details)
        return cls(final=include_usage, continuous=include_usage and continuous_usage, details=details)

    def answer(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """A JSON answer's ``usage`` (``prompt_tokens_details`` null when not reported, as vLLM's body)."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens} if self.details else None}

    def last_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict | None:
        """The usage of a stream's last chunk (``choices: []``), or None when the stream sends none;
        ``prompt_tokens_details`` is left out when not reported, as vLLM leaves out null fields there."""
        if not self.final:
            return None
        usage = self.answer(prompt_tokens, completion_tokens, cached_tokens)
        if usage["prompt_tokens_details"] is None:
            del usage["prompt_tokens_details"]
        return usage

    def so_far(self, prompt_tokens: int, completion_tokens: int) -> dict | None:
        """The usage on a content chunk of one choice: its prompt's tokens and its own completion
        tokens streamed so far; None (no ``usage`` key) unless continuous."""
        if not self.continuous:
            return None
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


def report_for(request: GenerationRequest, config: GatewayConfig) -> UsageReport:
    """The usage report of ``request`` on a gateway configured by ``config``."""
    return UsageReport.of(request.include_usage, request.continuous_usage, force=config.enable_force_include_usage,
                          details=config.enable_prompt_tokens_details)
