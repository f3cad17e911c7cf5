"""The LLM engines' hand-off transfers, as jobs for the shared
:class:`~omnirelay.workers.runtime.transfers.TransferPool`: nothing here runs on a step thread.
(Decode's KV import, the other direction, is :mod:`~omnirelay.workers.kv.prefetch`.)

* :class:`MediaFetch` (prefill) — a multimodal prompt's encoder outputs (the encode stage's
  hand-off), fetched while the prompt waits for admission; other prompts are admitted and step meanwhile.
* :class:`HandoffSend` (prefill) — what one prefill step hands on: for every sequence that finished
  its prompt in that step and goes on, its prompt hidden states (speech) and its KV, either a whole
  tensor gathered into connector memory on the step thread (a ``reserve``\\ d payload, published
  here) or the step's layerwise export (:class:`~omnirelay.workers.kv.export.LayerwiseExport`,
  completed here: its thread joined and the manifests put).
* :class:`SpeechReplySend` (decode) — a finished spoken reply's token ids and hidden states for the
  generate stage, next to prefill's prompt states.

Ownership (the pool's rule): until the engine takes a job's result, the job owns the keys, the
reservations and the export it was given, and ``discard`` frees all of them: a media key is
deleted (its request is gone or failed; not when the worker stops, see :class:`MediaFetch`), a send releases every reservation it did not publish,
aborts an export it did not complete and deletes every key it published, and a spoken reply's
prompt and reply states are deleted.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import msgspec
import torch

from omnirelay.connectors import Connector
from omnirelay.connectors.base import Handle, Payload, Reservation
from omnirelay.errors import OmniError
from omnirelay.handoffs import EmbedsHandoff, SpeechHandoff, delete_quietly, release_kv
from omnirelay.workers.kv.export import LayerwiseExport

@dataclasses.dataclass
class MediaFetch:
    """Get the encoder outputs under ``media.mm_key``. The key stays after a successful get: the
    engine deletes it when the prefill ends, so a retry after this worker died still finds it.
    Discarded, the fetch deletes the key (its request is gone or failed) unless the engine cleared
    ``delete_on_discard`` first: a worker that stops hands its requests back to the broker, whose
    retry elsewhere reads the same key."""

    media: EmbedsHandoff
    deadline: float
    delete_on_discard: bool = True
    writes_only: ClassVar[bool] = False   # a get: waits for the key, always on a transfer thread

    @property
    def name(self) -> str:
        return self.media.mm_key

    def run(self, connector: Connector, timeout: float, scratch: None) -> Payload:
        return connector.get(self.media.mm_key, self.media.mm_handle, timeout=timeout)

    def discard(self, connector: Connector, result: Payload | None) -> None:
        if self.delete_on_discard:
            self.media.release(connector)


@dataclasses.dataclass
class OutgoingHandoff:
    """One finished sequence's hand-off to send. ``kv_key`` empty: no KV goes on (the request
    ended at its first token, only speech follows); ``reservation`` None with a ``kv_key``: the
    KV is in the step's layerwise export."""

    request_id: str
    kv_key: str = ""
    reservation: Reservation | None = None
    num_tokens: int = 0
    speech_key: str = ""
    speech_payload: Payload | None = None


@dataclasses.dataclass
class SentHandoff:
    """What :class:`HandoffSend` published for one sequence, or why it could not (``error``: then
    nothing of this sequence is left under any key)."""

    kv_handle: Handle | None = None
    speech: SpeechHandoff | None = None
    error: OmniError | None = None

    def release(self, connector: Connector, kv_key: str, layers: int | None = None) -> None:
        """Delete what was published (the request went away before its hand-off reached the broker);
        ``layers``: the KV's layout, when the caller knows it (else the key is read to learn it)."""
        if self.speech is not None:
            self.speech.release(connector)
        if self.kv_handle is not None:
            release_kv(connector, kv_key, self.kv_handle, layers=layers)


