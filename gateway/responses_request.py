"""A ``POST /v1/responses`` body (OpenAI's Responses API) checked and translated into the chat path.

The Responses API is served by the chat machinery, not beside it: :func:`parse_responses` turns the
body into a :class:`ResponsesCall` whose ``turn`` (the new input as chat messages) and ``chat_options``
(sampling, tools, structured output) become one chat body, validated by gateway/schema.py's
``parse_chat`` like any chat request (gateway/routes/responses.py puts the stored history of
``previous_response_id`` and the ``instructions`` in front). What maps where:

==========================  ===============================================================
Responses                   chat
==========================  ===============================================================
``input`` (string)          one user message
``input`` items             ``message`` (roles user/assistant/system/developer; parts
                            ``input_text``/``output_text`` → text, ``input_image`` →
                            ``image_url``, ``input_audio`` → ``input_audio``);
                            ``function_call`` → an assistant message's ``tool_calls``;
                            ``function_call_output`` → a ``tool`` message; ``reasoning`` items
                            are dropped (the chat template drops earlier reasoning too)
``instructions``            a system message first (not carried to a follow-up, as OpenAI)
``max_output_tokens``       ``max_tokens``
``temperature``, ``top_p``  the same; vLLM's extras (:data:`SAMPLING_KEYS`) too
``tools`` (function)        ``tools`` ``{"type": "function", "function": {…}}``
``tool_choice``             the same, a named one as ``{"type": "function", "name"}``
``text.format``             ``response_format`` (text, json_object, json_schema)
``top_logprobs`` and/or     ``logprobs`` + ``top_logprobs`` on each ``output_text``
``include`` logprobs
``reasoning.effort``        ``reasoning_effort`` (``reasoning.summary`` is refused)
==========================  ===============================================================

Anything else that would change the answer is a 422 naming it (:data:`REFUSED`, any key not listed
here, tool types other than ``function``, ``truncation: "auto"``, ``background``, …); hints that
cannot change the answer (``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``,
``metadata``) are echoed on the response. Errors raised by the chat validation name the chat param;
:func:`responses_param` renames it to the Responses one (``messages`` → ``input``, …).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from omnirelay.errors import BadRequest, Unprocessable

# vLLM's sampling extras, template switches and structured outputs, passed to the chat validation as
# they are.
SAMPLING_KEYS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "logit_bias", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "bad_words",
                 "allowed_token_ids", "chat_template_kwargs", "structured_outputs")
# Keys the Responses API defines that change the answer and are not served; any value but these
# (None always passes) is a 422.
REFUSED: dict[str, tuple] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "truncation": ("disabled",),
    "context_management": (),
}
# Keys accepted without changing the tokens: echoed on the response object.
HINTS = ("user", "safety_identifier", "prompt_cache_key", "service_tier", "prompt_cache_retention")
_SERVED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
           "parallel_tool_calls", "text", "stream", "stream_options", "store", "previous_response_id", "metadata",
           "include", "top_logprobs", "reasoning", *SAMPLING_KEYS, *REFUSED, *HINTS}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "assistant", "system", "developer")
MAX_METADATA = 16


@dataclasses.dataclass
class ResponsesCall:
    """One Responses request: ``turn`` is its input as chat messages (without the instructions),
    ``chat_options`` the rest of the chat body, ``echo`` the request fields the response object
    repeats (OpenAI's shape)."""

    model: str
    turn: list[dict]
    instructions: str | None
    chat_options: dict
    stream: bool
    store: bool
    previous_response_id: str | None
    logprobs: bool
    echo: dict


def _refuse(name: str, why: str = "is not supported by this server") -> Unprocessable:
    return Unprocessable(f"'{name}' {why}", param=name)


def _text_part(part: dict, param: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{param}.text must be a string", param=f"{param}.text")
    return text


def _content(content: Any, param: str) -> str | list[dict]:
    """A message's content as chat takes it: a string, or parts (text, image_url, input_audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or a list of content parts", param=param)
    parts: list[dict] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": _text_part(part, where)})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            if part.get("file_id") is not None:
                raise _refuse(f"{where}.file_id", "is not supported (no Files API here); send image_url")
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise BadRequest(f"{where}.image_url must be a URL string", param=f"{where}.image_url")
            if part.get("detail") not in (None, "auto"):
                raise _refuse(f"{where}.detail", "other than 'auto' is not supported")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "input_audio":
            audio = part.get("input_audio")
            if not isinstance(audio, dict):
                raise BadRequest(f"{where}.input_audio must be an object with data and format",
                                 param=f"{where}.input_audio")
            parts.append({"type": "input_audio", "input_audio": {"data": audio.get("data"),
                                                                 "format": audio.get("format")}})
        else:
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise Unprocessable(f"{where}: content part {shown!r} is not supported", param=f"{where}.type")
    return parts


def _arguments(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{param} must be a JSON string", param=param)
    try:
        json.loads(value or "{}")
    except ValueError:
        raise BadRequest(f"{param} is not valid JSON", param=param) from None
    return value


def _input_items(value: Any) -> list[dict]:
    """``input`` → chat messages (see the module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadRequest(f"{param}.role must be one of {', '.join(_ROLES)}", param=f"{param}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise BadRequest(f"{param} needs call_id and name strings", param=param)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _arguments(item.get("arguments"), f"{param}.arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)   # parallel calls of one turn: one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{param}.call_id must be a string", param=f"{param}.call_id")
            content = output if isinstance(output, str) else _content(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue   # earlier reasoning is not part of the prompt (as the chat template drops it)
        else:
            raise Unprocessable(f"{param}: input item type {kind!r} is not supported", param=f"{param}.type")
    if not messages:
        raise BadRequest("'input' holds no message", param="input")
    return messages


def _tools(body: dict) -> dict:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` in chat's spelling (checked there)."""
    out: dict = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list", param="tools")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise Unprocessable(f"tools[{i}]: tool type {kind!r} is not supported (function tools are)",
                                    param=f"tools[{i}].type")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            chat_tools.append({"type": "function", "function": function})
        out["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise Unprocessable(f"tool_choice type {choice.get('type')!r} is not supported", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _text_format(body: dict) -> dict:
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise _refuse("text.verbosity", "other than 'medium' is not supported")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest("'text.format' must be an object with a 'type'", param="text.format")
    if fmt["type"] == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {"response_format": {"type": fmt["type"]}}


def _logprobs(body: dict) -> tuple[bool, dict]:
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise BadRequest("'include' must be a list of strings", param="include")
    other = [x for x in include if x != LOGPROBS_INCLUDE]
    if other:
        raise Unprocessable(f"include {other[0]!r} is not supported (only {LOGPROBS_INCLUDE!r})", param="include")
    top = body.get("top_logprobs")
    # top_logprobs alone asks for them too: accepting it without answering would ignore it.
    if LOGPROBS_INCLUDE not in include and top is None:
        return False, {}
    return True, {"logprobs": True, **({"top_logprobs": top} if top is not None else {})}


def parse_responses(body: Any) -> ResponsesCall:
    """Check ``body`` (400/422 naming the param) and translate it; nothing is tokenized here."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - _SERVED)
    if unknown:
        raise _refuse(unknown[0])
    for name, harmless in REFUSED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(h) and value == h for h in harmless):
            raise _refuse(name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    if "input" not in body:
        raise BadRequest("'input' is required", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest("'previous_response_id' must be a string", param="previous_response_id")
    for name in ("store", "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequest(f"'{name}' must be a boolean", param=name)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_obfuscation"}:
            raise _refuse("stream_options", "may only hold include_obfuscation")
        if stream_options.get("include_obfuscation"):
            raise _refuse("stream_options.include_obfuscation", "is not served (no obfuscation padding)")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise BadRequest(f"'metadata' must map at most {MAX_METADATA} string keys to strings", param="metadata")
    logprobs, logprob_options = _logprobs(body)
    tools = _tools(body)
    if logprobs and tools.get("tools") and tools.get("tool_choice") != "none":
        raise Unprocessable("logprobs are served for answers without tools", param="include")
    options = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            options[name] = body[name]
    if body.get("max_output_tokens") is not None:
        options["max_tokens"] = body["max_output_tokens"]
    options.update(tools)
    effort = _reasoning_effort(body)
    if effort is not None:
        options["reasoning_effort"] = effort
    options.update(_text_format(body))
    options.update(logprob_options)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "metadata": metadata or {}, "top_logprobs": body.get("top_logprobs"), "truncation": "disabled",
            "background": False, "reasoning": {"effort": effort, "summary": None} if effort else None,
            **{k: body.get(k) for k in HINTS}}
    return ResponsesCall(model=model, turn=_input_items(body["input"]), instructions=instructions,
                         chat_options=options, stream=bool(body.get("stream")), store=body.get("store") is not False,
                         previous_response_id=previous, logprobs=logprobs, echo=echo)


def _reasoning_effort(body: dict) -> str | None:
    """``reasoning.effort``, served as chat's ``reasoning_effort`` (checked there); a summary of the
    reasoning is not (the reasoning item carries the text itself)."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise BadRequest("'reasoning' must be an object", param="reasoning")
    for key, value in reasoning.items():
        if key != "effort" and value is not None:
            raise _refuse(f"reasoning.{key}")
    return reasoning.get("effort")


# Chat param → Responses param, for errors raised by the chat validation (first match wins).
_RENAMES = ((re.compile(r"^max_tokens"), "max_output_tokens"),
            (re.compile(r"^reasoning_effort"), "reasoning.effort"),
            (re.compile(r"^response_format\.json_schema"), "text.format"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^messages(\[\d+\])?"), "input"))


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat param (``messages[…]`` → ``input``: the message list also holds
    the stored history and instructions, so its index is not the input's)."""
    if not param:
        return param
    for pattern, replacement in _RENAMES:
        if pattern.search(param):
            return pattern.sub(replacement, param, count=1)
    return param
