"""Layer-by-layer KV export: a prefill step's KV leaves while its later layers still compute.

The whole-KV path (``kv_transfer: whole``) reads a finished sequence's KV out of the pool after the
forward and puts it as one ``[layers, 2, seq, kv_heads, head_dim]`` tensor: the transfer starts only
when the last layer is done. Here (``kv_transfer: layerwise``, the default where the runner holds
the whole model in this process) the step that runs a sequence's last prompt chunk streams each
layer's KV as soon as the forward has written it into the pool:

Life of one step's export (:class:`LayerwiseExport`, owned by the prefill step that made it)::

    forward: layer i's K/V written to the pool ──layer_done(i)──▶ bounded queue (layer ids)
    transfer thread: layer i ──gather the sequence's blocks into connector memory (reserve)──▶
        put_reserved ``<key>/layer/<i>`` (per sequence)
    after the forward: complete(keep) ──join the thread──▶ for each kept sequence, the manifest is
        put under ``<key>`` itself, last; every other piece (a sequence whose first token ended it,
        or any sequence of a failed transfer) is deleted
    abort() (an exception anywhere in the step): stop, join, delete every piece put

State of an export: STREAMING → COMPLETED | FAILED | ABORTED (:class:`ExportState`).

Why a piece covers the whole sequence of its layer: under chunked prefill a long prompt's earlier
chunks put their KV into the pool in earlier steps; the export runs only in the step of its last
chunk, and reads the layer's whole sequence from the blocks (prefix-cache hits included).

What overlaps: the puts of layers ``0..i`` with the compute of layers ``i+1..``; the step (and so the
stage report that makes the broker dispatch decode) ends when the last piece and the manifest are
out, so what remains after the forward is the last layer's put, not the whole KV's read + put. The
decode side does not overlap with the prefill: it imports a finished KV.

Why pieces plus a manifest, not a chunk stream the consumer follows: a consumer waiting chunk after
chunk only pays when it starts before the producer ends (not the case here: decode starts after the
stage report), and a failed KV export must delete every piece it put. The manifest with the piece
handles also lets the consumer fetch each piece by handle rather than by key lookup.

Consumer contract (:func:`import_kv`, decode's KV import): the key the prefill worker reports is the
manifest's; it is put after every piece was readable and the stage reports done after that, so a
consumer never sees a partial KV. The manifest ``{"layerwise": L, "num_tokens": n, "handles":
[...]}`` names the piece handles; :func:`import_kv` reads the pieces, assembles the full-head whole
tensor (what any runner's ``write_kv`` takes, so a decode at another TP size re-shards it as
before) and deletes every key. A whole-format payload (``{"kv": …}``) is accepted too, so a decode
worker serves prefill workers of either setting. :func:`~omnirelay.handoffs.release_kv` (``KVHandoff.release``) deletes what a cancelled or
failed request left under a key, pieces included.

Threads: one transfer thread per exporting step, started by :class:`LayerwiseExport` and joined by
its ``complete``/``abort``, which the step calls in a ``finally``: no thread outlives the step, so
the engine has nothing to stop at shutdown. Reading layer ``i`` from the pool on that thread is safe:
the forward writes only later layers after ``layer_done(i)``, and the sequence's blocks are released
only after the step joined the thread. On CUDA the thread waits for an event recorded on the
compute stream after layer ``i``'s write, and gathers on a side stream (that path has no test on the
CPU-only hosts the suite runs on).

Parallel groups (TP > 1 or PP > 1, :class:`~omnirelay.workers.llm.parallel.GroupRunner`): the layers'
heads live on other ranks, which would each have to send per layer inside the forward; those
workers keep the whole-KV export (gathered once by rank 0 after the forward). The payload format the
decode side reads is the same either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import queue
import threading

import torch

from omnirelay.connectors import Connector
from omnirelay.errors import OmniError, TransferFailed
# The release side of the layer-wise format lives with the hand-off types: every KVHandoff holder releases.
from omnirelay.handoffs import delete_kv_payload, delete_quietly, piece_key


TRANSFER_MODES = ("auto", "layerwise", "whole")
# "auto" streams layers only for a step whose finishing sequences hold at least this much KV: below
# it the send a layerwise export hides is a few ms, less than its thread costs the forward (measured
# in BENCHMARKS.md, "Layerwise KV export vs whole KV": 1.5–6 ms saved vs a 2–5 % slower forward at
# 4–8 MiB; 40–150 ms saved at 45–90 MiB).
LAYERWISE_MIN_BYTES = 16 << 20
_STOP = -1


class ExportState(enum.Enum):
    STREAMING = "streaming"   # the forward runs; pieces are being put
    COMPLETED = "completed"   # thread joined, manifests written for the kept sequences
    FAILED = "failed"         # a put failed: every piece was deleted
    ABORTED = "aborted"       # stopped from outside: every piece was deleted


@dataclasses.dataclass
class ExportSequence:
    """One sequence finishing its prefill in this step: its manifest key, blocks and length."""

    key: str
    blocks: list[int]
    num_tokens: int
    handles: list = dataclasses.field(default_factory=list)   # piece handles, in layer order
    put_keys: list[str] = dataclasses.field(default_factory=list)


class LayerwiseExport:
    """One prefill step's layer-by-layer export. ``cache``: the local
    :class:`~omnirelay.workers.kv.cache.PagedKVCache` the forward writes; ``num_layers``: its layers."""

    def __init__(self, connector: Connector, cache, sequences: list[ExportSequence], num_layers: int):
        self.connector = connector
        self.cache = cache
        self.sequences = sequences
        self.num_layers = num_layers
        self.state = ExportState.STREAMING
        self.error: BaseException | None = None
        self._stop = threading.Event()
        # Bounded by the layer count: layer_done never blocks the forward, and at most one entry per
        # layer (plus the stop marker) waits.
        self._queue: queue.Queue = queue.Queue(maxsize=num_layers + 1)
        self._cuda = cache.device.type == "cuda"
        self._side_stream = torch.cuda.Stream(cache.device) if self._cuda else None
        self._index = {id(s): torch.tensor(s.blocks[: -(-s.num_tokens // cache.block_size)], dtype=torch.long,
                                           device=cache.device) for s in sequences}
        self._thread = threading.Thread(target=self._run, name="kv-export", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ compute thread

    def layer_done(self, layer: int) -> None:
        """Called by the forward right after layer ``layer``'s K/V reached the pool."""
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.cache.device))
        self._queue.put((layer, event))

    def complete(self, keep: set[str]) -> dict[str, dict | OmniError]:
        """Join the transfer thread; put the manifest of each sequence in ``keep`` (key → its handle)
        and delete the pieces of the others. On a failed transfer every piece is deleted and each
        kept key maps to the error instead."""
        self._join()
        if self.state is ExportState.ABORTED:
            return {s.key: TransferFailed(f"KV export of {s.key!r} was aborted")
                    for s in self.sequences if s.key in keep}
        out: dict[str, dict | OmniError] = {}
        for seq in self.sequences:
            if seq.key not in keep:
                self._delete(seq)
                continue
            if self.error is None and len(seq.handles) != self.num_layers:
                self.error = TransferFailed(f"KV export of {seq.key!r}: {len(seq.handles)} of {self.num_layers} "
                                            "layers were put (the forward skipped layers)")
            if self.error is not None:
                self._delete(seq)
                out[seq.key] = _as_omni_error(self.error, seq.key)
                continue
            try:
                manifest = {"layerwise": self.num_layers, "num_tokens": seq.num_tokens, "handles": seq.handles}
                out[seq.key] = self.connector.put(seq.key, manifest)
                seq.put_keys.append(seq.key)   # abort() after a later failure in here deletes it too
            except OmniError as exc:
                self._delete(seq)
                out[seq.key] = exc
        self.state = ExportState.FAILED if self.error is not None else ExportState.COMPLETED
        return out

    def abort(self) -> None:
        """Stop putting, join the thread and delete every piece put. Idempotent; a no-op once
        :meth:`complete` ran."""
        if self.state is not ExportState.STREAMING:
            return
        self._stop.set()
        self._join()
        for seq in self.sequences:
            self._delete(seq)
        self.state = ExportState.ABORTED

    def _join(self) -> None:
        if self._thread.is_alive():
            self._queue.put((_STOP, None))
            self._thread.join()

    def _delete(self, seq: ExportSequence) -> None:
        for key in seq.put_keys:
            delete_quietly(self.connector, key)
        seq.put_keys.clear()
        seq.handles.clear()

    # ------------------------------------------------------------------ transfer thread

    def _run(self) -> None:
        while True:
            layer, event = self._queue.get()
            if layer == _STOP:
                return
            if self._stop.is_set() or self.error is not None:
                continue   # keep draining until the stop marker: the forward may still call layer_done
            try:
                self._put_layer(layer, event)
            except BaseException as exc:   # noqa: BLE001 - handed to complete(), which reports it per request
                self.error = exc

    def _put_layer(self, layer: int, event) -> None:
        row_shape, dtype = tuple(self.cache.keys[layer].shape[2:]), self.cache.keys[layer].dtype
        for seq in self.sequences:
            if self._stop.is_set():
                return
            shape = (seq.num_tokens, *row_shape)
            reservation = self.connector.reserve({"k": (shape, dtype), "v": (shape, dtype)})
            try:
                # The gather writes straight into the connector's memory (on CUDA: gathered on a
                # side stream once layer ``layer``'s write is done, then one copy to the host).
                with torch.cuda.stream(self._side_stream) if self._cuda else contextlib.nullcontext():
                    if self._cuda:
                        self._side_stream.wait_event(event)
                    self.cache.read_layer_into(layer, seq.blocks, self._index[id(seq)], seq.num_tokens,
                                               reservation.tensors["k"], reservation.tensors["v"])
            except BaseException:
                self.connector.release(reservation)
                raise
            key = piece_key(seq.key, layer)
            # Recorded before the put returns: a put that fails half way may still have written.
            seq.put_keys.append(key)
            seq.handles.append(self.connector.put_reserved(key, reservation))


