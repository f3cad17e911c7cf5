"""Submitting a request to the broker again after a failure the client should not see.

Two failures are worth another submission:

* a **resumable** one (the worker or broker holding the request was lost): submitted again at once,
  up to :data:`MAX_RESUBMITS` times — the request is idempotent (same seed) or resumes where the
  client's stream stopped;
* **unavailable** (a role with no live worker the broker knows of, as while one restarts after
  leaving, or while workers re-register with a restarted broker): submitted again after a short
  pause, for the gateway's ``--worker-wait`` (``GatewayConfig.worker_wait_s``, carried by the
  :class:`~omnirelay.gateway.bus.BusClient`) counted from the failure that began the wait (the
  first unavailable answer since the request last got going) and within the deadline. Counted from
  the request's start, a stream failed late (its worker lost after 20 s) would have no wait left at
  all. (A worker the broker dropped for silence never makes this answer while it is expected back:
  the broker holds its role's requests itself, broker/expected.py.)

Anything else reaches the client, carrying the client's request id. Each submission has its own
upstream id (``<id>``, ``<id>.1``, …), so late messages of an abandoned one are never mixed in; an
abandoned one is cancelled upstream before the next goes (the broker may still hold it: a gateway it
gave up and took back resumes everything, including what it submitted in between), and leaving
early (client gone, error, job cancelled) always cancels the last one upstream.

:class:`Submissions` is that policy for a caller that reads each submission's stream itself (text
generation and speech, which yield as they go: what the next submission asks for depends on what
the client already has); :func:`submit_until_done` is it for a caller that waits for one result
(images, video jobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, TypeVar

import msgspec

from omnirelay.broker import protocol as p
from omnirelay.errors import OmniError, Unavailable

from .bus import BusClient, RequestStream

log = logging.getLogger("omnirelay.gateway")

MAX_RESUBMITS = 3
CANCEL_REASON = "client left or request failed"

S = TypeVar("S", bound=RequestStream)


class AdmissionWait:
    """The pauses of one request while a role it needs has no live worker: at most ``wait_s`` from
    the first unavailable answer since :meth:`restart`, and never past ``deadline``."""

    def __init__(self, deadline: float, wait_s: float):
        self.deadline = deadline
        self.wait_s = wait_s
        self.until: float | None = None   # set by the first unavailable answer of a wait

    def restart(self) -> None:
        """The request got going again (admitted, then failed in a way worth a resubmission): a
        wait that follows is a new one, with the whole window."""
        self.until = None

    async def retry(self, exc: OmniError) -> bool:
        """Whether to submit again after ``exc``; pauses first when so."""
        if not isinstance(exc, Unavailable):
            return False
        now = time.monotonic()
        if self.until is None:
            self.until = now + self.wait_s
        pause = min(max(exc.retry_after, 0.2), 1.0)
        if now + pause < self.until and time.time() + pause < self.deadline:
            await asyncio.sleep(pause)
            return True
        return False


class Submissions:
    """The submissions of one client request, for a caller that consumes each one's stream::

        async with Submissions(bus, request_id, deadline) as submissions:
            while not submissions.done:
                async with submissions.attempt() as upstream_id:
                    stream = await bus.submit(<the Submit, under upstream_id>, …)
                    … read the stream (an async generator may yield here) …

    ``attempt()`` closes one submission: its stream is forgotten; a normal exit makes the request
    done; an error worth another submission is swallowed (the loop goes round under the next
    upstream id); any other error leaves carrying the client's ``request_id``. Leaving the outer
    block before done cancels the last submission upstream, shielded: a task cancelled again while
    it unwinds must still stop the worker. :meth:`finish` marks done early, for a caller that ends
    the request itself (its last event in hand, or upstream already cancelled by a stop string).

    ``retry_note()``: what the log line of a resubmission adds (what the client already has).
    ``unavailable_spends_a_resubmit``: whether a pause for an unavailable role takes one of the
    :data:`MAX_RESUBMITS` too (images, video, speech) or only resumable failures count (text
    generation, whose resumes are a metric of their own: :attr:`resumes`).
    """

    def __init__(self, bus: BusClient, request_id: str, deadline: float, *,
                 retry_note: Callable[[], str] = lambda: "resubmitting",
                 unavailable_spends_a_resubmit: bool = True, cancel_reason: str = CANCEL_REASON):
        self.bus = bus
        self.request_id = request_id
        self.upstream_id = request_id
        self.done = False
        self.resumes = 0        # submissions again after a resumable failure
        self.resubmits = 0      # … and after a pause for an unavailable role
        self._admission = AdmissionWait(deadline, bus.worker_wait_s)
        self._retry_note = retry_note
        self._unavailable_spends = unavailable_spends_a_resubmit
        self._cancel_reason = cancel_reason

    async def __aenter__(self) -> Submissions:
        return self

    async def __aexit__(self, *exc_info) -> None:
        if not self.done:
            await asyncio.shield(self.bus.cancel(self.upstream_id, self._cancel_reason))

    def finish(self) -> None:
        self.done = True

    @contextlib.asynccontextmanager
    async def attempt(self) -> AsyncIterator[str]:
        """One submission under :attr:`upstream_id` (see the class)."""
        upstream_id = self.upstream_id
        try:
            yield upstream_id
            self.done = True
        except OmniError as exc:
            if not await self._again(exc):
                exc.request_id = self.request_id
                raise
            await asyncio.shield(self.bus.cancel(upstream_id, "resubmitted"))
            self.resubmits += 1
            self.upstream_id = f"{self.request_id}.{self.resubmits}"
        finally:
            self.bus.forget(upstream_id)

    async def _again(self, exc: OmniError) -> bool:
        spent = self.resubmits if self._unavailable_spends else self.resumes
        if exc.resumable and spent < MAX_RESUBMITS:
            self.resumes += 1
            self._admission.restart()   # a worker lost now: the wait for another counts from here
            log.warning("%s: %s; %s", self.request_id, exc, self._retry_note())
            return True
        return await self._admission.retry(exc)


async def submit_until_done(bus: BusClient, submit: p.Submit, stream_for: Callable[[str], S], *,
                            progress: Callable[[], str] = lambda: "",
                            cancel_reason: str = CANCEL_REASON) -> tuple[Any, S]:
    """Submit ``submit`` (under ids derived from its ``request_id``) until a submission's stream,
    made by ``stream_for(upstream_id)``, finishes: returns ``(await stream.wait(), stream)``.
    ``progress()`` adds what is already in to the log line of a resubmission."""
    async with Submissions(bus, submit.request_id, submit.deadline, retry_note=lambda: "resubmitting" + progress(),
                           cancel_reason=cancel_reason) as submissions:
        while not submissions.done:
            async with submissions.attempt() as upstream_id:
                stream = stream_for(upstream_id)
                await bus.submit(msgspec.structs.replace(submit, request_id=upstream_id), stream)
                result = await stream.wait()
    return result, stream
