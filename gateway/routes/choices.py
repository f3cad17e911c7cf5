"""Requests of several choices: ``n`` > 1, a list of prompts in one ``/v1/completions``, ``echo``.

Life of such a request through the gateway::

    GenerationRequest (n, prompts, echo) ──plan: each prompt tokenized and checked once──▶
        one Generation per choice, index = prompt_index * n + j (vLLM's order), each with its own
        upstream request id (``<id>-<index>``) and its own random stream: with a ``seed``, choice j
        of a prompt samples with ``seed + j`` (as vLLM seeds the children of an n > 1 request);
        without one, each choice draws its own seed (generation.text_params)
    ──▶ per prompt, choice 0 is submitted first and choices 1 … n-1 once choice 0 has its first
        token: its prefill is then done, its full prompt blocks are named in the prefill worker's
        prefix cache, and the broker's prefix index (updated when choice 0 was dispatched) sends
        the siblings to that worker, which reuses the blocks instead of computing the prefix again
        (only the block holding the last prompt token is computed per choice). The cost: the
        siblings' first tokens come one prefill later than choice 0's.
    ──▶ :func:`interleave`: every choice's TextChunks, tagged with their index, as they arrive
    ──▶ one JSON body (choices in index order) or one SSE stream (chunks of all choices
        interleaved, each carrying its index, one ``data: [DONE]``)

Usage counts each prompt once and sums every choice's completion tokens (as vLLM and OpenAI do);
a stream's continuous usage is each chunk's own choice's (gateway/usage.py).
Errors: the first choice to fail fails the whole request with the structured error body (before
the stream starts: its status; after: the last event); leaving early (client gone, an error, a
deadline) cancels every choice upstream — :func:`interleave` owns one task per choice and cancels
and joins them all when it ends, however it ends.

``echo`` (completions) puts the prompt's text before each choice's text (the first chunk of each
choice when streaming); with ``logprobs``, the prompt's logprobs lead the choice's (computed by
prefill for each prompt's first choice: gateway/prompt_logprobs.py), as vLLM answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from omnirelay.errors import BadRequest, OmniError

from .. import generation
from ..app_keys import BUS, CONFIG
from ..bus import BusClient
from ..models import ModelRuntime
from ..prompt_logprobs import echo_logprobs, joined, prompt_logprobs_field
from ..request_record import RequestRecord, open_record
from ..schema import GenerationRequest
from ..sse import SseWriter, stream_slot
from ..usage import report_for


@dataclasses.dataclass
class Plan:
    """The choices of one request: ``gens[i]`` is choice ``i``; ``n`` choices per prompt."""

    request_id: str
    request: GenerationRequest
    gens: list[generation.Generation]
    n: int

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counts once, however many choices share it."""
        return sum(gen.prompt_tokens for gen in self.gens[::self.n])

    @property
    def completion_tokens(self) -> int:
        return sum(gen.completion_tokens for gen in self.gens)

    def scored(self, index: int) -> generation.Generation:
        """The choice of ``index``'s prompt that was asked for the prompt's logprobs (its first)."""
        return self.gens[index - index % self.n]

    @property
    def cached_tokens(self) -> int:
        """Per prompt, the fewest any of its choices found cached: its siblings reuse the prefix the
        first one prefilled, which was not in the cache before this request."""
        return sum(min(gen.cached_tokens for gen in self.gens[i:i + self.n]) for i in range(0, len(self.gens), self.n))

    @property
    def resumes(self) -> int:
        return sum(gen.resumes for gen in self.gens)


