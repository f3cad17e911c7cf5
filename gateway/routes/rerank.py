"""``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``) and ``POST /v1/score`` (also ``/score``), as vLLM serves them.

Shapes::

    rerank  {model?, query, documents: [str | {"text": str}], top_n = all, return_documents = true,
             instruction?}   (Jina's and Cohere's request)
         →  {id, model, usage: {total_tokens}, results: [{index, document: {text}?, relevance_score}]}
            most relevant first, the first ``top_n``
    score   {model?, text_1: str | [str], text_2: str | [str], instruction?}   (one text_1 against every
            text_2, or the lists pairwise)
         →  {id, object: "list", created, model, data: [{index, object: "score", score}], usage}

How a model scores (a decoder-only reranker's "yes" probability, else the cosine of embeddings) is
gateway/scoring.py's. ``instruction`` (Qwen3-Reranker's task line) only for a reranker. Bad input
(no query, no documents, more than :data:`MAX_INPUTS`, an empty text, a pair over the context, lists
of different lengths) is a 400 naming the param before anything is submitted; Cohere's
``max_tokens_per_doc`` and ``rank_fields`` are 422.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, Unprocessable

from ..app_keys import BUS, CONFIG, MODELS
from ..cpu_work import off_loop
from ..output_options import boolean_field
from ..request_body import json_body
from ..request_record import Usage, open_record
from .. import scoring
from .embeddings import MAX_INPUTS, embedding_model

_NOT_SERVED = ("max_tokens_per_doc", "rank_fields", "max_chunks_per_doc", "truncate_prompt_tokens", "priority")


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{param}' must be a non-empty string", param=param)
    return value


def _texts(value: Any, param: str, documents: bool = False) -> list[str]:
    if isinstance(value, str) and not documents:
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{param}' must be a non-empty list" + ("" if documents else " or a string"), param=param)
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"'{param}' holds {len(value)} texts; at most {MAX_INPUTS} are taken per request",
                         param=param)
    return [_text(item.get("text") if documents and isinstance(item, dict) else item, f"{param}[{i}]")
            for i, item in enumerate(value)]


def _common(body: Any) -> tuple[str | None, str | None]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name in _NOT_SERVED:
        if body.get(name) is not None:
            raise Unprocessable(f"'{name}' is not supported by this server's scoring routes", param=name)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("'model' must be a non-empty string", param="model")
    instruction = body.get("instruction")
    if instruction is not None:
        _text(instruction, "instruction")
    return model, instruction


async def _scores(request: web.Request, model_name: str | None, pairs: list[tuple[str, str]], param,
                  instruction: str | None, prefix: str) -> tuple[Any, list[float], str, int]:
    model = embedding_model(request.app[MODELS], model_name)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    usage = Usage()
    open_record(request, model.name, request_id, stages="prefill", pairs=len(pairs), usage=usage)
    plan = await off_loop(request.app, scoring.plan, model, pairs, param, instruction)
    usage.prompt_tokens = sum(map(len, plan.prompts))
    deadline = time.time() + request.app[CONFIG].request_timeout_s
    scores = await scoring.score(request.app[BUS], model, plan, deadline, request_id)
    return model, scores, request_id, usage.prompt_tokens


async def rerank(request: web.Request) -> web.Response:
    body = await json_body(request)
    model_name, instruction = _common(body)
    query = _text(body.get("query"), "query")
    documents = _texts(body.get("documents"), "documents", documents=True)
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise BadRequest("'top_n' must be an integer >= 0 (0: every document)", param="top_n")
    return_documents = boolean_field(body, "return_documents", True)
    model, scores, request_id, tokens = await _scores(
        request, model_name, [(query, d) for d in documents],
        lambda i, side: "query" if side == 0 else f"documents[{i}]", instruction, "rerank")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}} if return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return web.json_response({"id": request_id, "model": model.name, "usage": {"total_tokens": tokens},
                              "results": results}, headers={"X-Request-Id": request_id})


async def score(request: web.Request) -> web.Response:
    body = await json_body(request)
    model_name, instruction = _common(body)
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        pairs = [(first[0], t) for t in second]
    elif len(first) == len(second):
        pairs = list(zip(first, second))
    else:
        raise BadRequest(f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2", param="text_2")
    model, scores, request_id, tokens = await _scores(
        request, model_name, pairs, lambda i, side: f"text_{side + 1}" + (f"[{i}]" if len(pairs) > 1 else ""),
        instruction, "score")
    return web.json_response({"id": request_id, "object": "list", "created": int(time.time()), "model": model.name,
                              "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                             headers={"X-Request-Id": request_id})


def add_rerank_routes(app: web.Application) -> None:
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    for path in ("/v1/score", "/score"):
        app.router.add_post(path, score)
