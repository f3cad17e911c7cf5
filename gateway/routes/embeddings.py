"""``POST /v1/embeddings``: OpenAI's embeddings, pooled by the prefill workers of a served model.

Life of a request through the gateway::

    JSON body ──parse_embedding_request──▶ EmbeddingRequest (400 naming the param; 422 for vLLM's
        options not served) ──model──▶ 404 unknown, 422 a model that does not embed or an adapter
        ──CPU pool: tokenize each input (add_special_tokens, as vLLM), truncate_prompt_tokens, check
          every input against the context and the vocabulary (400 naming input[i]: nothing computed)
        ──▶ pooling_run.pool_prompts: one prefill-only submission per input, bounded in flight
        ──▶ {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}

Fields (OpenAI's): ``input`` -- a string, a list of strings, a list of token ids or a list of such
lists (at most :data:`MAX_INPUTS`, none empty); ``model``; ``encoding_format`` -- ``float`` (the
default) or ``base64`` (the little-endian float32 bytes, as the ``openai`` client decodes them; it
asks for base64 unless told otherwise); ``dimensions`` -- Matryoshka truncation (then
renormalised) where the model declares it (``PoolerConfig.check_dimensions``), a 400 naming
``dimensions`` elsewhere; ``user`` -- a hint, accepted and ignored. vLLM's extensions:
``truncate_prompt_tokens`` (keep each input's last k tokens; -1: the context), ``normalize`` (L2, or
the raw pooled state when false), ``add_special_tokens`` (default true), ``cache_salt``. vLLM's
chat-style ``messages`` and its other pooling options are 422, naming them.

How the model pools (last token, mean, CLS; normalised or not) is resolved once from its directory
(omnirelay/pooling_params.py); ``/v1/models`` shows it. A chat model embeds too: one instance
answers both (decoder models pool their last token, L2-normalised, as vLLM does by default).
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from omnirelay.errors import BadRequest, Unprocessable

from ..app_keys import BUS, CONFIG, MODELS
from ..cpu_work import off_loop
from ..models import ModelRuntime, text_model
from ..output_options import boolean_field, truncate_prompt
from ..pooling_run import pool_prompts
from ..request_body import json_body
from ..request_record import Usage, open_record
from ..sampling_options import check_vocab
from ..schema import _cache_salt

MAX_INPUTS = 2048   # OpenAI's bound on one request's inputs
ENCODING_FORMATS = ("float", "base64")
# vLLM's embedding options this server does not serve: a 422 naming each, never a 200 that ignored it.
_NOT_SERVED = ("messages", "mm_processor_kwargs", "embed_dtype", "endianness", "priority", "chat_template",
               "use_activation", "softmax", "activation", "dimensions_per_token")


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]   # texts or token ids, in order
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None        # None: the model's pooling config says
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    cache_salt: str = ""


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    """Validate an embeddings body (400 naming the param; 422 for an option not served)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name in _NOT_SERVED:
        if body.get(name) is not None:
            raise Unprocessable(f"'{name}' is not supported by this server's /v1/embeddings", param=name)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string", param="model")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise BadRequest(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise BadRequest("'dimensions' must be an integer >= 1", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool)
                                 or not (truncate == -1 or truncate >= 1)):
        raise BadRequest("'truncate_prompt_tokens' must be -1 or an integer >= 1", param="truncate_prompt_tokens")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise BadRequest("'normalize' must be a boolean", param="normalize")
    return EmbeddingRequest(model=model, inputs=_inputs(body.get("input")), encoding_format=encoding,
                            dimensions=dimensions, normalize=normalize, truncate_prompt_tokens=truncate,
                            add_special_tokens=boolean_field(body, "add_special_tokens", True),
                            cache_salt=_cache_salt(body))


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """``input`` as OpenAI takes it: a string, a list of strings, a list of token ids, a list of lists."""
    if value is None:
        raise BadRequest("'input' is required", param="input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        value = [value]   # one tokenized input
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a non-empty string or list", param="input")
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} are taken per request",
                         param="input")
    inputs: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item:
            inputs.append(item)
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            inputs.append(tuple(item))
        else:
            raise BadRequest(f"input[{i}] must be a non-empty string or a non-empty list of token ids",
                             param=f"input[{i}]")
    return tuple(inputs)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embedding_model(models: dict, name: str | None) -> ModelRuntime:
    """The served model that answers: ``name``, or the one text model when the body names none."""
    if name is None:
        text = [n for n, m in models.items() if isinstance(m, ModelRuntime)]
        if len(text) != 1:
            raise BadRequest(f"'model' is required: this server has {len(text)} text models", param="model")
        name = text[0]
    model = text_model(models, name)
    if model.pooler is None:
        raise Unprocessable(f"model {name!r} does not serve embeddings", param="model")
    if model.lora:
        raise Unprocessable(f"model {name!r} is a LoRA adapter: embeddings are served by its base model",
                            param="model")
    return model


def tokenize_inputs(model: ModelRuntime, request: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked: within the context (after ``truncate_prompt_tokens``) and
    the vocabulary. A 400 naming ``input[i]`` for the first that is not. CPU work: on the pool."""
    prompts: list[list[int]] = []
    for i, item in enumerate(request.inputs):
        param = f"input[{i}]" if len(request.inputs) > 1 else "input"
        if isinstance(item, str):
            if len(item) > model.max_prompt_chars:   # cannot fit, whatever its tokens: not tokenized
                raise BadRequest(f"{param} has {len(item)} characters; no text over {model.max_prompt_chars} "
                                 f"characters fits this model's context of {model.max_model_len} tokens", param=param)
            ids = list(model.tokenizer(item, add_special_tokens=request.add_special_tokens)["input_ids"])
        else:
            ids = list(item)
            check_vocab(ids, model.vocab_size, param)
        ids = truncate_prompt(ids, request.truncate_prompt_tokens, model.max_model_len)
        if len(ids) > model.max_model_len:   # vLLM's words, which its clients match
            raise BadRequest(f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                             f"requested {len(ids)} tokens in the input for embedding generation. Please reduce "
                             "the length of the input.", param=param)
        if not ids:
            raise BadRequest(f"{param} is empty after tokenization", param=param)
        prompts.append(ids)
    return prompts


def _encode(data: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(data).decode("ascii")
    return np.frombuffer(data, dtype="<f4").tolist()


async def embeddings(request: web.Request) -> web.Response:
    parsed = parse_embedding_request(await json_body(request))
    model = embedding_model(request.app[MODELS], parsed.model)
    params = model.pooler.params(normalize=parsed.normalize, dimensions=parsed.dimensions,
                                 cache_salt=parsed.cache_salt)
    request_id = f"embd-{uuid.uuid4().hex}"
    usage = Usage()
    open_record(request, model.name, request_id, stages="prefill", inputs=len(parsed.inputs), usage=usage)
    prompts = await off_loop(request.app, tokenize_inputs, model, parsed)
    usage.prompt_tokens = sum(map(len, prompts))
    deadline = time.time() + request.app[CONFIG].request_timeout_s
    vectors = await pool_prompts(request.app[BUS], model.base_name, prompts, params, deadline, request_id)
    body = {"id": request_id, "object": "list", "created": int(time.time()), "model": model.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, parsed.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}}
    return web.json_response(body, headers={"X-Request-Id": request_id})


def add_embedding_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
