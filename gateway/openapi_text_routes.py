"""The OpenAPI paths of ``/v1/responses`` (gateway/routes/responses.py) and the speech-to-text routes
(gateway/routes/transcriptions.py), for gateway/openapi.py's document, under its rule: every bound
and type here is one the validator enforces, so what the document allows is served (except a
prompt too long for the context, which depends on tokenization). Each request schema documents a
subset of what the route accepts (no tools' ``parameters`` schemas, no named ``tool_choice``, no
input items beyond messages with text): the rest is in the routes' docstrings.
"""

from __future__ import annotations

from omnirelay.request_params import MAX_TOP_LOGPROBS

from .responses_request import LOGPROBS_INCLUDE, MAX_METADATA

# routes/transcriptions.py's FORMATS (the document builder imports no route; tests/e2e/test_transcriptions.py
# checks that they agree).
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")

_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_SSE = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "one typed event (JSON), or [DONE] (speech to text)"},
    "event": {"type": "string"}}}
_NUMBER = {"type": "number", "nullable": True}


def _errors(*statuses: str) -> dict:
    return {status: {"description": "error", "content": {"application/json": {"schema": _ERROR_REF}}}
            for status in statuses}


_GENERATION_ERRORS = ("400", "401", "404", "408", "413", "422", "429", "500", "502", "503", "504", "507")
_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
             "properties": {
                 "id": {"type": "string"}, "object": {"type": "string", "enum": ["response"]},
                 "created_at": {"type": "number"}, "model": {"type": "string"},
                 "status": {"type": "string", "enum": ["completed", "incomplete", "failed", "in_progress"]},
                 "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                     "type": {"type": "string", "enum": ["message", "function_call", "reasoning"]}}}},
                 "previous_response_id": {"type": "string", "nullable": True},
                 "usage": {"type": "object", "nullable": True, "properties": {
                     k: {"type": "integer", "minimum": 0} for k in ("input_tokens", "output_tokens", "total_tokens")}}}}


def responses_paths(models: list[str], max_model_len: int) -> dict:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``."""
    text_part = {"type": "object", "required": ["type", "text"], "additionalProperties": False, "properties": {
        "type": {"type": "string", "enum": ["input_text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]}}}
    tool = {"type": "object", "required": ["type", "name"], "additionalProperties": False, "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"}}}
    request = {"type": "object", "required": ["model", "input"], "additionalProperties": False, "properties": {
        "model": {"type": "string", "enum": models, "description": "an id from GET /v1/models (404 otherwise)"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": message}]},
        "instructions": {"type": "string", "nullable": True,
                         "description": "a system message first; not carried to a follow-up"},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1, "nullable": True,
                              "description": "prompt tokens + max_output_tokens must fit the context (400)"},
        "temperature": {**_NUMBER, "minimum": 0, "maximum": 2},
        "top_p": {**_NUMBER, "minimum": 1e-9, "maximum": 1},
        "stream": {"type": "boolean", "nullable": True},
        "store": {"type": "boolean", "nullable": True,
                  "description": "default true: kept in this gateway's bounded memory for previous_response_id"},
        "previous_response_id": {"type": "string", "nullable": True, "description": "404 when not stored here"},
        "metadata": {"type": "object", "nullable": True, "maxProperties": MAX_METADATA,
                     "additionalProperties": {"type": "string"}},
        "user": {"type": "string", "nullable": True},
        "tools": {"type": "array", "nullable": True, "items": tool},
        "tool_choice": {"type": "string", "enum": ["none", "auto", "required"], "nullable": True,
                        "description": "needs tools, except none (400)"},
        "text": {"type": "object", "nullable": True, "additionalProperties": False, "properties": {
            "format": {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
                "type": {"type": "string", "enum": ["text", "json_object"]}}}}},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "nullable": True,
                         "description": "logprobs on each output_text (not with tools: 422)"},
        "include": {"type": "array", "nullable": True, "items": {"type": "string", "enum": [LOGPROBS_INCLUDE]}}}}
    stored = {"200": {"description": "the stored response", "content": {"application/json": {"schema": _RESPONSE}}},
              **_errors("401", "404")}
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/responses": {"post": {
            "operationId": "createResponse",
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": {"description": "a response (JSON, or typed SSE events when stream=true)",
                                  "content": {"application/json": {"schema": _RESPONSE},
                                              "text/event-stream": {"schema": _SSE}},
                                  "links": {name: {"operationId": name,
                                                   "parameters": {"response_id": "$response.body#/id"}}
                                            for name in ("getResponse", "deleteResponse")}},
                          **_errors(*_GENERATION_ERRORS)}}},
        "/v1/responses/{response_id}": {
            "get": {"operationId": "getResponse", "parameters": response_id, "responses": stored},
            "delete": {"operationId": "deleteResponse", "parameters": response_id, "responses": {
                "200": {"description": "deleted", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["id", "object", "deleted"], "properties": {
                        "id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}}}}},
                **_errors("401", "404")}}},
    }


def transcription_paths(hearing_models: list[str]) -> dict:
    """``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` for the models that hear."""
    form = {"type": "object", "required": ["file", "model"], "additionalProperties": False, "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "WAV, FLAC or MP3 (where libsndfile decodes it), at most 30 s (400 otherwise)"},
        "model": {"type": "string", "enum": hearing_models},
        "language": {"type": "string", "pattern": "^[a-z]{2,3}$", "description": "ISO-639-1, a hint"},
        "prompt": {"type": "string"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "response_format": {"type": "string", "enum": list(FORMATS), "description": "default json"}}}
    answer = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}

    def operation(name: str) -> dict:
        return {"post": {"operationId": name,
                         "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}},
                         "responses": {"200": {"description": "the text, in response_format",
                                               "content": {"application/json": {"schema": answer},
                                                           "text/plain": {"schema": {"type": "string"}},
                                                           "text/vtt": {"schema": {"type": "string"}},
                                                           "text/event-stream": {"schema": _SSE}}},
                                       **_errors(*_GENERATION_ERRORS)}}}

    return {"/v1/audio/transcriptions": operation("createTranscription"),
            "/v1/audio/translations": operation("createTranslation")}
