"""Validation of OpenAI request bodies into a typed :class:`GenerationRequest`.

Every check raises :class:`~omnirelay.errors.BadRequest` (400) naming the offending ``param``, so a
bad request gets an OpenAI-style body before anything is submitted. A well-formed request for
something we do not do yet gets :class:`~omnirelay.errors.Unprocessable` (422) when it would change
the answer (non-text content, logprobs of a spoken answer, ``n`` > 1 with a spoken answer, and every
option of :data:`NOT_SERVED`), never a 200 that ignored it. Hints that cannot change the answer's tokens
(``user``, ``metadata``, ``store``, ``service_tier``, ``prediction``, ``prompt_cache_key``,
``safety_identifier``) are accepted and ignored. ``priority`` (vLLM's: lower first) is served under
``--scheduling-policy priority`` and a 400 otherwise unless 0 (omnirelay/scheduling.py).

Logprobs, as OpenAI spells them: chat takes ``logprobs: true`` and optionally ``top_logprobs``
(0 … :data:`MAX_TOP_LOGPROBS`, only with ``logprobs: true``); completions take ``logprobs: k``
(0 … :data:`MAX_TOP_LOGPROBS`). Both become :attr:`GenerationRequest.logprobs` (-1: off; k: the
chosen token's and the top k), which travels as ``TextParams.logprobs`` (omnirelay/request_params.py).

Choices: ``n`` (1 … :data:`MAX_CHOICES`) per prompt; ``/v1/completions`` takes ``prompt`` as vLLM
does — a string, a list of token ids, or a list of several of either (one set of ``n`` choices per
prompt, at most :data:`MAX_CHOICES` choices in all) — and ``echo``. gateway/routes/choices.py serves them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from omnirelay.request_params import MAX_CACHE_SALT_CHARS, MAX_LOGPROB_TOKEN_IDS, MAX_TOP_LOGPROBS, StructuredOutput
from omnirelay.errors import BadRequest, Unprocessable
from omnirelay.scheduling import PRIORITY_MAX, PRIORITY_MIN

from .output_options import OutputOptions, boolean_field, parse_output_options
from .sampling_options import SamplingOptions, out_of_range, parse_options
from .spoken_answers import audio_reference
from .structured import ToolsRequest, parse_structured

# OpenAI's message roles. Any other non-empty string goes to the chat template as vLLM passes it (the
# template decides what it means, or refuses it: a 400); the gateway logs it once (ModelRuntime.render_chat).
STANDARD_ROLES = ("system", "user", "assistant", "tool", "developer")
# Choices in one request (n, times the prompts of a batched /v1/completions): each holds a decode slot
# and its KV, so one request cannot take a whole decode batch.
MAX_CHOICES = 16
SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1


@dataclasses.dataclass(frozen=True)
class TemplateOptions:
    """How a request's messages become its prompt (vLLM's names): ``kwargs`` (``chat_template_kwargs``,
    over the server's defaults), ``add_generation_prompt``, ``continue_final_message`` (the last
    message is left open for the model to continue), ``add_special_tokens`` (the tokenizer's, on top
    of the template's), ``chat_template`` (a request's own template; None: the model's). ``implied``:
    variables other request fields imply (``reasoning_effort``, :func:`implied_variables`), given
    to the template only where it reads them and ``kwargs`` do not set them (vLLM's rule)."""

    kwargs: dict = dataclasses.field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    implied: dict = dataclasses.field(default_factory=dict)


# vLLM's (and OpenAI's) reasoning_effort values; "none" turns thinking off.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def implied_variables(body: dict) -> dict:
    """The chat-template variables ``reasoning_effort`` implies, as vLLM renders it: the value
    itself as ``reasoning_effort`` (templates that grade their thinking read it) and, unless the
    request's ``chat_template_kwargs`` set it, ``enable_thinking`` (false for ``"none"``, true
    otherwise): what switches Qwen3's thinking, so the effort does change a Qwen3 answer."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return {}
    if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
        raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    model: str
    kind: str                                # "chat" | "completion"
    messages: list[dict] | None              # chat
    prompt: str | None                       # completion, text prompt
    prompt_token_ids: list[int] | None       # completion, token prompt
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    modalities: tuple[str, ...] = ("text",)   # chat: ("text", "audio") asks for speech too
    audio: dict | None = None                 # chat with audio: {"voice": str, "format": wav|pcm16|flac}
    logprobs: int = -1                        # -1: none; k >= 0: each token's logprob and the top k
    options: SamplingOptions = SamplingOptions()   # penalties, logit_bias, min_p/min_tokens, … (sampling_options.py)
    n: int = 1                                # choices per prompt (gateway/routes/choices.py fans them out)
    echo: bool = False                        # completions: the prompt's text before each choice's
    prompts: tuple[str | tuple[int, ...], ...] = ()   # completions given several prompts (prompt/
                                                      # prompt_token_ids then hold the first)
    structured: StructuredOutput | None = None   # the answer must match this grammar (gateway/structured.py)
    tools: ToolsRequest | None = None             # chat: tools, tool_choice (gateway/tool_calls.py)
    template: TemplateOptions = TemplateOptions()   # chat: template switches; completions: add_special_tokens
    include_reasoning: bool = True                # chat: return a thinking model's reasoning (gateway/reasoning.py)
    continuous_usage: bool = False                # stream: usage so far on every chunk (stream_options)
    priority: int = 0                             # lower first under --scheduling-policy priority
    output: OutputOptions = OutputOptions()       # vLLM's output knobs (gateway/output_options.py)
    prompt_logprobs: int = -1                     # k >= 0: the prompt tokens' logprobs (gateway/prompt_logprobs.py)
    logprob_token_ids: tuple[int, ...] = ()       # with logprobs: these ids' logprobs instead of the top k
    cache_salt: str = ""                          # salts the prompt's prefix-cache blocks (omnirelay/block_hash.py)



def template_options(body: dict) -> TemplateOptions:
    """The chat template switches of a chat or ``/tokenize`` body (400 naming a bad one). Whether a
    request's own ``chat_template`` is admitted is the server's call (:func:`check_request_template`)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    continue_final = boolean_field(body, "continue_final_message")
    # Continuing the last message leaves no room for a generation prompt: that is the default then.
    generation_prompt = boolean_field(body, "add_generation_prompt", not continue_final)
    if generation_prompt and continue_final:
        raise BadRequest("cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
                         param="continue_final_message")
    chat_template = body.get("chat_template")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise BadRequest("'chat_template' must be a non-empty string (a Jinja template)", param="chat_template")
    return TemplateOptions(dict(kwargs), generation_prompt, continue_final,
                           boolean_field(body, "add_special_tokens"), chat_template, implied_variables(body))


def check_request_template(template: TemplateOptions, trusted: bool) -> None:
    """422 for a request's own ``chat_template`` unless the server trusts them
    (``--trust-request-chat-template``: the template is code the gateway runs, in Jinja's sandbox)."""
    if template.chat_template is not None and not trusted:
        raise Unprocessable("a request's own 'chat_template' needs the server flag --trust-request-chat-template",
                            param="chat_template")


# Chat audio formats (OpenAI's names) → the speech worker's encodings; mp3/opus/aac need an encoder
# this build does not ship.
CHAT_AUDIO_FORMATS = {"wav": "wav", "pcm16": "pcm", "flac": "flac"}


def _chat_audio(body: dict) -> dict:
    """``modalities`` and ``audio`` of a chat request (OpenAI's audio output)."""
    modalities = body.get("modalities")
    if modalities is None:
        modalities = ["text"]
    if not isinstance(modalities, list) or not modalities \
            or not all(isinstance(m, str) and m in ("text", "audio") for m in modalities) or "text" not in modalities:
        raise BadRequest("'modalities' must be [\"text\"] or [\"text\", \"audio\"]", param="modalities")
    audio = body.get("audio")
    if "audio" not in modalities:
        if audio is not None:
            raise BadRequest("'audio' is only valid with modalities [\"text\", \"audio\"]", param="audio")
        return {"modalities": ("text",)}
    if not isinstance(audio, dict) or not isinstance(audio.get("voice"), str) or not audio["voice"]:
        raise BadRequest("audio output needs 'audio': {\"voice\": …, \"format\": …}", param="audio")
    fmt = audio.get("format", "wav")
    if not isinstance(fmt, str) or fmt not in CHAT_AUDIO_FORMATS:
        raise BadRequest(f"audio.format {fmt!r} is not supported; use one of {', '.join(CHAT_AUDIO_FORMATS)}",
                         param="audio.format")
    return {"modalities": ("text", "audio"), "audio": {"voice": audio["voice"], "format": fmt}}


# Options of OpenAI's or vLLM's request that would change the answer but that this build does not
# serve (yet): name → the values that change nothing, accepted like an absent option or null. Any
# other value answers 422 naming the option. Implementing one means removing its entry here. Served
# and so gone from here: the chat-template switches (chat_template_kwargs, add_generation_prompt,
# continue_final_message, add_special_tokens, chat_template behind --trust-request-chat-template:
# TemplateOptions), include_reasoning (gateway/reasoning.py) and vLLM's output knobs
# (include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
# truncate_prompt_tokens, return_tokens_as_token_ids: gateway/output_options.py), prompt_logprobs and
# completions' echo with logprobs (gateway/prompt_logprobs.py), cache_salt (omnirelay/block_hash.py) and reasoning_effort
# (chat: the template variables it implies, implied_variables; a Qwen3 answer thinks or not by it).
NOT_SERVED: dict[str, tuple] = {
    # sampling (the served options: sampling_options.py)
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "logits_processors": ([],),
    # structured outputs and tools: served (gateway/structured.py) but for the deprecated functions API
    "functions": ([],),
    "function_call": ("none",),
    # what the prompt or the answer's text is made of
    "suffix": ("",),
    "prompt_embeds": ([],),
    "web_search_options": (),
}


def _not_served(body: dict) -> None:
    """422 for the first :data:`NOT_SERVED` option ``body`` sets to a value that changes the answer.
    A harmless value must match in type too (``False`` is not ``0``)."""
    for name, harmless in NOT_SERVED.items():
        value = body.get(name)
        if value is None or any(type(value) is type(h) and value == h for h in harmless):
            continue
        raise Unprocessable(f"'{name}' is not supported by this server", param=name)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if not lo <= value <= hi:
        raise out_of_range(name, value, lo, hi)
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if lo is not None and value < lo:
        raise out_of_range(name, value, lo)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if len(value) > 16:
        raise BadRequest("'stop' accepts at most 16 strings", param="stop")
    return tuple(s for s in value if s)


def token_ids_field(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise BadRequest(f"'{name}' must be a list of non-negative integers", param=name)
    return tuple(value)


# Media parts, checked for shape here; decoded by gateway/media.py for models that take media, 422
# for the others (generation.prepare). field → the keys its object must hold as strings.
_MEDIA_PARTS = {"image_url": ("url",), "input_audio": ("data", "format"), "audio_url": ("url",)}


def _media_part(part: dict, param: str) -> dict:
    kind = part["type"]
    body = part.get(kind)
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in _MEDIA_PARTS[kind]):
        raise BadRequest(f"{param}.{kind} must be an object with string {' and '.join(_MEDIA_PARTS[kind])}",
                         param=param)
    return {"type": kind, kind: {k: body[k] for k in _MEDIA_PARTS[kind]}}


def _content_text(content: Any, index: int) -> str | list[dict]:
    """The message's text, or (when it has media parts) its parts: text and media, in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in _MEDIA_PARTS:
                parts.append(_media_part(part, f"messages[{index}].content[{j}]"))
                continue
            if kind != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise Unprocessable(f"messages[{index}].content: unsupported part {kind!r} (this model takes text)",
                                 param=f"messages[{index}].content")
            parts.append({"type": "text", "text": part["text"]})
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return parts
    if content is None:
        return ""
    raise BadRequest(f"messages[{index}].content must be a string or a list of parts",
                     param=f"messages[{index}].content")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"messages[{i}].role must be a non-empty string (e.g. {', '.join(STANDARD_ROLES)})",
                             param=f"messages[{i}].role")
        out.append({"role": role, "content": _content_text(message.get("content"), i), **_tool_fields(message, i)})
        audio_id = audio_reference(message, i)   # an earlier spoken answer: its transcript goes in (spoken_answers.py)
        if audio_id is not None:
            out[-1]["audio_id"] = audio_id
    return out


def _tool_fields(message: dict, index: int) -> dict:
    """An assistant message's ``tool_calls`` (arguments parsed: chat templates render objects) and
    a tool message's ``tool_call_id``/``name``, as the chat template takes them."""
    out: dict = {}
    calls = message.get("tool_calls")
    if calls is not None and message["role"] == "assistant":
        param = f"messages[{index}].tool_calls"
        if not isinstance(calls, list):
            raise BadRequest(f"{param} must be a list", param=param)
        out["tool_calls"] = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments", "{}"), str):
                raise BadRequest(f"{param}: each call needs function.name and function.arguments (a JSON string)",
                                 param=param)
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                raise BadRequest(f"{param}: function.arguments is not valid JSON", param=param) from None
            out["tool_calls"].append({"id": str(call.get("id", "")), "type": "function",
                                      "function": {"name": function["name"], "arguments": arguments}})
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    # An earlier answer's reasoning (vLLM's 'reasoning', its older 'reasoning_content'), under the name
    # chat templates read (Qwen3's drops it from turns before the last user message).
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if message["role"] == "assistant" and reasoning is not None:
        if not isinstance(reasoning, str):
            raise BadRequest(f"messages[{index}].reasoning must be a string", param=f"messages[{index}].reasoning")
        out["reasoning_content"] = reasoning
    return out


def _common(body: dict) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    _not_served(body)
    n = _integer(body, "n", 1, 1)
    if n > MAX_CHOICES:
        raise BadRequest(f"'n' must be at most {MAX_CHOICES}, got {n}", param="n")
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    max_tokens = _integer(body, "max_tokens", max_tokens, 1)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    stream = boolean_field(body, "stream")
    if stream_options and not stream:   # vLLM's rule: an empty object passes
        raise BadRequest("'stream_options' can only be given with 'stream': true", param="stream_options")
    include_usage = bool(stream_options and boolean_field(stream_options, "include_usage"))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", param="seed")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:   # vLLM's: a 64-bit signed integer
        raise out_of_range("seed", seed, SEED_MIN, SEED_MAX)
    return dict(
        model=model, max_tokens=max_tokens, options=parse_options(body),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_integer(body, "top_k", 0, -1), seed=seed, stop=_stop(body),
        stop_token_ids=token_ids_field(body.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=boolean_field(body, "ignore_eos"), stream=stream,
        include_usage=include_usage,
        # vLLM: usage on every chunk, only together with include_usage
        continuous_usage=include_usage and boolean_field(stream_options, "continuous_usage_stats"),
        return_token_ids=boolean_field(body, "return_token_ids"), n=n, priority=_priority(body),
        output=parse_output_options(body), prompt_logprobs=_prompt_logprobs(body, stream),
        cache_salt=_cache_salt(body))


def _prompt_logprobs(body: dict, stream: bool) -> int:
    """vLLM's ``prompt_logprobs`` (-1 when absent): k alternatives per prompt position, at most
    :data:`MAX_TOP_LOGPROBS`; vLLM's -1 (the whole vocabulary per position) is not served."""
    value = _integer(body, "prompt_logprobs", None)
    if value is None:
        return -1
    if value == -1:
        raise Unprocessable(f"'prompt_logprobs': -1 (every token of the vocabulary at every position) is not served; "
                            f"ask for at most {MAX_TOP_LOGPROBS}", param="prompt_logprobs")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise out_of_range("prompt_logprobs", value, 0, MAX_TOP_LOGPROBS)
    if stream:   # vLLM's rule
        raise BadRequest("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    return value


def _cache_salt(body: dict) -> str:
    """vLLM's ``cache_salt``: a non-empty string that salts the prompt's prefix-cache blocks."""
    value = body.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return value


def _priority(body: dict) -> int:
    """vLLM's ``priority`` (any int64; whether the server serves it is checked by
    :func:`check_priority`)."""
    value = _integer(body, "priority", 0)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise out_of_range("priority", value, PRIORITY_MIN, PRIORITY_MAX)
    return value


def check_priority(priority: int, policy: str) -> None:
    """A non-zero ``priority`` needs ``--scheduling-policy priority``: a 400 otherwise, as vLLM's."""
    if priority and policy != "priority":
        raise BadRequest(f"Got priority {priority} but Priority scheduling is not enabled "
                         "(this server runs --scheduling-policy fcfs)", param="priority")


def _top_logprobs_count(body: dict, name: str) -> int | None:
    value = _integer(body, name, None, 0)
    if value is not None and value > MAX_TOP_LOGPROBS:
        raise out_of_range(name, value, 0, MAX_TOP_LOGPROBS)
    return value


def _chat_logprobs(body: dict) -> int:
    """``logprobs: true`` (+ ``top_logprobs``) → the count of alternatives; -1 when not asked."""
    top = _top_logprobs_count(body, "top_logprobs")
    if not boolean_field(body, "logprobs"):
        if top is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return -1
    return top or 0


def _logprob_token_ids(body: dict, logprobs: int) -> tuple[int, ...]:
    """vLLM's ``logprob_token_ids``: each position reports these ids' logprobs instead of its top k
    (the sampled token's as always); needs logprobs, a non-empty list of at most
    :data:`MAX_LOGPROB_TOKEN_IDS` ids (the vocabulary is checked by generation.prepare)."""
    value = body.get("logprob_token_ids")
    if value is None:
        return ()
    ids = token_ids_field(value, "logprob_token_ids")
    if not ids or len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise BadRequest(f"'logprob_token_ids' must hold 1 to {MAX_LOGPROB_TOKEN_IDS} token ids",
                         param="logprob_token_ids")
    if logprobs < 0:
        raise BadRequest("when using 'logprob_token_ids', 'logprobs' must be set", param="logprob_token_ids")
    return ids


def parse_chat(body: Any) -> GenerationRequest:
    common = _common(body)
    logprobs = _chat_logprobs(body)
    common["logprob_token_ids"] = _logprob_token_ids(body, logprobs)
    audio = _chat_audio(body)
    if logprobs >= 0 and "audio" in audio["modalities"]:
        raise Unprocessable("logprobs are not available for a spoken answer (modalities with audio)",
                            param="logprobs")
    if common["continuous_usage"] and "audio" in audio["modalities"]:
        raise Unprocessable("stream_options.continuous_usage_stats is not served for a spoken answer "
                            "(modalities with audio)", param="stream_options.continuous_usage_stats")
    if common["n"] > 1 and "audio" in audio["modalities"]:
        raise Unprocessable("a spoken answer (modalities with audio) has one choice: n must be 1", param="n")
    if common["prompt_logprobs"] >= 0 and "audio" in audio["modalities"]:
        raise Unprocessable("prompt_logprobs are not served for a spoken answer (modalities with audio)",
                            param="prompt_logprobs")
    if boolean_field(body, "echo"):   # vLLM's chat echo (the last message again) is not served; completions' is
        raise Unprocessable("echo is served by /v1/completions, not chat", param="echo")
    structured, tools = parse_structured(body, "chat")
    if (structured or tools) and "audio" in audio["modalities"]:
        raise Unprocessable("structured outputs and tools are served for text answers (no audio)",
                            param="tools" if tools else "response_format")
    return GenerationRequest(kind="chat", messages=chat_messages(body), prompt=None, prompt_token_ids=None, **common,
                             **audio, logprobs=logprobs, structured=structured, tools=tools,
                             template=template_options(body),
                             include_reasoning=boolean_field(body, "include_reasoning", True))


def _prompts(body: dict) -> list[str | tuple[int, ...]]:
    """``prompt`` as vLLM takes it: a string, a list of token ids, or a list of several of those."""
    prompt = body.get("prompt")
    if prompt is None or prompt == "" or prompt == []:   # vLLM's words, which its clients match
        raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty ('prompt': a non-empty "
                         "string, a list of token ids, or a list of those; prompt_embeds are not served)",
                         param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and not isinstance(prompt[0], (str, list))):
        prompt = [prompt]
    if not isinstance(prompt, list):
        raise BadRequest("'prompt' must be a non-empty string, a list of token ids, or a list of those",
                         param="prompt")
    prompts: list[str | tuple[int, ...]] = []
    for i, one in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(one, str) and one:
            prompts.append(one)
        elif isinstance(one, list) and one:
            prompts.append(token_ids_field(one, param))
        else:
            raise BadRequest(f"'{param}' must be a non-empty string or a non-empty list of token ids", param=param)
    return prompts


# Chat template switches a completions prompt has no use for: the values that change nothing pass.
_CHAT_ONLY = {"add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
              "chat_template_kwargs": ({},), "include_reasoning": (True,), "reasoning_effort": ()}


def parse_completion(body: Any) -> GenerationRequest:
    common = _common(body)
    for name, harmless in _CHAT_ONLY.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(h) and value == h for h in harmless):
            raise Unprocessable(f"'{name}' is a chat parameter; /v1/completions takes a prompt as it is", param=name)
    if body.get("top_logprobs") is not None:
        raise BadRequest("'top_logprobs' is a chat parameter; completions take 'logprobs': k", param="top_logprobs")
    logprobs = _top_logprobs_count(body, "logprobs")
    common["logprobs"] = -1 if logprobs is None else logprobs
    common["logprob_token_ids"] = _logprob_token_ids(body, common["logprobs"])
    common["echo"] = boolean_field(body, "echo")   # with logprobs: the prompt's too (gateway/prompt_logprobs.py)
    prompts = _prompts(body)
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts × n={common['n']} exceeds {MAX_CHOICES} choices", param="prompt")
    first = prompts[0]
    structured, _ = parse_structured(body, "completion")
    return GenerationRequest(kind="completion", messages=None, prompt=first if isinstance(first, str) else None,
                             prompt_token_ids=None if isinstance(first, str) else list(first),
                             prompts=tuple(prompts) if len(prompts) > 1 else (), **common, structured=structured,
                             template=TemplateOptions(add_special_tokens=boolean_field(body, "add_special_tokens")))
