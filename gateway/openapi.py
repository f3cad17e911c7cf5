"""The OpenAPI 3.0 document of the gateway (``GET /openapi.json``), kept beside the validators it
describes (``schema.py``, and the checks of ``speech.py``, ``images.py``, ``videos.py`` with their
``*_params`` objects): every bound and type here is one the validator enforces, so a client
generated from this document never sees a 400 for a request the document allows — except where the
prompt itself does not fit the model's context, which depends on tokenization, and for the few rules
across fields that OpenAPI 3.0 cannot state (each named in its field's description).

A route exists in the document only when some served model answers it: ``/v1/audio/speech`` and
chat's audio output with a model that has a talker and speakers, ``/v1/images/generations`` with a
text-to-image pipeline, ``/v1/videos`` with a text-to-video one.

Statuses: every route that reads a body may answer 408 (the body did not arrive in time) and 413;
every route that submits work may answer 502 (a transfer between stages kept failing; recoverable,
with Retry-After, like 429 and 503), 503, 504 and 507."""

from __future__ import annotations

import dataclasses

from omnirelay import __version__
from omnirelay import image_params as img
from omnirelay import speech_params as sp
from omnirelay import video_params as vid
from omnirelay.request_params import MAX_TOP_LOGPROBS
from omnirelay.gateway.sampling_options import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY
from omnirelay.gateway.schema import MAX_CHOICES
from omnirelay.gateway.request_body import INT64_MAX, INT64_MIN
from omnirelay.gateway.schema import NOT_SERVED   # options known but not served: 422

from .openapi_text_routes import responses_paths, transcription_paths


@dataclasses.dataclass(frozen=True)
class SpeechDoc:
    """What the served speech models accept, as ``gateway/routes/speech.py`` judges it (gathered by
    routes/service.py, so this builder needs no route module). models: their names; voices:
    the speakers all of them have (None: unknown here, the worker checks the voice); formats: the
    ``response_format`` values (``flac`` only with soundfile); max_input_chars: the bound of ``input``."""

    models: list[str]
    voices: list[str] | None
    formats: list[str]
    max_input_chars: int


# Statuses of a route that submits work to the cluster (chat, completions, speech, images).
_GENERATION_ERRORS = ("400", "401", "404", "408", "413", "422", "429", "500", "502", "503", "504", "507")
_ERROR_RESPONSE = {"description": "error (recoverable ones — 429, 502, 503 — carry Retry-After)",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        },
        "request_id": {"type": "string", "nullable": True},
        "stage": {"type": "string", "nullable": True},
    },
}

_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}],
         "nullable": True}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