def _as_omni_error(exc: BaseException, key: str) -> OmniError:
    if isinstance(exc, OmniError):
        return exc
    return TransferFailed(f"KV export of {key!r} failed: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------- consumer side


class StagingBuffer:
    """A host buffer, reused, into which :func:`import_kv` assembles a layerwise KV: fresh memory
    costs a first touch of every page (~0.5 GB/s here, DESIGN.md), a warm buffer runs at memcpy
    speed. Up to ``keep_bytes`` stay allocated between imports; a larger KV gets a buffer of its own.
    The tensor it hands out is valid until the next call (the caller writes it into its pool first)."""

    def __init__(self, keep_bytes: int = 256 << 20):
        self.keep_bytes = keep_bytes
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        if nbytes > self.keep_bytes:
            return torch.empty(shape, dtype=dtype)
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)


def import_kv(connector: Connector, key: str, handle: dict | None, *, timeout: float,
              staging: StagingBuffer | None = None) -> torch.Tensor:
    """The full-head ``[layers, 2, seq, kv_heads, head_dim]`` KV under ``key`` (either format), on
    the host; every key of it is deleted, also when a piece is missing (TransferFailed). A layerwise
    KV is assembled in ``staging`` when given (then valid until its next use), else in a new tensor."""
    payload = connector.get(key, handle, timeout=timeout)
    if "kv" in payload:
        connector.delete(key)
        return payload["kv"]
    try:
        layers, num_tokens, handles = _manifest(key, payload)
        kv = None
        for layer in range(layers):
            name = piece_key(key, layer)
            piece = connector.get(name, handles[layer], timeout=timeout)
            k, v = piece["k"], piece["v"]
            if k.shape[0] != num_tokens or v.shape != k.shape:
                raise TransferFailed(f"KV piece {name!r}: shapes {tuple(k.shape)}/{tuple(v.shape)} "
                                     f"for {num_tokens} tokens")
            if kv is None:
                shape = (layers, 2, *k.shape)
                kv = torch.empty(shape, dtype=k.dtype) if staging is None else staging.tensor(shape, k.dtype)
            kv[layer, 0], kv[layer, 1] = k, v   # the one copy out of the connector's memory
        return kv
    finally:
        delete_kv_payload(connector, key, payload)


def _manifest(key: str, payload: dict) -> tuple[int, int, list]:
    layers, num_tokens, handles = payload.get("layerwise"), payload.get("num_tokens"), payload.get("handles")
    if not (isinstance(layers, int) and layers > 0 and isinstance(num_tokens, int) and isinstance(handles, list)
            and len(handles) == layers):
        raise TransferFailed(f"KV under {key!r} is neither a whole KV nor a layerwise manifest")
    return layers, num_tokens, handles
