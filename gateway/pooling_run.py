"""Pooling requests from the gateway's side: many prompts in, one pooled vector each, through prefill.

Life of a pooling request through the gateway (``/v1/embeddings``)::

    checked prompts (token ids) ──▶ one Submit per prompt: stages ["prefill"], params PoolingParams,
        at most :data:`MAX_IN_FLIGHT` of one client request at a time
        ──▶ PooledStream: the prompt's PooledResult (or RequestFailed, or the deadline: 504)
        ──▶ the vectors in input order; a prompt that fails fails the request, and the others still
            in flight are cancelled upstream

One submission per prompt, not one per client request: the prefill worker batches prompts (of this
request and of others, chat included) into its packed forwards, the broker routes each by its prefix
(a shared instruction prefix lands where it is cached), and a lost worker costs a resubmission of one
prompt (:func:`~omnirelay.gateway.resubmit.submit_until_done`). The bound keeps a 2,048-input request
from filling the broker's role queue (``--max-queue-per-role``) and starving other clients: its
prompts go in waves as earlier ones return.
"""

from __future__ import annotations

import asyncio

from omnirelay.broker import protocol as p
from omnirelay.errors import OmniError
from omnirelay.pooling_params import PoolingParams

from .bus import BusClient, RequestStream, StreamEvent
from .resubmit import submit_until_done

MAX_IN_FLIGHT = 32   # submissions of one client request at a time (a prefill batch's worth, twice)


class PooledStream(RequestStream):
    """The vector of one pooling submission: finishes on its PooledResult."""

    def __init__(self, request_id: str, deadline: float):
        super().__init__(request_id, deadline)
        self.data = b""

    def on_delta(self, delta: p.TokenDelta) -> None:
        """Pooling produces no tokens; a stray delta is ignored."""

    def on_pooled(self, result: p.PooledResult) -> None:
        if self.finished:
            return
        self.data = result.data
        self.finished = True
        self._queue.put_nowait(StreamEvent([], "stop"))

    async def wait(self) -> bytes:
        """The vector (little-endian float32); raises the request's error or DeadlineExceeded."""
        async for _ in self.events():
            pass
        return self.data


async def pool_prompts(bus: BusClient, model: str, prompts: list[list[int]], params: PoolingParams,
                       deadline: float, request_id: str) -> list[bytes]:
    """The pooled vector of each of ``prompts`` (as little-endian float32), in order, from the
    prefill workers of ``model``. The prompts' submissions are this call's tasks, in one task group:
    the first failure cancels the rest (each cancel reaches the broker) and is raised alone."""
    results: list[bytes] = [b""] * len(prompts)
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(index: int) -> None:
        async with slots:
            submit = p.Submit(request_id=f"{request_id}-{index}", model=model, stages=["prefill"],
                              prompt_token_ids=prompts[index], params=params, deadline=deadline,
                              reply_to=bus.reply_to, reply_key=bus.reply_key)
            results[index], _ = await submit_until_done(bus, submit, lambda upstream: PooledStream(upstream, deadline))

    try:
        async with asyncio.TaskGroup() as group:
            for index in range(len(prompts)):
                group.create_task(one(index), name=f"pool-{request_id}-{index}")
    except ExceptionGroup as failed:
        first = failed.exceptions[0]
        if isinstance(first, OmniError):
            first.request_id = request_id
        raise first from None
    return results