# gateway/structured.py: at most one constraint per request; a spec xgrammar cannot compile is a 400.
_STRUCTURED = {
    "response_format": {"type": "object", "nullable": True, "description":
                        "{\"type\": \"text\" | \"json_object\" | \"json_schema\"}; json_schema takes "
                        "\"json_schema\": {\"name\", \"schema\"}: the answer matches the schema"},
    "structured_outputs": {"type": "object", "nullable": True, "description":
                           "vLLM's: exactly one of json (a schema), json_object (true), regex, choice "
                           "(strings), grammar (xgrammar EBNF, rule root)"},
    **{name: {"nullable": True, "description": f"vLLM's older spelling of structured_outputs.{key}"}
       for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar"))},
    "guided_decoding_backend": {"type": "string", "nullable": True,
                                "description": "xgrammar or auto (anything else: 422)"},
}
_TOOLS = {
    "tools": {"type": "array", "nullable": True, "items": {"type": "object", "description":
              "{\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}"}},
    "tool_choice": {"nullable": True, "description": "none | auto (default with tools: <tool_call> markup "
                    "parsed into tool_calls) | required (one call, grammar-constrained) | "
                    "{\"type\": \"function\", \"function\": {\"name\"}} (its arguments, grammar-constrained; "
                    "a name not in tools: 400)"},
    "parallel_tool_calls": {"type": "boolean", "nullable": True, "description": "false: auto keeps the first call"},
}
# Chat-template switches and reasoning (schema.py template_options; reasoning.py).
_TEMPLATE = {
    "chat_template_kwargs": {"type": "object", "nullable": True,
                             "description": "variables of the model's chat template, e.g. {\"enable_thinking\": false} "
                                            "(a name the template does not read is passed through unused, as vLLM does)"},
    "add_generation_prompt": {"type": "boolean", "nullable": True, "description": "default true"},
    "continue_final_message": {"type": "boolean", "nullable": True,
                               "description": "leave the last message open for the model to continue"},
    "add_special_tokens": {"type": "boolean", "nullable": True, "description": "default false"},
    "chat_template": {"type": "string", "nullable": True,
                      "description": "a Jinja template of the request's own (422 without --trust-request-chat-template)"},
    "include_reasoning": {"type": "boolean", "nullable": True,
                          "description": "a thinking model's reasoning in message.reasoning (default true)"},
    "reasoning_effort": {"type": "string", "nullable": True,
                         "enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max"],
                         "description": "given to the chat template as reasoning_effort, and enable_thinking = "
                                        "(value != none) unless chat_template_kwargs set it; each only where "
                                        "the template reads it"},
}
_TOOL_CALLS = {"type": "array", "nullable": True, "items": {"type": "object", "properties": {
    "index": {"type": "integer"}, "id": {"type": "string"}, "type": {"type": "string"},
    "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                  "arguments": {"type": "string"}}}}}}
# gateway/sampling_options.py; semantics and order: workers/llm/logits_processors.py (vLLM's).
_SAMPLING_OPTIONS = {
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True,
                         "description": "subtracted from the logit of every token already in the output"},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True,
                          "description": "times a token's count in the output, subtracted from its logit"},
    "repetition_penalty": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                           "maximum": MAX_REPETITION_PENALTY, "nullable": True,
                           "description": "divides the positive and multiplies the negative logits of every "
                                          "token of the prompt or the output (1: off)"},
    "logit_bias": {"type": "object", "nullable": True,
                   "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
                   "description": "token id (a string of digits; outside the vocabulary: 400) → added to its logit"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True,
              "description": "drops tokens less likely than min_p × the most likely one (after temperature)"},
    "min_tokens": {"type": "integer", "minimum": 0, "nullable": True,
                   "description": "EOS, stop_token_ids and stop strings do not end the answer before this many "
                                  "tokens (more than max_tokens: 400)"},
    "bad_words": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_BAD_WORDS,
                  "nullable": True, "description": "words the answer never contains (tokenized as vLLM does)"},
    "allowed_token_ids": {**_TOKEN_IDS, "minItems": 1, "nullable": True,
                          "description": "the only tokens the answer may contain (outside the vocabulary: 400)"},
}
_NOT_SERVED_NOTE = ("Options this server knows but does not serve answer 422 naming the option (never a 200 "
                    "that ignored it), unless set to a value that changes nothing: " + ", ".join(sorted(NOT_SERVED)))


def _sampling(max_model_len: int, models: list[str]) -> dict:
    return {
        "model": {"type": "string", "enum": models, "description": "an id from GET /v1/models (404 otherwise)"},
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": True,
                       "description": f"clamped to the room the prompt leaves in the context ({max_model_len} tokens), "
                                      "as vLLM does; a prompt that fills the context alone: 400"},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "minimum": 1e-9, "maximum": 1, "nullable": True},
        "top_k": {"type": "integer", "minimum": -1, "nullable": True},
        "seed": {"type": "integer", "nullable": True},
        "stop": _STOP,
        "stop_token_ids": {**_TOKEN_IDS, "nullable": True},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "return_token_ids": {"type": "boolean", "nullable": True},
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True,
                            "description": "the prompt tokens' raw logprobs and the k likeliest of each position "
                                           "(vLLM's list, first null: chat at the top level, completions per choice); "
                                           "not with stream (400); -1 (the whole vocabulary): 422"},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": 1024, "nullable": True,
                       "description": "salts the prompt's prefix-cache blocks: equal prompts with other salts "
                                      "share none"},
        # vLLM's output knobs (gateway/output_options.py)
        **{name: {"type": "boolean", "nullable": True} for name in (
            "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
            "return_tokens_as_token_ids")},
        "truncate_prompt_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len, "nullable": True,
                                   "description": "keep the last k prompt tokens (-1: the context length)"},
        **_SAMPLING_OPTIONS,
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "nullable": True,
              "description": "choices per prompt; with a seed, choice j samples with seed + j (vLLM's children); "
                             "usage counts the prompt once and sums the choices' tokens"},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
    }


