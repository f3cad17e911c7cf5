"""``POST /v1/responses``, ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``: OpenAI's
Responses API (what the Agents SDK and newer clients speak), served by the chat path.

Life of a request through this module::

    body ──gateway/responses_request.py: checked, translated (422 naming what is not served)──▶
        chat messages = instructions (system) + the stored conversation of previous_response_id
        (404 naming it when the store no longer has it) + this turn's input
    ──▶ gateway/schema.py parse_chat (sampling, tools, text.format as response_format; an error's
        param renamed to the Responses one) ──▶ generation.prepare (tokenize, media, context checks)
    ──▶ generation.run: the chat path's TextChunks ──▶ gateway/responses_output.py OutputBuilder:
        message and function_call items and their typed events
    ──▶ one response object (JSON), or SSE: ``response.created``, ``response.in_progress``, each
        item's events, then ``response.completed`` (``response.incomplete`` when cut at
        ``max_output_tokens``); every event has a ``sequence_number`` counted from 0, and each
        ``data:`` line is preceded by ``event: <type>``, as OpenAI sends them. An error after the
        stream started is an ``error`` event then ``response.failed``.
    ──▶ ``store`` (default true): the finished response and its conversation go into this gateway's
        bounded store (gateway/response_store.py: bound and eviction there).

A model served with a reasoning parser (gateway/reasoning.py) answers with a ``reasoning`` item
(its ``<think>`` text as ``reasoning_text``) before the answer's items; the ``reasoning`` request
option (effort, summaries) is not served: anything but ``{}`` is a 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web

from omnirelay.errors import BadRequest, NotFound, OmniError, Unprocessable

from .. import generation
from ..app_keys import BUS, CONFIG, MODELS, RESPONSES
from ..cpu_work import off_loop
from ..models import text_model
from ..request_body import json_body
from ..request_record import open_record
from ..response_store import ResponseStore
from ..responses_output import OutputBuilder, output_messages
from ..responses_request import ResponsesCall, parse_responses, responses_param
from ..schema import parse_chat
from ..sse import stream_slot
from .completions import ChatFormat


def _chat_request(call: ResponsesCall, history: list[dict]):
    messages = ([{"role": "system", "content": call.instructions}] if call.instructions else []) + history + call.turn
    try:
        return parse_chat({**call.chat_options, "model": call.model, "messages": messages})
    except OmniError as exc:
        exc.param = responses_param(exc.param)
        raise


def _response_object(call: ResponsesCall, response_id: str, created: int, model: str, status: str,
                     output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "previous_response_id": call.previous_response_id,
            "store": call.store, "usage": usage, **call.echo}


def _usage(gen: generation.Generation, builder: OutputBuilder) -> dict:
    return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": builder.reasoning_tokens},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


async def create_response(request: web.Request) -> web.StreamResponse:
    call = parse_responses(await json_body(request))
    store: ResponseStore = request.app[RESPONSES]
    history: list[dict] = []
    if call.previous_response_id is not None:
        previous = store.get(call.previous_response_id)
        if previous is None:
            raise NotFound(f"response {call.previous_response_id!r} is not stored on this server (expired, "
                           "deleted, stored with store=false, or kept by another gateway)",
                           param="previous_response_id")
        history = previous.messages
    parsed = _chat_request(call, history)
    model = text_model(request.app[MODELS], parsed.model)
    try:
        gen = await off_loop(request.app, generation.prepare, model, parsed, "resp")
    except OmniError as exc:
        exc.param = responses_param(exc.param)
        raise
    response_id = "resp_" + gen.request_id.split("-", 1)[1]
    gen.request_id = response_id
    if call.logprobs and gen.reasoning is not None:
        raise Unprocessable("logprobs are served for models without a reasoning parser", param="include")
    builder = OutputBuilder(gen, parsed.tools, call.logprobs, ChatFormat.logprobs, gen.reasoning,
                            gen.model.tool_call_parser)
    record = open_record(request, model.name, response_id, usage=gen, stages="+".join(gen.stages))
    created = generation.now()
    conversation = history + call.turn

    def finished(output: list[dict]) -> dict:
        body = _response_object(call, response_id, created, model.name,
                                "incomplete" if builder.incomplete else "completed", output, _usage(gen, builder))
        if call.store:
            store.put(body, conversation + output_messages(output))
        return body

    deadline = time.time() + request.app[CONFIG].request_timeout_s
    chunks = generation.run(request.app[BUS], gen, deadline)
    if not call.stream:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                record.tokens(len(chunk.token_ids))
                builder.feed(chunk)
        return web.json_response(finished(builder.items), headers={"X-Request-Id": response_id})

    with stream_slot(request):
        async with contextlib.aclosing(chunks):
            first = await anext(chunks, None)   # errors before the first token still get a proper status
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Request-Id": response_id})
            await response.prepare(request)
            writer = _EventWriter(response, request.app[CONFIG].stream_write_timeout_s)
            start = _response_object(call, response_id, created, model.name, "in_progress", [])
            await writer.send({"type": "response.created", "response": start})
            await writer.send({"type": "response.in_progress", "response": start})
            try:
                chunk = first
                while chunk is not None:
                    record.tokens(len(chunk.token_ids))
                    for event in builder.feed(chunk):
                        await writer.send(event)
                    chunk = await anext(chunks, None)
                body = finished(builder.items)
                await writer.send({"type": f"response.{body['status']}", "response": body})
            except OmniError as exc:
                record.failed(exc)
                await writer.send({"type": "error", "code": exc.error_type, "message": exc.message,
                                   "param": exc.param})
                failed = _response_object(call, response_id, created, model.name, "failed", builder.items,
                                          _usage(gen, builder), error={"code": exc.error_type, "message": exc.message})
                await writer.send({"type": "response.failed", "response": failed})
    await response.write_eof()
    return response


class _EventWriter:
    """Typed SSE events, numbered in order (``sequence_number``), each written within the stream
    write timeout (a client that stops reading is dropped, as gateway/sse.py does)."""

    def __init__(self, response: web.StreamResponse, write_timeout_s: float):
        self.response = response
        self.write_timeout_s = write_timeout_s
        self.sequence = 0

    async def send(self, event: dict) -> None:
        event = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        data = f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.response.write(data)
        except TimeoutError:
            raise ConnectionResetError(f"client did not read for {self.write_timeout_s:.0f}s") from None


async def get_response(request: web.Request) -> web.Response:
    if request.query.get("stream") not in (None, "false"):
        raise BadRequest("streaming a stored response again is not supported", param="stream")
    entry = request.app[RESPONSES].get(request.match_info["response_id"])
    if entry is None:
        raise NotFound(f"response {request.match_info['response_id']!r} is not stored on this server",
                       param="response_id")
    return web.json_response(entry.response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSES].delete(response_id):
        raise NotFound(f"response {response_id!r} is not stored on this server", param="response_id")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def add_response_routes(app: web.Application) -> None:
    """The routes and this gateway's response store (gateway/response_store.py's default limits)."""
    app[RESPONSES] = ResponseStore()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
