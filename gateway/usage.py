"""What a chat or completion answer reports in ``usage``, under the request's ``stream_options`` and
the server's flags, as vLLM 0.32 reports it (its ``should_include_usage`` and usage builders):

* a JSON answer always has ``usage``: the prompt tokens (each prompt once), the completion tokens
  (every choice's), their total, and ``prompt_tokens_details.cached_tokens`` (the prompt tokens
  prefill took from its prefix cache);
* a stream sends, after its last content chunk, one chunk with ``choices: []`` and that same usage,
  when the request asked (``stream_options.include_usage``) or the server forces it
  (``--enable-force-include-usage``);
* ``stream_options.continuous_usage_stats`` (with ``include_usage``), and every stream under
  ``--enable-force-include-usage``, put on each chunk the usage of that chunk's own choice so far:
  its prompt's tokens and the tokens of that choice streamed up to and including this chunk (0 on
  chat's first, role-only chunk), never another choice's, and no ``prompt_tokens_details``; the
  last chunk's totals are the whole request's;
* without either, content chunks carry no ``usage`` key at all (vLLM's chunks leave it out; OpenAI's
  clients read the absent key as null).

Responses (``input_tokens_details``) and speech report their own usage (routes/responses.py,
routes/speech_responses.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import GatewayConfig
    from .schema import GenerationRequest


@dataclasses.dataclass(frozen=True)
class UsageReport:
    """How one answer's stream reports usage: ``final`` (its usage chunk) and ``continuous`` (usage
    on every chunk)."""

    final: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, include_usage: bool, continuous_usage: bool, *, force: bool) -> UsageReport:
        """The request's ``stream_options`` (as parsed: ``continuous_usage`` only with ``include_usage``)
        under the server's ``--enable-force-include-usage`` (``force``: both, whatever was asked)."""
        if force:
            return cls(final=True, continuous=True)
        return cls(final=include_usage, continuous=include_usage and continuous_usage)

    def answer(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        """A JSON answer's ``usage``."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def last_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict | None:
        """The usage of a stream's last chunk (``choices: []``), or None when the stream sends none."""
        return self.answer(prompt_tokens, completion_tokens, cached_tokens) if self.final else None

    def so_far(self, prompt_tokens: int, completion_tokens: int) -> dict | None:
        """The usage on a content chunk of one choice: its prompt's tokens and its own completion
        tokens streamed so far; None (no ``usage`` key) unless continuous."""
        if not self.continuous:
            return None
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


def report_for(request: GenerationRequest, config: GatewayConfig) -> UsageReport:
    """The usage report of ``request`` on a gateway configured by ``config``."""
    return UsageReport.of(request.include_usage, request.continuous_usage, force=config.enable_force_include_usage)