_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {**{k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                         "prompt_tokens_details": {
                             "type": "object", "nullable": True,
                             "description": "cached_tokens: prompt tokens taken from the prefix cache (null without "
                                            "--enable-prompt-tokens-details)",
                             "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}}}


def _completion_response(choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                           "usage": _USAGE}}


def _responses(ok: dict) -> dict:
    out = {"200": {"description": "completion (JSON, or an SSE stream when stream=true)",
                   "content": {"application/json": {"schema": ok},
                               "text/event-stream": {"schema": _SSE_EVENT}}}}
    return {**out, **_errors(*_GENERATION_ERRORS)}


# One event of a stream (the schema applies per event): its data is a chunk object as JSON, the
# error body when the request failed after the headers went out, or the final ``[DONE]``.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk (JSON), an error body (JSON) or [DONE]"},
    "event": {"type": "string"}}}


def _errors(*statuses: str) -> dict:
    return {status: _ERROR_RESPONSE for status in statuses}


def _tokenizer_paths(models: list[str], vocab_size: int | None) -> dict:
    """vLLM's /tokenize and /detokenize (gateway/routes/tokenization.py): the served model's tokenizer."""
    model = {"type": "string", "enum": models, "description": "optional when one language model is served"}
    flag = {"type": "boolean", "nullable": True}
    text_message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "minLength": 1},
        "content": {"type": "string", "nullable": True}}}
    tokenize_request = {"oneOf": [
        {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
            "model": model, "prompt": {"type": "string"},
            "add_special_tokens": {**flag, "description": "default true"}, "return_token_strs": flag}},
        {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
            "model": model, "messages": {"type": "array", "minItems": 1, "items": text_message},
            "add_generation_prompt": {**flag, "description": "default true; the count is then the chat "
                                                             "request's usage.prompt_tokens"},
            "continue_final_message": {**flag, "description": "default false; only without a generation prompt "
                                                              "(which it then turns off by default)"},
            "add_special_tokens": {**flag, "description": "default false"}, "return_token_strs": flag},
         "not": {"required": ["add_generation_prompt", "continue_final_message"], "properties": {
             "add_generation_prompt": {"enum": [True]}, "continue_final_message": {"enum": [True]}}}}]}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0,
                                      **({"maximum": vocab_size - 1} if vocab_size else {})}}
    tokenize_answer = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
        "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"}, "tokens": ids,
        "token_strs": {"type": "array", "items": {"type": "string"}, "nullable": True}}}
    detokenize_answer = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}

    def operation(name: str, request: dict, answer: dict) -> dict:
        return {"post": {"operationId": name,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                         "responses": {"200": {"description": name, "content": {"application/json": {
                             "schema": answer}}}, **_errors("400", "401", "404", "408", "413", "422")}}}

    return {"/tokenize": operation("tokenize", tokenize_request, tokenize_answer),
            "/detokenize": operation("detokenize", {
                "type": "object", "required": ["tokens"], "additionalProperties": False,
                "properties": {"model": model, "tokens": ids}}, detokenize_answer)}


def _size_pattern(max_side: int, multiple: int, auto: bool) -> str:
    """``WxH`` with each side a multiple of ``multiple`` up to ``max_side``: spelled out, so that a
    size the document allows is one the validator accepts (a regex cannot count in eights otherwise)."""
    side = "|".join(str(v) for v in range(multiple, max_side + 1, multiple))
    return f"^(({side})x({side}){'|auto' if auto else ''})$"


# Some character Python's str.strip() keeps (the validators strip before checking): ECMA's \s
# lacks \x1c-\x1f and \x85, which Python counts as white space.
_NOT_BLANK = "[^\\s\\x1c-\\x1f\\x85]"


_VIDEO_JOB = {
    "type": "object", "required": ["id", "object", "status", "progress", "model", "created_at", "size", "seconds"],
    "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": ["video"]},
        "status": {"type": "string", "enum": ["queued", "in_progress", "completed", "failed", "cancelled"]},
        "progress": {"type": "integer", "minimum": 0, "maximum": 100}, "model": {"type": "string"},
        "prompt": {"type": "string", "nullable": True}, "created_at": {"type": "integer"},
        "completed_at": {"type": "integer", "nullable": True}, "expires_at": {"type": "integer", "nullable": True},
        "size": {"type": "string"}, "seconds": {"type": "string"},
        "remixed_from_video_id": {"type": "string", "nullable": True},
        "error": {"type": "object", "nullable": True, "properties": {"code": {"type": "string"},
                                                                   "message": {"type": "string"}}}},
}


