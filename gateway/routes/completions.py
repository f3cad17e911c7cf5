"""``POST /v1/chat/completions`` and ``POST /v1/completions``: streamed as SSE ending ``data:
[DONE]``, or one JSON body. One choice is answered here; several (``n`` > 1, a list of prompts) or
echo fan out in gateway/routes/choices.py; a chat asking for audio is spoken
(gateway/routes/speech.py). The request's metrics and log line: gateway/request_record.py; what its
``usage`` reports, on which chunks: gateway/usage.py.
"""

from __future__ import annotations

import dataclasses
import time

from aiohttp import web

from omnirelay.errors import OmniError

from .. import generation
from ..app_keys import BUS, CONFIG, MODELS, SPOKEN_ANSWERS
from ..cpu_work import off_loop
from ..models import ModelRuntime, text_model
from ..request_body import json_body
from ..request_record import RequestRecord, open_record
from ..reasoning import ReasoningMode, reasoning_format
from ..schema import GenerationRequest, check_request_template, parse_chat, parse_completion
from ..prompt_logprobs import prompt_logprobs_field
from ..spoken_answers import resolve_audio_turns
from ..sse import SseWriter, stream_slot
from ..tool_calls import chat_format
from ..usage import report_for
from . import choices
from .speech import chat_with_audio


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    parsed = await off_loop(request.app, parse_chat, body)   # schemas and grammars are compiled here
    check_request_template(parsed.template, request.app[CONFIG].trust_request_chat_template)
    # An assistant turn given by the audio id of an earlier spoken answer reads as its transcript.
    parsed = dataclasses.replace(parsed, messages=resolve_audio_turns(parsed.messages, request.app[SPOKEN_ANSWERS]))
    if "audio" in parsed.modalities:   # spoken answer too: talker + token2wav after decode
        return await chat_with_audio(request, parsed, body)
    model = text_model(request.app[MODELS], parsed.model)
    if parsed.n > 1:
        plan = await off_loop(request.app, choices.plan, model, parsed, "chatcmpl")
        mode = plan.gens[0].reasoning   # one prompt: every choice reads its output alike
        return await choices.respond(request, plan, lambda: chat_answer_format(model, parsed, mode))
    gen = await off_loop(request.app, generation.prepare, model, parsed, "chatcmpl")
    return await _respond(request, gen, chat_answer_format(model, parsed, gen.reasoning))


def chat_answer_format(model: ModelRuntime, parsed: GenerationRequest, mode: ReasoningMode | None):
    """One chat choice's renderer: the reasoning split off first (a thinking model), then tool calls
    parsed from the answer that follows it, in the model's tool-call markup."""
    return reasoning_format(chat_format(ChatFormat(), parsed.tools, model.tool_call_parser), mode)


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = await off_loop(request.app, parse_completion, await json_body(request))
    if parsed.n > 1 or parsed.prompts or parsed.echo:
        return await _respond_choices(request, parsed, "cmpl", CompletionFormat)
    gen = await off_loop(request.app, generation.prepare, text_model(request.app[MODELS], parsed.model), parsed, "cmpl")
    return await _respond(request, gen, CompletionFormat())


async def _respond_choices(request: web.Request, parsed: GenerationRequest, prefix: str,
                           make_format) -> web.StreamResponse:
    """Several choices (n > 1, a list of prompts) or echo: gateway/routes/choices.py fans them out,
    rendering each choice with its own ``make_format()``."""
    plan = await off_loop(request.app, choices.plan, text_model(request.app[MODELS], parsed.model), parsed, prefix)
    return await choices.respond(request, plan, make_format)


# Logprobs answers (request asked: GenerationRequest.logprobs >= 0). Each format's ``logprobs``
# renders the tokens of one chunk (stream) or of the whole answer, given the text offset reached so
# far, and returns the object and the new offset. Token text: generation.token_text (each id decoded
# on its own); a logprob JSON cannot carry (-inf) becomes -9999.0, OpenAI's "very unlikely".
_UNLIKELY = -9999.0


def _logprob(value: float) -> float:
    return value if value >= _UNLIKELY else _UNLIKELY


