"""The OpenAPI 3.0 document of the gateway (``GET /openapi.json``), kept beside the validator it
describes (``schema.py``): every bound and type here is one the validator enforces, so a client
generated from this document never sees a 400 for a request the document allows — except where the
prompt itself does not fit the model's context, which depends on tokenization (documented)."""

from __future__ import annotations

from omnirelay import __version__

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


def _sampling(max_model_len: int, models: list[str]) -> dict:
    return {
        "model": {"type": "string", "enum": models, "description": "an id from GET /v1/models (404 otherwise)"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1, "nullable": True,
                       "description": "prompt tokens + max_tokens must fit the context (400 otherwise)"},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
        "top_k": {"type": "integer", "minimum": -1, "nullable": True},
        "seed": {"type": "integer", "nullable": True},
        "stop": _STOP,
        "stop_token_ids": {**_TOKEN_IDS, "nullable": True},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "return_token_ids": {"type": "boolean", "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
    }


_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _completion_response(choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                           "usage": _USAGE}}


def _responses(ok: dict) -> dict:
    error = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    out = {"200": {"description": "completion (JSON, or an SSE stream when stream=true)",
                   "content": {"application/json": {"schema": ok},
                               "text/event-stream": {"schema": {"type": "string"}}}}}
    for status in ("400", "401", "404", "413", "422", "429", "500", "503", "504", "507"):
        out[status] = error
    return out


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
    """``/v1/videos`` (gateway/videos.py): jobs. Bounds are VideoParams'; the ``openai`` client
    sends the same fields as a multipart form, which is accepted too (numbers as text)."""
    error = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    errors = lambda *codes: {code: error for code in codes}  # noqa: E731
    job = {"description": "the video job", "content": {"application/json": {"schema": _VIDEO_JOB}}}
    video_id = [{"name": "video_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    create = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": 4000},
        "model": {"type": "string", "enum": models, "description": "optional when one video model is served"},
        "size": {"type": "string", "pattern": "^[0-9]{1,5}x[0-9]{1,5}$",
                 "description": "WxH, multiples of 8, each side 8 to 1792 (default: the model's native size)"},
        "seconds": {"type": "string", "pattern": "^[0-9]{1,2}$", "description": "clip length (default 4)"},
        "fps": {"type": "integer", "minimum": 1, "maximum": 60},
        "num_frames": {"type": "integer", "minimum": 1, "maximum": 240, "description": "default seconds x fps"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 150},
        "guidance_scale": {"type": "number", "minimum": 0, "maximum": 50},
        "negative_prompt": {"type": "string", "maxLength": 4000},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}}}
    listing = {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"type": "string"}, "data": {"type": "array", "items": _VIDEO_JOB}, "has_more": {"type": "boolean"},
        "first_id": {"type": "string", "nullable": True}, "last_id": {"type": "string", "nullable": True}}}
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}}
    return {
        "/v1/videos": {
            "post": {"operationId": "createVideo", "requestBody": {"required": True, "content": {
                "application/json": {"schema": create}}},
                "responses": {"200": job, **errors("400", "401", "404", "408", "413", "422", "429")}},
            "get": {"operationId": "listVideos", "parameters": [
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}}],
                "responses": {"200": {"description": "jobs, newest first by default", "content": {
                    "application/json": {"schema": listing}}}, **errors("400", "401", "404")}}},
        "/v1/videos/{video_id}": {
            "get": {"operationId": "retrieveVideo", "parameters": video_id,
                    "responses": {"200": job, **errors("401", "404")}},
            "delete": {"operationId": "deleteVideo", "parameters": video_id, "responses": {
                "200": {"description": "cancelled (unfinished) or removed (finished)",
                        "content": {"application/json": {"schema": deleted}}}, **errors("401", "404")}}},
        "/v1/videos/{video_id}/content": {
            "get": {"operationId": "downloadVideoContent", "parameters": video_id + [
                {"name": "variant", "in": "query", "schema": {"type": "string", "enum": ["video"]}}],
                "responses": {"200": {"description": "the file", "content": {
                    "video/mp4": {"schema": {"type": "string", "format": "binary"}},
                    "image/webp": {"schema": {"type": "string", "format": "binary"}}}},
                    **errors("401", "404", "422")}}},
    }


def build_openapi(max_model_len: int, models: list[str], video_models: list[str] | None = None) -> dict:
    """``video_models``: the served text-to-video models; the video paths are documented only
    when there is one (a gateway without one answers every video request 400/404)."""
    sampling = _sampling(max_model_len, models)
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {"nullable": True, "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
    }}
    chat_request = {"type": "object", "required": ["model", "messages"], "properties": {
        **sampling, "messages": {"type": "array", "minItems": 1, "items": message}}}
    completion_request = {"type": "object", "required": ["model", "prompt"], "properties": {
        **sampling, "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                         {**_TOKEN_IDS, "minItems": 1}]},
        "echo": {"type": "boolean", "enum": [False], "nullable": True}}}
    chat_choice = {"type": "object", "properties": {
        "index": {"type": "integer"}, "finish_reason": {"type": "string", "nullable": True},
        "message": {"type": "object", "properties": {"role": {"type": "string"},
                                                     "content": {"type": "string", "nullable": True}}}}}
    text_choice = {"type": "object", "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"},
        "finish_reason": {"type": "string", "nullable": True}}}
    json_body = lambda schema: {"required": True, "content": {"application/json": {"schema": schema}}}  # noqa: E731
    error_ref = {"$ref": "#/components/schemas/Error"}
    return {
        "openapi": "3.0.3",
        "info": {"title": "omnirelay gateway", "version": __version__,
                 "description": "OpenAI-compatible API of an omnirelay cluster."},
        "paths": {
            "/v1/chat/completions": {"post": {"operationId": "createChatCompletion",
                                              "requestBody": json_body(chat_request),
                                              "responses": _responses(_completion_response(chat_choice))}},
            "/v1/completions": {"post": {"operationId": "createCompletion",
                                         "requestBody": json_body(completion_request),
                                         "responses": _responses(_completion_response(text_choice))}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "served models", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"], "properties": {
                        "object": {"type": "string"},
                        "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"],
                                                            "properties": {"id": {"type": "string"},
                                                                           "object": {"type": "string"}}}}}}}}},
                "401": {"description": "error", "content": {"application/json": {"schema": error_ref}}}}}},
            **(_video_paths(video_models) if video_models else {}),
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "every role of every model has a live worker",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                "401": {"description": "error", "content": {"application/json": {"schema": error_ref}}},
                "503": {"description": "a role has no live worker",
                        "content": {"application/json": {"schema": error_ref}}}}}},
        },
        "components": {"schemas": {"Error": _ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
