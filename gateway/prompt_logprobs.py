"""A prompt's own logprobs in the answer, as vLLM renders them (computed by prefill:
workers/llm/prompt_logprobs.py, carried on the first token's ``TokenDelta.prompt_logprobs``).

* ``prompt_logprobs: k`` (chat and completions; not streamed): :func:`prompt_logprobs_field`, vLLM's
  list with one entry per prompt token — ``null`` for the first, then ``{"<token id>": {"logprob",
  "rank", "decoded_token"}}`` holding the prompt token itself and the position's ``k`` likeliest.
  Chat puts it at the top level of the answer, completions on each choice.
* Completions' ``echo`` with ``logprobs: k``: :func:`echo_logprobs`, the legacy logprobs object of
  the echoed prompt (``tokens``, ``token_logprobs`` with ``null`` first, ``top_logprobs`` with
  ``null`` first, each other position's ``k`` alternatives and the prompt token, and
  ``text_offset`` from 0), which the completion's own entries continue (:func:`joined`).

A request gets these only from its first submission (a resumed stream's prompt holds the answer so
far), and their size is bounded: prompt tokens × (k + 1) at most :data:`MAX_PROMPT_LOGPROB_ENTRIES`
(a 400 naming the param beyond).
"""

from __future__ import annotations

from omnirelay.broker import protocol as p
from omnirelay.errors import BadRequest

MAX_PROMPT_LOGPROB_ENTRIES = 256 * 1024   # entries of one answer's prompt logprobs (~5 MB on the bus)
_UNLIKELY = -9999.0   # what a logprob JSON cannot carry (-inf) becomes, as for the sampled tokens'


def _clamp(value: float) -> float:
    return value if value >= _UNLIKELY else _UNLIKELY


def asked(request) -> int:
    """The ``k`` prefill computes for ``request`` (a GenerationRequest): its ``prompt_logprobs``, or
    a completion's ``logprobs`` when it echoes the prompt; -1: none."""
    echo_k = request.logprobs if request.echo else -1
    return max(request.prompt_logprobs, echo_k)


def check_size(k: int, prompt_tokens: int, param: str) -> None:
    if k >= 0 and prompt_tokens * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise BadRequest(f"the prompt's logprobs would hold {prompt_tokens} tokens × {k + 1} entries; at most "
                         f"{MAX_PROMPT_LOGPROB_ENTRIES} per answer", param=param)


def prompt_logprobs_field(gen, token_text) -> list | None:
    """vLLM's ``prompt_logprobs`` of ``gen`` (a Generation), or None when it was not asked;
    ``token_text(gen, id)`` names a token."""
    k = gen.request.prompt_logprobs
    lp = gen.prompt_logprobs
    if k < 0 or lp is None:
        return None
    out: list = [None]
    for i, token in enumerate(gen.prompt_token_ids[1:]):
        entry = {str(token): {"logprob": _clamp(lp.logprobs[i]), "rank": lp.ranks[i],
                              "decoded_token": token_text(gen, token)}}
        top = zip(lp.top_token_ids[i], lp.top_logprobs[i]) if lp.top_token_ids else ()
        for rank, (other, value) in enumerate(list(top)[:k], start=1):
            entry.setdefault(str(other), {"logprob": _clamp(value), "rank": rank,
                                          "decoded_token": token_text(gen, other)})
        out.append(entry)
    return out


def echo_logprobs(gen, token_text) -> tuple[dict, int]:
    """The legacy logprobs object of a completion's echoed prompt, and the text offset after it."""
    k = gen.request.logprobs
    lp = gen.prompt_logprobs
    tokens, offsets, offset = [], [], 0
    for token in gen.prompt_token_ids:
        tokens.append(token_text(gen, token))
        offsets.append(offset)
        offset += len(tokens[-1])
    top: list = [None]
    for i, token in enumerate(gen.prompt_token_ids[1:]):
        alternatives: dict[str, float] = {}
        if lp.top_token_ids:
            for other, value in list(zip(lp.top_token_ids[i], lp.top_logprobs[i]))[:k]:
                alternatives.setdefault(token_text(gen, other), _clamp(value))
        alternatives.setdefault(tokens[i + 1], _clamp(lp.logprobs[i]))   # the prompt token is always one
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [None] + [_clamp(v) for v in lp.logprobs], "top_logprobs": top,
            "text_offset": offsets}, offset


def joined(first: dict, then: dict | None) -> dict:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def received(gen, lp: p.PromptLogprobs | None) -> p.PromptLogprobs:
    """``lp`` checked against ``gen``'s prompt (a worker sent what was asked, for every token)."""
    from omnirelay.errors import OmniError
    if lp is None or len(lp.logprobs) != max(0, len(gen.prompt_token_ids) - 1):
        raise OmniError("the prefill worker sent no prompt logprobs for this prompt (is it older than the gateway?)",
                        request_id=gen.request_id)
    return lp
