"""vLLM's output knobs on chat and completions: how the answer's text and the prompt are shaped.

- ``include_stop_str_in_output`` (false): a matched stop string stays at the end of the text, and the
  token that stopped the worker (EOS or one of ``stop_token_ids``) is detokenized too (with
  ``skip_special_tokens: false`` an EOS then shows as ``<|im_end|>``). Off, as vLLM, neither is text
  (the token still counts in ``usage`` and has its logprobs). Streaming holds nothing back for a stop
  string that may be forming when the string stays anyway.
- ``skip_special_tokens`` (true): special tokens are left out of the text.
- ``spaces_between_special_tokens`` (true): with ``skip_special_tokens: false``, whether added tokens
  are joined to their neighbours by the tokenizer's own decoding (true) or written as they are with
  nothing between them (false: each run of ordinary tokens is decoded alone).
- ``truncate_prompt_tokens`` (null): keep only the last k prompt tokens (after the chat template);
  -1 means the model's context length; above it is a 400 as vLLM answers. A chat with media parts
  refuses it (422): cutting could split an image's or a clip's placeholder run.
- ``return_tokens_as_token_ids`` (false): logprobs name each token ``"token_id:N"`` instead of its
  text (chat's ``token``/``bytes`` and completions' ``tokens``/``top_logprobs`` keys alike).
"""

from __future__ import annotations

import dataclasses

from omnirelay.errors import BadRequest


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False


def boolean_field(body: dict, name: str, default: bool = False) -> bool:
    """``body[name]`` when a boolean, ``default`` when absent or null; a 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def parse_output_options(body: dict) -> OutputOptions:
    """The knobs of a chat or completions body (400 naming a bad one)."""
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None:
        if isinstance(truncate, bool) or not isinstance(truncate, int) or not (truncate == -1 or truncate >= 1):
            raise BadRequest("'truncate_prompt_tokens' must be -1 (the context length) or a positive integer",
                             param="truncate_prompt_tokens")
    return OutputOptions(
        include_stop_str_in_output=boolean_field(body, "include_stop_str_in_output", False),
        skip_special_tokens=boolean_field(body, "skip_special_tokens", True),
        spaces_between_special_tokens=boolean_field(body, "spaces_between_special_tokens", True),
        truncate_prompt_tokens=truncate,
        return_tokens_as_token_ids=boolean_field(body, "return_tokens_as_token_ids", False))


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last ``keep`` tokens of the prompt (-1: ``max_model_len``; None: all of it)."""
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise BadRequest(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.", param="truncate_prompt_tokens")
    return prompt_ids[-keep:]
