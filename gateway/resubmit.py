"""Submitting a request to the broker again after a failure the client should not see.

Two failures are worth another submission:

* a **resumable** one (the worker or broker holding the request was lost): submitted again at once,
  up to :data:`MAX_RESUBMITS` times — the request is idempotent (same seed) or resumes where the
  client's stream stopped;
* **unavailable** (a role with no live worker, as while one restarts): submitted again after a
  short pause, for :data:`ADMISSION_RETRY_S` after the first submission and within the deadline.

Anything else reaches the client, carrying the client's request id. Each submission has its own
upstream id (``<id>``, ``<id>.1``, …), so late messages of an abandoned one are never mixed in, and
leaving early (client gone, error, job cancelled) always cancels the last one upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, TypeVar

import msgspec

from omnirelay.broker import protocol as p
from omnirelay.errors import OmniError

from .bus import BusClient, RequestStream

log = logging.getLogger("omnirelay.gateway")

MAX_RESUBMITS = 3
ADMISSION_RETRY_S = 5.0   # how long a request waits for a role that has no live worker

S = TypeVar("S", bound=RequestStream)


class AdmissionWait:
    """The pauses of one request while a role it needs has no live worker."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.until = time.monotonic() + ADMISSION_RETRY_S

    async def retry(self, exc: OmniError) -> bool:
        """Whether to submit again after ``exc``; pauses first when so."""
        pause = min(max(exc.retry_after, 0.2), 1.0)
        if (exc.error_type == "unavailable" and time.monotonic() + pause < self.until
                and time.time() + pause < self.deadline):
            await asyncio.sleep(pause)
            return True
        return False


async def submit_until_done(bus: BusClient, submit: p.Submit, stream_for: Callable[[str], S], *,
                            progress: Callable[[], str] = lambda: "",
                            cancel_reason: str = "client left or request failed") -> tuple[Any, S]:
    """Submit ``submit`` (under ids derived from its ``request_id``) until a submission's stream,
    made by ``stream_for(upstream_id)``, finishes: returns ``(await stream.wait(), stream)``.
    ``progress()`` adds what is already in to the log line of a resubmission."""
    request_id, resubmits = submit.request_id, 0
    admission = AdmissionWait(submit.deadline)
    upstream_id, done = request_id, False
    try:
        while True:
            upstream_id = request_id if not resubmits else f"{request_id}.{resubmits}"
            stream = stream_for(upstream_id)
            await bus.submit(msgspec.structs.replace(submit, request_id=upstream_id), stream)
            try:
                result = await stream.wait()
                done = True
                return result, stream
            except OmniError as exc:
                if exc.resumable and resubmits < MAX_RESUBMITS:
                    resubmits += 1
                    log.warning("%s: %s; resubmitting%s", request_id, exc, progress())
                    continue
                if await admission.retry(exc):
                    # An unavailable retry also takes one of the MAX_RESUBMITS (and a fresh upstream id).
                    resubmits += 1
                    continue
                exc.request_id = request_id
                raise
            finally:
                bus.forget(upstream_id)
    finally:
        if not done:
            # Shielded: a job cancelled again while it unwinds must still stop the worker.
            await asyncio.shield(bus.cancel(upstream_id, cancel_reason))
