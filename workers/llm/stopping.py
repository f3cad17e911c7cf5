"""When does a sequence end? One rule, shared by prefill (first token) and decode (the rest).
Stop *strings* are matched on text by the gateway, which owns the tokenizer, and end the request
with a cancel."""

from __future__ import annotations

from omnirelay.request_params import TextParams


def finish_reason_for(token: int, num_generated: int, total_len: int, params: TextParams,
                      eos_token_ids: tuple[int, ...], max_model_len: int) -> str:
    """``"stop"``, ``"length"`` or ``""`` (go on) after ``token`` became the ``num_generated``-th
    output token and the sequence (prompt + output) is ``total_len`` tokens long."""
    # Before min_tokens the logits processors mask EOS and stop tokens; a row they had to leave
    # unmasked (no token left) still does not stop on one.
    if num_generated > params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
    if num_generated >= params.max_tokens or total_len >= max_model_len:
        return "length"
    return ""