class HandoffSend:
    """Publish one step's hand-offs; the result maps each request id to its :class:`SentHandoff`.
    A sequence whose speech put or KV failed gets an error and keeps nothing: its other part is
    deleted. Only an unexpected exception fails the whole job (the pool then discards it)."""

    writes_only = True   # puts and the export's completion: inline on a local connector

    def __init__(self, outgoing: list[OutgoingHandoff], export: LayerwiseExport | None, deadline: float):
        self.outgoing = outgoing
        self.export = export
        self.deadline = deadline
        self._published: list[tuple[str, SentHandoff]] = []   # (KV key, what was put), in order
        self._exported: dict[str, Handle | OmniError] = {}       # the layerwise export's manifests

    @property
    def name(self) -> str:
        """The keys it sends, for logs and errors (built only when one is written)."""
        return ", ".join(o.kv_key or o.speech_key for o in self.outgoing) or "layerwise export clean-up"

    def run(self, connector: Connector, timeout: float, scratch: None) -> dict[str, SentHandoff]:
        if self.export is not None:   # manifests for the sequences that go on; every other piece deleted
            self._exported = self.export.complete({o.kv_key for o in self.outgoing if o.kv_key and o.reservation is None})
        exported = self._exported
        sent: dict[str, SentHandoff] = {}
        for item in self.outgoing:
            done = SentHandoff()
            self._published.append((item.kv_key, done))
            try:
                if item.speech_payload is not None:
                    handle = connector.put(item.speech_key, item.speech_payload)
                    done.speech = SpeechHandoff(item.speech_key, handle)
                if item.reservation is not None:
                    reservation, item.reservation = item.reservation, None   # over once put_reserved returns or raises
                    done.kv_handle = connector.put_reserved(item.kv_key, reservation, {"num_tokens": item.num_tokens})
                elif item.kv_key:
                    handle = exported.get(item.kv_key)
                    if isinstance(handle, OmniError):
                        raise handle
                    done.kv_handle = handle
            except OmniError as exc:   # this sequence fails: what it put so far goes
                done.release(connector, item.kv_key)
                done.speech = done.kv_handle = None
                manifest = exported.pop(item.kv_key, None)
                if isinstance(manifest, dict):
                    release_kv(connector, item.kv_key, manifest)
                sent[item.request_id] = SentHandoff(error=exc)
                continue
            sent[item.request_id] = done
        return sent

    def discard(self, connector: Connector, result: dict[str, SentHandoff] | None) -> None:
        for item in self.outgoing:
            if item.reservation is not None:
                connector.release(item.reservation)
                item.reservation = None
        if self.export is not None:
            self.export.abort()   # not yet completed: joins its thread, deletes every piece put
        for key, done in self._published:   # delete_quietly underneath: never raises for a store that is down
            done.release(connector, key)
        recorded = {key for key, done in self._published if done.kv_handle is not None}
        for key, handle in self._exported.items():   # manifests put but not yet recorded (an exception between)
            if isinstance(handle, dict) and key not in recorded:
                release_kv(connector, key, handle)


@dataclasses.dataclass
class SpeechReplySend:
    """Put a finished reply's states under ``reply_key``; the result is ``prompt`` (prefill's
    hand-off) with the reply added, what the generate stage reads."""

    prompt: SpeechHandoff
    reply_key: str
    payload: Payload
    deadline: float
    writes_only: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.reply_key

    def run(self, connector: Connector, timeout: float, scratch: None) -> SpeechHandoff:
        handle = connector.put(self.reply_key, self.payload)
        return msgspec.structs.replace(self.prompt, speech_reply_key=self.reply_key, speech_reply_handle=handle)

    def discard(self, connector: Connector, result: SpeechHandoff | None) -> None:
        self.prompt.release(connector)
        delete_quietly(connector, self.reply_key)


def speech_payload(hidden: list[torch.Tensor], media: EmbedsHandoff | None) -> Payload:
    """The prompt states the speech stage reads (the talker places media tokens as the thinker does)."""
    return {"hidden": torch.cat(hidden),
            "image_grids": [list(g) for g in media.image_grids] if media else [],
            "audio_lengths": list(media.audio_lengths) if media else []}