def plan(model: ModelRuntime, request: GenerationRequest, prefix: str) -> Plan:
    """Tokenize and check each prompt once (400 naming the param before anything is submitted),
    then one Generation per choice."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    singles = [dataclasses.replace(request, n=1, prompts=(), prompt=p if isinstance(p, str) else None,
                                   prompt_token_ids=None if isinstance(p, str) else list(p)) for p in request.prompts]
    gens = []
    for i, one in enumerate(singles or [dataclasses.replace(request, n=1)]):
        try:
            base = generation.prepare(model, one, prefix)
        except BadRequest as exc:
            if singles and exc.param == "prompt":
                exc.param = f"prompt[{i}]"   # which prompt of the list
            raise
        for j in range(request.n):
            seed = None if request.seed is None else request.seed + j
            # The prompt's logprobs are the same for every choice: its first one asks (Plan.scored).
            gens.append(dataclasses.replace(base, request_id=f"{request_id}-{len(gens)}",
                                            request=dataclasses.replace(one, seed=seed),
                                            prompt_k=base.prompt_k if j == 0 else -1))
    return Plan(request_id, request, gens, request.n)


async def interleave(bus: BusClient, plan_: Plan, deadline: float
                     ) -> AsyncIterator[tuple[int, generation.TextChunk]]:
    """Every choice's chunks as ``(index, chunk)`` in arrival order; raises the first choice's error.

    One task per choice, owned here: they are cancelled and joined when this generator ends (finished,
    failed, closed or cancelled), and a cancelled ``generation.run`` cancels its request upstream.
    Use it under ``contextlib.aclosing`` so an abandoned iteration still ends them at once."""
    # Bounded: a choice that runs ahead of a slow client waits rather than queue without limit.
    queue: asyncio.Queue = asyncio.Queue(maxsize=16 * len(plan_.gens))

    async def pump(index: int, gen: generation.Generation, after: asyncio.Event | None,
                   started: asyncio.Event | None) -> None:
        try:
            if after is not None:
                await after.wait()
            # Closed here, not left to the garbage collector: its close cancels the choice upstream.
            async with contextlib.aclosing(generation.run(bus, gen, deadline)) as chunks:
                async for chunk in chunks:
                    if started is not None:
                        started.set()
                    await queue.put((index, chunk))
            if started is not None:
                started.set()
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # handed to the consumer, which raises it (one error fails the request);
            await queue.put((index, exc))   # siblings still waiting for this choice never start

    tasks = []
    for start in range(0, len(plan_.gens), plan_.n):
        first_token = asyncio.Event() if plan_.n > 1 else None
        for j in range(plan_.n):
            index = start + j
            tasks.append(asyncio.create_task(
                pump(index, plan_.gens[index], None if j == 0 else first_token, first_token if j == 0 else None),
                name=f"choice-{plan_.gens[index].request_id}"))
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _echo_text(gen: generation.Generation) -> str:
    request = gen.request
    return request.prompt if request.prompt is not None else gen.model.tokenizer.decode(gen.prompt_token_ids)


async def respond(request: web.Request, plan_: Plan, make_format: Callable[[], Any]) -> web.StreamResponse:
    """Answer ``plan_``; ``make_format()`` gives one choice's renderer (completions.ChatFormat,
    completions.CompletionFormat or a stateful wrapper of them, such as tool_calls.chat_format's):
    one each."""
    fmts = [make_format() for _ in plan_.gens]
    model = plan_.gens[0].model
    # One request: TTFT is the first choice's first token.
    record = open_record(request, model.name, plan_.request_id, usage=plan_, choices=len(plan_.gens),
                         stages="+".join(model.stages))
    if plan_.request.stream:
        return await _respond_stream(request, plan_, fmts, record)
    return await _respond_full(request, plan_, fmts, record)


async def _respond_full(request: web.Request, plan_: Plan, fmts: list, record: RequestRecord) -> web.Response:
    deadline = time.time() + request.app[CONFIG].request_timeout_s
    count = len(plan_.gens)
    texts: list[list[str]] = [[] for _ in range(count)]
    token_ids: list[list[int]] = [[] for _ in range(count)]
    logprobs: list[list] = [[] for _ in range(count)]
    finish = ["stop"] * count
    async with contextlib.aclosing(interleave(request.app[BUS], plan_, deadline)) as chunks:
        async for index, chunk in chunks:
            record.tokens(len(chunk.token_ids))
            texts[index].append(chunk.text)
            token_ids[index].extend(chunk.token_ids)
            logprobs[index].extend(chunk.logprobs)
            finish[index] = chunk.finish_reason or finish[index]
    choices = []
    for index, gen in enumerate(plan_.gens):
        fmt = fmts[index]
        scored = plan_.scored(index)   # the prompt's logprobs, computed for its first choice
        offset, echoed = 0, None
        if plan_.request.echo and gen.request.logprobs >= 0:
            echoed, offset = echo_logprobs(scored, generation.token_text)
        rendered = (fmt.logprobs(gen, token_ids[index], logprobs[index], offset)[0]
                    if gen.request.logprobs >= 0 else None)
        if echoed is not None:
            rendered = joined(echoed, rendered)
        text = "".join(texts[index])
        if plan_.request.echo:
            text = _echo_text(gen) + text
        choice = {**fmt.full(text, finish[index], rendered), "index": index}
        if plan_.request.kind != "chat":   # a completion choice: its own (null when not asked, as vLLM)
            choice["prompt_logprobs"] = prompt_logprobs_field(scored, generation.token_text)
        if plan_.request.return_token_ids:
            choice["token_ids"] = token_ids[index]
            if plan_.request.kind != "chat":   # a completion choice: its own prompt's (vLLM)
                choice["prompt_token_ids"] = gen.prompt_token_ids
        choices.append(choice)
    body = {"id": plan_.request_id, "created": generation.now(), "model": plan_.gens[0].model.name,
            "object": fmts[0].object_full, "choices": choices,
            "usage": report_for(plan_.request, request.app[CONFIG]).answer(
                plan_.prompt_tokens, plan_.completion_tokens, plan_.cached_tokens)}
    if plan_.request.return_token_ids and plan_.request.kind == "chat":   # one prompt: at the top level (vLLM)
        body["prompt_token_ids"] = plan_.gens[0].prompt_token_ids
    if plan_.request.kind == "chat":   # one prompt: at the top level (null when not asked, as vLLM)
        body["prompt_logprobs"] = prompt_logprobs_field(plan_.gens[0], generation.token_text)
    return web.json_response(body, headers={"X-Request-Id": plan_.request_id})


async def _respond_stream(request: web.Request, plan_: Plan, fmts: list, record: RequestRecord) -> web.StreamResponse:
    with stream_slot(request):
        async with contextlib.aclosing(
                interleave(request.app[BUS], plan_, time.time() + request.app[CONFIG].request_timeout_s)) as chunks:
            return await _stream(request, plan_, fmts, record, chunks)


async def _stream(request: web.Request, plan_: Plan, fmts: list, record: RequestRecord,
                  chunks) -> web.StreamResponse:
    config = request.app[CONFIG]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": plan_.request_id})
    report = report_for(plan_.request, config)   # gateway/usage.py
    sse = SseWriter(response, {"id": plan_.request_id, "created": generation.now(),
                               "model": plan_.gens[0].model.name, "object": fmts[0].object_chunk},
                    config.stream_write_timeout_s)
    write, send = sse.write, sse.send

    first = await anext(chunks, None)   # errors before the first token still get a proper status
    await response.prepare(request)
    count = len(plan_.gens)
    offsets = [0] * count                     # text offsets of each choice's logprobs
    echo = [plan_.request.echo] * count       # choices whose prompt text is still to be sent
    streamed = [0] * count                    # each choice's completion tokens rendered so far
    try:
        # The prompt's ids (return_token_ids): chat's on its first chunk, each completion choice's on its first.
        prompt_ids = [{"prompt_token_ids": gen.prompt_token_ids} if plan_.request.return_token_ids else None
                      for gen in plan_.gens]
        for index, fmt in enumerate(fmts):
            if fmt.first_delta() is not None:
                await send([{**fmt.first_delta(), "index": index}], report.so_far(plan_.gens[index].prompt_tokens, 0),
                           extra=prompt_ids[index] if index == 0 else None)
                prompt_ids[index] = None
        item = first
        while item is not None:
            index, chunk = item
            gen, fmt = plan_.gens[index], fmts[index]
            record.tokens(len(chunk.token_ids))
            streamed[index] += len(chunk.token_ids)
            logprobs, echoed = None, None
            if echo[index] and gen.request.logprobs >= 0:   # the echoed prompt's logprobs lead
                echoed, offsets[index] = echo_logprobs(plan_.scored(index), generation.token_text)
            if gen.request.logprobs >= 0 and chunk.token_ids:
                logprobs, offsets[index] = fmt.logprobs(gen, chunk.token_ids, chunk.logprobs, offsets[index])
            if echoed is not None:
                logprobs = joined(echoed, logprobs)
            text = chunk.text
            if echo[index]:
                text, echo[index] = _echo_text(gen) + text, False
            ids = chunk.token_ids if plan_.request.return_token_ids else None   # held-back text: ids still go
            if text or chunk.finish_reason or logprobs or ids:
                choice = {**fmt.delta(text, chunk.finish_reason or None, logprobs), "index": index}
                if plan_.request.return_token_ids:
                    choice["token_ids"] = chunk.token_ids
                if prompt_ids[index]:
                    choice, prompt_ids[index] = {**choice, **prompt_ids[index]}, None
                await send([choice], report.so_far(gen.prompt_tokens, streamed[index]))
            item = await anext(chunks, None)
        if report.final:
            await send([], report.last_chunk(plan_.prompt_tokens, plan_.completion_tokens, plan_.cached_tokens))
    except OmniError as exc:
        # Headers are gone: the error travels as the last event, in the same body shape.
        record.failed(exc)
        await sse.send_error(exc)
    await write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
