"""What one stage leaves for the next: typed hand-offs, carried by the bus in ``StageDone.outputs``
→ ``Task.inputs`` (and ``CancelTask.inputs``, ``Submit.inputs`` for the first stage), shared by every
daemon.

The broker passes a stage's hand-off on as the next stage's inputs without looking inside; its
decoder only checks the types (a msgspec tagged union, :data:`Handoff`). The producer builds one,
the consumer reads its fields, and whoever ends up holding one nobody will read (a cancelled or
failed request, a stale report) calls :meth:`release` with its connector: each hand-off knows which
connector keys it holds. The connector keys and handles inside are the connector's
(``Connector.put``'s ``key`` and handle map); what lies under the keys is each producer's payload.

==============  ==================  ==========================================================
hand-off        from → to           holds
==============  ==================  ==========================================================
MediaInputs     gateway → encode    the request's images/audio, inline (``Submit.inputs``)
EmbedsHandoff   encode → prefill    the encoder outputs under ``mm_key`` and the media shapes
KVHandoff       prefill → decode    the prompt's KV under ``kv_key`` (whole, or a layer-wise
                                    manifest: :func:`release_kv`), the first token, M-RoPE
                                    delta; for speech out also prefill's prompt states
SpeechHandoff   prefill/decode →    the thinker's hidden states of the prompt and (chat) of the
                generate (speech)   reply, for the talker: whole under one key, or streamed as
                                    ordered chunks (:class:`ChunkStream`) while decode still runs
==============  ==================  ==========================================================

Streamed hand-offs (:class:`ChunkStream`): a producer that lets its successor start before it
finishes (decode's spoken reply, ``runtime.stream_chunk_tokens`` > 0) writes chunk ``i`` under
``chunk_key(key, i)`` for i = 0, 1, … in order, the last one marked ``end``; the broker dispatches the
successor on ``StageStreaming`` as soon as chunk 0 exists, carrying a hand-off that names the stream.
The consumer reads the chunks in order (waiting for one not yet written) and deletes each once read;
the producer never has more than ``window`` chunks written and unread (it writes chunk ``i`` only
once chunk ``i - window`` is gone), so a slow consumer holds the producer's data back in the
producer's own memory, never in the store. ``release`` deletes every chunk the stream may hold
(``window`` bounds those not yet read from a known position; a holder that knows no position, as
when the consumer was lost mid-read, deletes every index up to ``max_chunks``), which is what a
cancel, on either side, does.

Wire form. A hand-off is a msgpack map of its fields plus ``"handoff": <tag>``, validated by the
bus decoder (:func:`omnirelay.broker.protocol.decode`) like every field; a map without the tag is
malformed. A field added later needs a default, like any protocol field.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Union

import msgspec

from omnirelay.errors import OmniError

log = logging.getLogger("omnirelay.handoffs")

TAG_FIELD = "handoff"
Handle = dict[str, Any]   # a connector's handle map (Connector.put's return), opaque here


class KeyStore(Protocol):
    """What releasing needs of a connector (``omnirelay.connectors.Connector`` is one)."""

    def get(self, key: str, handle: Handle | None = None, timeout: float = ...) -> dict[str, Any]: ...

    def delete(self, key: str) -> None: ...


class _Handoff(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False,
               tag_field=TAG_FIELD):
    """Base of every hand-off: frozen plain data (never in a reference cycle, like a bus message)."""

    def release(self, store: KeyStore) -> None:
        """Delete every connector key this hand-off holds (nobody will read them). Never raises for
        a key that cannot be deleted now: it expires by the connector's TTL."""


# The most pixels an image may declare anywhere: the gateway's --max-image-pixels may not exceed it and
# the encode worker refuses a larger header before decoding (an image reaches it from any bus peer).
MAX_IMAGE_PIXELS_CEILING = 100_000_000


class MediaItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One image (the encoded file) or audio clip (float32 little-endian PCM at 16 kHz)."""

    kind: str        # "image" | "audio" (checked by the encode worker: bad_request otherwise)
    data: bytes


class MediaInputs(_Handoff, tag="media"):
    """The first stage's inputs of an omni request, inline in the Submit: its media in prompt order."""

    media: list[MediaItem]


class EmbedsHandoff(_Handoff, tag="embeds"):
    """The encoder outputs of a request's media (``{"image_embeds", "audio_embeds",
    "image_deepstack"}`` under ``mm_key``), and the shapes prefill's M-RoPE positions need."""

    mm_key: str
    mm_handle: Handle | None = None
    image_grids: list[list[int]] = []
    audio_lengths: list[int] = []

    def release(self, store: KeyStore) -> None:
        delete_quietly(store, self.mm_key)


class ChunkStream(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A hand-off written in ordered chunks while its producer still runs (see the module docstring).

    Chunk ``i`` lies under :func:`chunk_key` ``(key, i)``; each is a payload of the producer's (for a
    spoken reply: ``{"token_ids": [...], "hidden": [r, H], "end": bool}``, the reply's next tokens and
    the states of those fed back into the thinker). ``max_chunks`` bounds the indexes, ``window`` the
    chunks written and not yet consumed."""

    key: str
    max_chunks: int
    window: int

    def chunk(self, index: int) -> str:
        return chunk_key(self.key, index)

    def release(self, store: KeyStore, first: int | None = None) -> None:
        """Delete the chunks that may be unread. ``first``: the consumer's count of chunks read, or
        the producer's first chunk not surely read: at most ``window`` chunks from there exist (the
        producer never writes further ahead). None, for a holder that knows neither (a consumer
        lost mid-read): every index the stream may use, up to ``max_chunks`` (a missing key is no
        error, so this costs one delete per index, on a rare path)."""
        if first is None:
            first, last = 0, min(self.max_chunks, MAX_STREAM_CHUNKS)
        else:
            last = min(first + max(0, min(self.window, MAX_STREAM_WINDOW)), self.max_chunks)
        for index in range(max(0, first), last):
            delete_quietly(store, self.chunk(index))


MAX_STREAM_WINDOW = 64        # bounds on the keys one release deletes, whatever a hand-off claims
MAX_STREAM_CHUNKS = 1 << 14


def chunk_key(key: str, index: int) -> str:
    return f"{key}/chunk/{index}"


class SpeechHandoff(_Handoff, tag="speech"):
    """The thinker's hidden states for the talker: prefill's ``{"hidden": [n, H], "image_grids",
    "audio_lengths"}`` under ``speech_prompt_key``; decode's ``{"hidden": [m-1, H], "token_ids":
    [m]}`` under ``speech_reply_key`` (empty for ``/v1/audio/speech``, whose reply is the prompt's tail),
    or, streamed, in the chunks of ``reply_stream`` (then ``speech_reply_key`` is empty)."""

    speech_prompt_key: str
    speech_prompt_handle: Handle | None = None
    speech_reply_key: str = ""
    speech_reply_handle: Handle | None = None
    reply_stream: ChunkStream | None = None

    def release(self, store: KeyStore) -> None:
        for key in (self.speech_prompt_key, self.speech_reply_key):
            if key:
                delete_quietly(store, key)
        if self.reply_stream is not None:
            self.reply_stream.release(store)


class KVHandoff(_Handoff, tag="kv"):
    """A prefilled prompt for decode: its KV under ``kv_key`` (a whole KV or a layer-wise manifest),
    the first token, and for a media prompt the M-RoPE delta (decode positions are index + delta).
    A request that speaks its reply also passes prefill's prompt states on (``speech_prompt_*``)."""

    kv_key: str
    kv_handle: Handle
    first_token: int
    rope_delta: int = 0
    has_media: bool = False
    speech_prompt_key: str = ""
    speech_prompt_handle: Handle | None = None
    lora: str = ""   # the LoRA adapter the KV was computed under; absent (the base) on the wire by default
    # The KV's layout: 0, one value under kv_key; L, a manifest under kv_key and one piece per layer
    # under piece_key(kv_key, layer), so a holder that must delete it knows every key without a get
    # (prefill always says; None, unknown: the manifest is read to learn it).
    layers: int | None = None

    def speech_prompt(self) -> SpeechHandoff | None:
        """Prefill's prompt states as the start of the speech hand-off (None: no speech out)."""
        if not self.speech_prompt_key:
            return None
        return SpeechHandoff(self.speech_prompt_key, self.speech_prompt_handle)

    def release(self, store: KeyStore) -> None:
        release_kv(store, self.kv_key, self.kv_handle, layers=self.layers)
        if self.speech_prompt_key:
            delete_quietly(store, self.speech_prompt_key)


Handoff = Union[MediaInputs, EmbedsHandoff, KVHandoff, SpeechHandoff]

# ------------------------------------------------------------------------------------------------
# Key names: every connector key a stage writes for the next, per request and attempt, so a retried
# stage never reads an earlier attempt's data. Named here only.

def kv_key(request_id: str, attempt: int) -> str:
    """Prefill's KV (a whole KV, or a layer-wise manifest with its pieces at :func:`piece_key`)."""
    return f"kv/{request_id}/{attempt}"


def media_key(request_id: str, attempt: int) -> str:
    """Encode's media embeddings."""
    return f"mm/{request_id}/{attempt}"


def speech_prompt_key(request_id: str, attempt: int) -> str:
    """Prefill's prompt hidden states for the talker."""
    return f"speech/{request_id}/{attempt}/prompt"


def speech_reply_key(prompt_key: str, request_id: str) -> str:
    """Decode's reply states (or their chunk stream) beside prefill's prompt states at
    ``prompt_key``: the same request and prefill attempt, whichever decode attempt writes them."""
    return (prompt_key.removesuffix("/prompt") or f"speech/{request_id}") + "/reply"


# ------------------------------------------------------------------------------------------------
# Releasing a KV hand-off. A layer-wise KV (workers/kv/export.py) is a manifest under the key and
# one piece per layer under piece_key(key, layer); the manifest names how many. Shared here because
# every holder of a KVHandoff (decode, a prefill whose report went stale) must delete the pieces too.

def piece_key(key: str, layer: int) -> str:
    return f"{key}/layer/{layer}"


def release_kv(store: KeyStore, key: str, handle: Handle | None = None, *, layers: int | None = None) -> None:
    """Delete a KV hand-off nobody will import (a cancelled or failed request): the manifest and,
    for a layerwise one, every piece. ``layers`` is its layout (:attr:`KVHandoff.layers`); a holder
    that does not know it (None) reads the key to learn it. Does not wait for a key that is not there."""
    if layers is not None:
        _delete_kv(store, key, layers)
        return
    try:
        payload = store.get(key, handle, timeout=0.0)
    except OmniError:
        delete_quietly(store, key)   # gone already, never written, or the store is down
        return
    delete_kv_payload(store, key, payload)


def delete_kv_payload(store: KeyStore, key: str, payload: dict) -> None:
    """Delete ``key`` and, when ``payload`` (what it held) is a layer-wise manifest, its pieces."""
    layers = payload.get("layerwise")
    _delete_kv(store, key, layers if isinstance(layers, int) else 0)


def _delete_kv(store: KeyStore, key: str, layers: int) -> None:
    """``key`` and its ``layers`` pieces (bounded: the count may come from a stored manifest)."""
    for layer in range(max(0, min(layers, 1 << 16))):
        delete_quietly(store, piece_key(key, layer))
    delete_quietly(store, key)


def delete_quietly(store: KeyStore, key: str) -> None:
    """Clean-up after a failure or cancel: a store that is down then (a Redis outage) must not turn
    one failed request into a dead worker. What cannot be deleted now expires by the backend's TTL
    (Redis) or is swept with its owner's segments (shared memory)."""
    try:
        store.delete(key)
    except OmniError as exc:
        log.warning("could not delete %r (left to expire): %s", key, exc)