def _video_paths(models: list[str]) -> dict:
    """``/v1/videos`` (gateway/routes/videos.py): jobs, and ``/v1/videos/sync`` answering with the file.
    Bounds are VideoParams'; the ``openai`` client
    sends the same fields as a multipart form, which is accepted too (numbers as text)."""
    errors = _errors
    job = {"description": "the video job", "content": {"application/json": {"schema": _VIDEO_JOB}}}
    video_id = [{"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    create = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": vid.MAX_PROMPT_CHARS, "pattern": _NOT_BLANK},
        "model": {"type": "string", "enum": models, "description": "optional when one video model is served"},
        "size": {"type": "string", "pattern": _size_pattern(vid.MAX_SIDE, vid.SIZE_MULTIPLE, auto=True),
                 "description": f"WxH, multiples of {vid.SIZE_MULTIPLE}, each side at most {vid.MAX_SIDE} (default or 'auto': the "
                                "model's native size)"},
        "seconds": {"type": "string", "pattern": "^([1-9]|1[0-9]|2[0-9]|30)$",
                    "description": f"clip length (default 4); seconds x fps must stay within {vid.MAX_FRAMES} frames "
                                   "unless num_frames is given (400 otherwise)"},
        "fps": {"type": "integer", "minimum": 1, "maximum": vid.MAX_FPS, "description": "default 8"},
        "num_frames": {"type": "integer", "minimum": 1, "maximum": vid.MAX_FRAMES, "description": "default seconds x fps"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": vid.MAX_STEPS},
        "guidance_scale": {"type": "number", "minimum": 0, "maximum": vid.MAX_GUIDANCE},
        "negative_prompt": {"type": "string", "maxLength": vid.MAX_PROMPT_CHARS},
        "seed": {"type": "integer", "minimum": 0, "maximum": vid.MAX_SEED}}}
    listing = {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"type": "string"}, "data": {"type": "array", "items": _VIDEO_JOB}, "has_more": {"type": "boolean"},
        "first_id": {"type": "string", "nullable": True}, "last_id": {"type": "string", "nullable": True}}}
    file = {"description": "the file (MP4; animated WebP where the worker has no MP4 encoder)", "content": {
        "video/mp4": {"schema": {"type": "string", "format": "binary"}},
        "image/webp": {"schema": {"type": "string", "format": "binary"}}}}
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}}
    return {
        "/v1/videos": {
            "post": {"operationId": "createVideo", "requestBody": {"required": True, "content": {
                "application/json": {"schema": create}}},
                # The job runs after the answer: its failures (502, 503, 504 …) land in the job's error.
                "responses": {"200": job, **errors("400", "401", "404", "408", "413", "422", "429", "500")}},
            "get": {"operationId": "listVideos", "parameters": [
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}}],
                "responses": {"200": {"description": "jobs, newest first by default", "content": {
                    "application/json": {"schema": listing}}}, **errors("400", "401", "404")}}},
        "/v1/videos/sync": {
            "post": {"operationId": "createVideoSync", "requestBody": {"required": True, "content": {
                "application/json": {"schema": create}}},
                "responses": {"200": file, **errors("400", "401", "404", "408", "413", "422", "429", "500", "502",
                                                    "503", "504", "507")}}},
        "/v1/videos/{video_id}": {
            "get": {"operationId": "retrieveVideo", "parameters": video_id,
                    "responses": {"200": job, **errors("401", "404")}},
            "delete": {"operationId": "deleteVideo", "parameters": video_id, "responses": {
                "200": {"description": "cancelled (unfinished) or removed (finished)",
                        "content": {"application/json": {"schema": deleted}}}, **errors("401", "404")}}},
        "/v1/videos/{video_id}/content": {
            "get": {"operationId": "downloadVideoContent", "parameters": video_id + [
                {"name": "variant", "in": "query", "schema": {"type": "string", "enum": ["video"]}}],
                "responses": {"200": file, **errors("401", "404", "422")}}},
    }