class ChatFormat:
    """``logprobs`` is OpenAI's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": […]}]}``."""

    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def first_delta(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": finish}

    def full(self, text: str, finish: str, logprobs: dict | None = None) -> dict:
        # reasoning: vLLM's field, null unless a thinking model's reasoning is split off (gateway/reasoning.py)
        return {"index": 0, "message": {"role": "assistant", "content": text, "reasoning": None}, "logprobs": logprobs,
                "finish_reason": finish}

    @staticmethod
    def logprobs(gen: generation.Generation, token_ids: list[int], logprobs: list, offset: int) -> tuple[dict, int]:
        def entry(token_id: int, value: float) -> dict:
            text = generation.token_text(gen, token_id)
            return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode("utf-8"))}

        content = [{**entry(token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                   for token_id, lp in zip(token_ids, logprobs)]
        return {"content": content}, offset


class CompletionFormat:
    """``logprobs`` is the legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``:
    ``top_logprobs`` maps each position's k alternatives' text and the sampled token's to their
    logprobs (``logprobs: 0``: the sampled token's alone, as vLLM and OpenAI answer);
    ``text_offset`` counts characters into the completion's text (no echo)."""

    object_full = object_chunk = "text_completion"

    def first_delta(self) -> dict | None:
        return None

    def delta(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def full(self, text: str, finish: str, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(gen: generation.Generation, token_ids: list[int], logprobs: list, offset: int) -> tuple[dict, int]:
        tokens, offsets = [], []
        for token_id in token_ids:
            tokens.append(generation.token_text(gen, token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        top = []
        for token_id, lp in zip(token_ids, logprobs):
            alternatives: dict[str, float] = {}
            for alternative, value in lp.top:   # most likely first: of two equal texts, it keeps the likelier
                alternatives.setdefault(generation.token_text(gen, alternative), _logprob(value))
            # The sampled token is always one of them, as vLLM answers (logprobs: 0 gives it alone).
            alternatives.setdefault(generation.token_text(gen, token_id), _logprob(lp.logprob))
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}, offset


async def _respond(request: web.Request, gen: generation.Generation, fmt) -> web.StreamResponse:
    record = open_record(request, gen.model.name, gen.request_id, usage=gen, stages="+".join(gen.model.stages))
    if gen.request.stream:
        return await _respond_stream(request, gen, fmt, record)
    return await _respond_full(request, gen, fmt, record)


async def _respond_full(request: web.Request, gen: generation.Generation, fmt,
                        record: RequestRecord) -> web.Response:
    deadline = time.time() + request.app[CONFIG].request_timeout_s
    texts, token_ids, logprobs, finish = [], [], [], "stop"
    async for chunk in generation.run(request.app[BUS], gen, deadline):
        record.tokens(len(chunk.token_ids))
        texts.append(chunk.text)
        token_ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        finish = chunk.finish_reason or finish
    rendered = fmt.logprobs(gen, token_ids, logprobs, 0)[0] if gen.request.logprobs >= 0 else None
    choice = fmt.full("".join(texts), finish, rendered)
    usage = report_for(gen.request, request.app[CONFIG]).answer(gen.prompt_tokens, gen.completion_tokens,
                                                                gen.cached_tokens)
    body = {"id": gen.request_id, "created": generation.now(), "model": gen.model.name, "object": fmt.object_full,
            "choices": [choice], "usage": usage}
    # vLLM: chat's at the top level, a completion choice its own; null when not asked
    (body if gen.request.kind == "chat" else choice)["prompt_logprobs"] = prompt_logprobs_field(gen, generation.token_text)
    if gen.request.return_token_ids:
        choice["token_ids"] = token_ids
        # vLLM: chat carries the prompt's ids at the top level, a completion choice its own prompt's
        (body if gen.request.kind == "chat" else choice)["prompt_token_ids"] = gen.prompt_token_ids
    return web.json_response(body, headers={"X-Request-Id": gen.request_id})


async def _respond_stream(request: web.Request, gen: generation.Generation, fmt,
                          record: RequestRecord) -> web.StreamResponse:
    with stream_slot(request):
        return await _stream(request, gen, fmt, record)


async def _stream(request: web.Request, gen: generation.Generation, fmt, record: RequestRecord) -> web.StreamResponse:
    config = request.app[CONFIG]
    deadline = time.time() + config.request_timeout_s
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": gen.request_id})
    report = report_for(gen.request, config)   # gateway/usage.py
    sse = SseWriter(response, {"id": gen.request_id, "created": generation.now(), "model": gen.model.name,
                               "object": fmt.object_chunk}, config.stream_write_timeout_s)
    write, send = sse.write, sse.send

    stream = generation.run(request.app[BUS], gen, deadline)
    try:
        first = await anext(stream)   # errors before the first token still get a proper status
    except StopAsyncIteration:
        first = None
    await response.prepare(request)
    try:
        prompt_ids = {"prompt_token_ids": gen.prompt_token_ids} if gen.request.return_token_ids else None
        if fmt.first_delta() is not None:   # chat: the prompt's ids go on this first chunk (vLLM)
            await send([fmt.first_delta()], report.so_far(gen.prompt_tokens, 0), extra=prompt_ids)
            prompt_ids = None
        chunk, text_offset, streamed = first, 0, 0   # streamed: completion tokens rendered so far
        while chunk is not None:
            record.tokens(len(chunk.token_ids))
            streamed += len(chunk.token_ids)
            logprobs = None   # a chunk whose text is held back still sends its tokens' logprobs
            if gen.request.logprobs >= 0 and chunk.token_ids:
                logprobs, text_offset = fmt.logprobs(gen, chunk.token_ids, chunk.logprobs, text_offset)
            # A chunk whose text is held back (a stop string may be starting) still carries its ids.
            ids = chunk.token_ids if gen.request.return_token_ids else None
            if chunk.text or chunk.finish_reason or logprobs or ids:
                choice = fmt.delta(chunk.text, chunk.finish_reason or None, logprobs)
                if gen.request.return_token_ids:
                    choice["token_ids"] = chunk.token_ids
                if prompt_ids:   # a completion: its first chunk's choice carries them
                    choice, prompt_ids = {**choice, **prompt_ids}, None
                await send([choice], report.so_far(gen.prompt_tokens, streamed))
            chunk = await anext(stream, None)
        if report.final:
            await send([], report.last_chunk(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
    except OmniError as exc:
        # Headers are gone: the error travels as the last event, in the same body shape.
        record.failed(exc)
        await sse.send_error(exc)
    finally:
        await stream.aclose()
    await write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def add_completion_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