def _speech_paths(speech: SpeechDoc) -> dict:
    """``POST /v1/audio/speech`` (gateway/routes/speech.py: ``audio_speech``)."""
    request = {"type": "object", "required": ["model", "input", "voice"], "properties": {
        "model": {"type": "string", "enum": speech.models},
        "input": {"type": "string", "minLength": 1, "maxLength": speech.max_input_chars, "pattern": _NOT_BLANK,
                  "description": "the text to speak; with its prompt it must fit the model's context (400 "
                                 "otherwise)"},
        "voice": _voice(speech),
        "response_format": {"type": "string", "enum": speech.formats, "nullable": True,
                            "description": "default wav (mp3, opus, aac: 400, no encoder here)"},
        "speed": {"type": "number", "minimum": sp.MIN_SPEED, "maximum": sp.MAX_SPEED,
                  "description": "playback speed (default 1; resampled, so the pitch moves with it)"},
        "seed": {"type": "integer", "minimum": 0, "maximum": sp.MAX_SEED, "nullable": True,
                 "description": "extension: the talker's and vocoder's random seed (default: chosen per request)"},
        "max_audio_tokens": {"type": "integer", "minimum": 0, "maximum": sp.MAX_CODES,
                             "description": "extension: the talker's codec-token budget (0, the default: in "
                                            "proportion to the text)"},
        "stream_format": {"type": "string", "enum": ["sse", "audio"], "nullable": True,
                          "description": "stream while the talker speaks: 'audio', the file as a chunked body; "
                                         "'sse', text/event-stream events (flac: its bytes come at the end)"}}}
    mimes = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
    audio = {"description": "the audio file (pcm: raw 16-bit little-endian mono); with stream_format 'sse' "
                            "speech.audio.delta events, then speech.audio.done", "content": {
        **{mimes[fmt]: {"schema": {"type": "string", "format": "binary"}} for fmt in speech.formats},
        "text/event-stream": {"schema": {"type": "string", "description": _SPEECH_EVENTS}}}}
    return {"/v1/audio/speech": {"post": {
        "operationId": "createSpeech",
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": audio, **_errors(*_GENERATION_ERRORS)}}}, **_voice_paths(speech)}


def _voice_paths(speech: SpeechDoc) -> dict:
    """``/v1/audio/voices`` (gateway/routes/voices.py). The served families clone no voice: a well-formed
    upload is a 422 naming ``model``, and a preset voice cannot be deleted (422)."""
    voice = {"type": "object", "required": ["id", "object", "name", "model", "type"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "name": {"type": "string"},
        "model": {"type": "string"}, "type": {"type": "string", "enum": ["preset"]}}}
    listing = {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string"}, "data": {"type": "array", "items": voice}}}
    upload = {"type": "object", "required": ["model", "name", "file"], "properties": {
        "model": {"type": "string", "enum": speech.models},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "file": {"type": "string", "format": "binary", "description": "a WAV reference clip, at most 60 s"},
        "transcript": {"type": "string", "description": "what the clip says"}}}
    return {
        "/v1/audio/voices": {
            "get": {"operationId": "listVoices", "parameters": [
                {"name": "model", "in": "query", "schema": {"type": "string", "enum": speech.models}}],
                "responses": {"200": {"description": "the voices of each speech model", "content": {
                    "application/json": {"schema": listing}}}, **_errors("401", "404")}},
            "post": {"operationId": "createVoice", "requestBody": {"required": True, "content": {
                "multipart/form-data": {"schema": upload}}},
                "responses": _errors("400", "401", "404", "413", "422")}},
        "/v1/audio/voices/{name}": {
            "delete": {"operationId": "deleteVoice", "parameters": [
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": _errors("401", "404", "422")}},
    }


_SPEECH_EVENTS = (
    'lines "data: <json>": {"type": "speech.audio.delta", "audio": <base64 of the next bytes of the file>} '
    'per chunk, then {"type": "speech.audio.done", "usage": {"input_tokens", "output_tokens" (the talker\'s '
    'codec tokens), "total_tokens"}}; a failure after the first event ends the stream with '
    '{"type": "error", "error": {...}, "request_id", "stage"}')


def _voice(speech: SpeechDoc) -> dict:
    if speech.voices:
        return {"type": "string", "enum": speech.voices, "description": "a speaker of the model"}
    return {"type": "string", "minLength": 1, "description": "a speaker of the model (others: 400)"}


def _image_paths(models: list[str]) -> dict:
    """``POST /v1/images/generations`` (gateway/routes/images.py: ``parse_image_request``, ImageParams)."""
    request = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": img.MAX_PROMPT_CHARS, "pattern": _NOT_BLANK},
        "model": {"type": "string", "enum": models, "description": "optional when one image model is served"},
        "n": {"type": "integer", "minimum": 1, "maximum": img.MAX_IMAGES, "nullable": True},
        "size": {"type": "string", "nullable": True, "pattern": _size_pattern(img.MAX_SIDE, img.SIZE_MULTIPLE, auto=True),
                 "description": f"WxH, multiples of {img.SIZE_MULTIPLE}, each side at most {img.MAX_SIDE} (default "
                                "or 'auto': the model's native size; a model may refuse sizes its VAE cannot make)"},
        "response_format": {"type": "string", "enum": ["b64_json"], "nullable": True,
                            "description": "'url' is 422: images are not stored"},
        "output_format": {"type": "string", "enum": ["png"], "nullable": True},
        "stream": {"type": "boolean", "enum": [False], "nullable": True},
        "negative_prompt": {"type": "string", "maxLength": img.MAX_PROMPT_CHARS, "nullable": True},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": img.MAX_STEPS, "nullable": True,
                                "description": "absent: the pipeline's default (Z-Image-Turbo: 9)"},
        "guidance_scale": {"type": "number", "minimum": 0, "maximum": img.MAX_GUIDANCE, "nullable": True},
        "seed": {"type": "integer", "minimum": 0, "maximum": img.MAX_SEED - img.MAX_IMAGES, "nullable": True,
                 "description": "image k uses seed + k (default: chosen per request)"}}}
    response = {"type": "object", "required": ["created", "data"], "properties": {
        "created": {"type": "integer"}, "output_format": {"type": "string", "enum": ["png"]},
        "data": {"type": "array", "items": {"type": "object", "required": ["b64_json"], "properties": {
            "b64_json": {"type": "string", "description": "a PNG, base64"}}}}}}
    edit = {"type": "object", "required": ["image", "prompt"], "properties": {
        **{k: v for k, v in request["properties"].items() if k not in ("stream", "output_format")},
        "image": {"type": "string", "format": "binary", "description": "the image to edit: PNG, JPEG or WebP"},
        "mask": {"type": "string", "format": "binary",
                 "description": "a PNG with alpha, the image's size: its transparent pixels are repainted"},
        "strength": {"type": "number", "minimum": 0, "maximum": 1,
                     "description": "how far the input is noised (default 0.8; with a mask 1)"}}}
    images = {"description": "the images", "content": {"application/json": {"schema": response}}}
    return {"/v1/images/generations": {"post": {
        "operationId": "createImage",
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": images, **_errors(*_GENERATION_ERRORS)}}},
        "/v1/images/edits": {"post": {
            "operationId": "createImageEdit",
            "description": "Stable Diffusion pipelines only (422 for a model that cannot edit); size defaults to "
                           "the input's, rounded down to the model's size multiple",
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": edit}}},
            "responses": {"200": images, **_errors(*_GENERATION_ERRORS)}}}}


def _chat_output(speech: SpeechDoc | None) -> dict:
    """``modalities`` and ``audio`` of a chat request (schema.py: ``_chat_audio``)."""
    if speech is None:
        return {"modalities": {"type": "array", "enum": [["text"]], "nullable": True,
                               "description": "text only: no served model speaks"}}
    return {
        "modalities": {"type": "array", "enum": [["text"], ["text", "audio"], ["audio", "text"]], "nullable": True,
                       "description": "with audio, the answer is spoken too (needs 'audio', a model of "
                                      f"{', '.join(speech.models)}, max_tokens >= 2 and no 'stop'; 400/422 "
                                      "otherwise)"},
        "audio": {"type": "object", "nullable": True, "required": ["voice"], "properties": {
            "voice": _voice(speech),
            "format": {"type": "string", "enum": [f for f in ("wav", "pcm16", "flac")
                                                  if (f if f != "pcm16" else "pcm") in speech.formats],
                       "description": "default wav"}},
            "description": "only with modalities [\"text\", \"audio\"] (400 otherwise)"},
    }


_MESSAGE_AUDIO = {"type": "object", "nullable": True, "required": ["id", "data", "transcript", "expires_at"],
                  "properties": {"id": {"type": "string"}, "data": {"type": "string", "description": "base64 file"},
                                 "transcript": {"type": "string"}, "expires_at": {"type": "integer"}},
                  "description": "the spoken answer (modalities with audio); content is null then"}


# Logprobs (schema.py; routes/completions.py renders them): chat asks with logprobs/top_logprobs, completions with
# logprobs: k. A chat top_logprobs without logprobs: true is a 400, which no schema here rules out.
# vLLM's logprob_token_ids, described here rather than listed as a property: it needs logprobs (a 400
# otherwise), a dependency schemathesis would otherwise fill the request bodies with.
_NAMED_IDS = ("vLLM's logprob_token_ids (1 to 128 token ids, only with logprobs) reports those ids' "
              "logprobs at each position instead of the k most likely")
_CHAT_LOGPROBS_REQUEST = {
    "logprobs": {"type": "boolean", "nullable": True,
                 "description": "each generated token's log-probability under the model's raw distribution "
                                "(before temperature, top_p, top_k); 422 with audio output"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True,
                     "description": "also the most likely tokens of each position; needs logprobs: true (400). "
                                    + _NAMED_IDS}}
_COMPLETION_LOGPROBS_REQUEST = {
    "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True,
                 "description": "each generated token's raw log-probability and the k most likely tokens. "
                                + _NAMED_IDS}}
_TOKEN_LOGPROB = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": {
    "token": {"type": "string"}, "logprob": {"type": "number"},
    "bytes": {"type": "array", "items": {"type": "integer"}, "nullable": True}}}
_CHAT_LOGPROBS = {"type": "object", "nullable": True, "required": ["content"], "properties": {
    "content": {"type": "array", "nullable": True, "items": {**_TOKEN_LOGPROB, "required": [
        "token", "logprob", "bytes", "top_logprobs"], "properties": {
        **_TOKEN_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}}}}}}
_COMPLETION_LOGPROBS = {"type": "object", "nullable": True, "properties": {
    "tokens": {"type": "array", "items": {"type": "string"}},
    "token_logprobs": {"type": "array", "items": {"type": "number", "nullable": True},
                       "description": "echo: the prompt's first, null for its first token"},
    "top_logprobs": {"type": "array", "nullable": True,
                     "items": {"type": "object", "nullable": True, "additionalProperties": {"type": "number"}}},
    "text_offset": {"type": "array", "items": {"type": "integer"}}}}


def build_openapi(max_model_len: int, models: list[str], video_models: list[str] | None = None, *,
                  image_models: list[str] | None = None, speech: SpeechDoc | None = None,
                  vocab_size: int | None = None, hearing_models: list[str] | None = None) -> dict:
    """``models``: the served language models (chat, completions, responses); ``video_models``,
    ``image_models``, ``speech``, ``hearing_models`` (speech to text): the served models of each kind.
    A route is documented only when some model answers it (a gateway without one answers such
    requests 400/404/422). ``max_model_len`` and ``vocab_size``:
    the smallest of the language models (token ids at or above it are 400)."""
    sampling = _sampling(max_model_len, models)
    text_prompt = {"type": "string", "minLength": 1}
    token_prompt = {"type": "array", "minItems": 1, "items": {
        "type": "integer", "minimum": 0, **({"maximum": vocab_size - 1} if vocab_size else {})}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "minLength": 1,
                 "description": "system, user, assistant, tool or developer; another role goes to the chat "
                                "template as it is (vLLM's rule)"},
        "content": {"nullable": True, "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
        "tool_calls": _TOOL_CALLS, "tool_call_id": {"type": "string", "nullable": True},
        "audio": {"type": "object", "nullable": True, "required": ["id"],
                  "properties": {"id": {"type": "string", "minLength": 1}},
                  "description": "an assistant turn given by the id of an earlier spoken answer of this gateway "
                                 "(until its expires_at): it reads as that answer's transcript"},
    }}
    chat_request = {"type": "object", "required": ["model", "messages"], "properties": {
        **sampling, "messages": {"type": "array", "minItems": 1, "items": message}, **_chat_output(speech),
        **_CHAT_LOGPROBS_REQUEST, **_STRUCTURED, **_TOOLS, **_TEMPLATE}}
    completion_request = {"type": "object", "required": ["model", "prompt"], "properties": {
        **sampling, "prompt": {"oneOf": [text_prompt, token_prompt,
                                         {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                                          "items": {"oneOf": [text_prompt, token_prompt]}}],
                               "description": "one prompt, or a list of prompts: n choices each, choice "
                                              "index = prompt index × n + j (at most "
                                              f"{MAX_CHOICES} choices in all)"},
        "echo": {"type": "boolean", "nullable": True,
                 "description": "the prompt's text before each choice's text; with logprobs, the prompt's "
                                "token logprobs lead (the first null)"},
        **_COMPLETION_LOGPROBS_REQUEST, **_STRUCTURED}}
    chat_choice = {"type": "object", "properties": {
        "index": {"type": "integer"}, "finish_reason": {"type": "string", "nullable": True},
        "logprobs": _CHAT_LOGPROBS,
        "message": {"type": "object", "properties": {"role": {"type": "string"},
                                                     "content": {"type": "string", "nullable": True},
                                                     "audio": _MESSAGE_AUDIO,
                                                     "tool_calls": _TOOL_CALLS}}}}
    text_choice = {"type": "object", "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "logprobs": _COMPLETION_LOGPROBS,
        "finish_reason": {"type": "string", "nullable": True}}}
    json_body = lambda schema: {"required": True, "content": {"application/json": {"schema": schema}}}  # noqa: E731
    error_ref = {"$ref": "#/components/schemas/Error"}
    doc = {
        "openapi": "3.0.3",
        "info": {"title": "omnirelay gateway", "version": __version__,
                 "description": "OpenAI-compatible API of an omnirelay cluster."},
        "paths": {
            **({"/v1/chat/completions": {"post": {"operationId": "createChatCompletion", "description": _NOT_SERVED_NOTE,
                                                  "requestBody": json_body(chat_request),
                                                  "responses": _responses(_completion_response(chat_choice))}},
                "/v1/completions": {"post": {"operationId": "createCompletion", "description": _NOT_SERVED_NOTE,
                                             "requestBody": json_body(completion_request),
                                             "responses": _responses(_completion_response(text_choice))}}}
               if models else {}),
            **(_tokenizer_paths(models, vocab_size) if models else {}),
            **(responses_paths(models, max_model_len) if models else {}),
            **(transcription_paths(hearing_models) if hearing_models else {}),
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "served models", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"], "properties": {
                        "object": {"type": "string"},
                        "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"],
                                                            "properties": {"id": {"type": "string"},
                                                                           "object": {"type": "string"}}}}}}}}},
                "401": {"description": "error", "content": {"application/json": {"schema": error_ref}}}}}},
            **(_video_paths(video_models) if video_models else {}),
            **(_image_paths(image_models) if image_models else {}),
            **(_speech_paths(speech) if speech and speech.models else {}),
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "every role of every model has a live worker",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                "401": {"description": "error", "content": {"application/json": {"schema": error_ref}}},
                "503": {"description": "a role has no live worker",
                        "content": {"application/json": {"schema": error_ref}}}}}},
        },
        "components": {"schemas": {"Error": _ERROR, "BoundedValue": _BOUNDED_VALUE},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
    for path in doc["paths"].values():
        for operation in path.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                _bound_open_objects(body["schema"])
    return doc


# What any JSON value in a request body may be (gateway/request_body.py parse_json, for every route
# alike): integers within int64, nesting within the parser's bound. An object a schema leaves open
# (extra keys) takes such values, so the document promises no more than the parser accepts.
# (Not recursive: a schema generator such as schemathesis' spends minutes expanding a recursive one,
# and promising one level of nesting is promising no more than the parser accepts.)
_BOUNDED_SCALAR = [{"type": "string"}, {"type": "boolean"}, {"type": "number"},
                   {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}]
_BOUNDED_VALUE = {"nullable": True, "anyOf": [
    *_BOUNDED_SCALAR,
    {"type": "array", "items": {"anyOf": _BOUNDED_SCALAR}},
    {"type": "object", "additionalProperties": {"anyOf": _BOUNDED_SCALAR}}]}


def _bound_open_objects(schema) -> None:
    """Give every object schema under ``schema`` that allows extra keys bounded values for them."""
    if isinstance(schema, list):
        for item in schema:
            _bound_open_objects(item)
        return
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "object" and schema.get("additionalProperties", True) is True:
        schema["additionalProperties"] = {"$ref": "#/components/schemas/BoundedValue"}
    for key, value in schema.items():
        if key in ("properties",):
            for sub in value.values():
                _bound_open_objects(sub)
        elif key in ("items", "oneOf", "anyOf", "allOf", "additionalProperties", "not"):
            _bound_open_objects(value)
