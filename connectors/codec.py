"""Payload codec: one msgpack header plus raw tensor bytes, no pickle, zero-copy decode.

Layout of an encoded payload::

    [u64 little-endian header length][msgpack header][pad to 64][entry bytes, each 64-aligned]…

The header is ``{"v": 1, "entries": [...]}`` with one entry per payload item:
``{"n": name, "k": "t", "dt": dtype, "sh": shape, "o": offset, "nb": nbytes}`` for tensors,
``{"n", "k": "b", "o", "nb"}`` for bytes and ``{"n", "k": "v", "val": value}`` for msgpack values.
Offsets are absolute from the start of the buffer. Decoding validates every offset against the
buffer and takes dtypes from a closed table, so a corrupt or hostile buffer raises
:class:`CodecError` instead of reading out of bounds or instantiating anything.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
import threading
from typing import Any

import msgpack
import torch

ALIGN = 64
_LEN = struct.Struct("<Q")
_MAX_HEADER = 16 * 1024 * 1024

_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
    torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}


class CodecError(ValueError):
    """The buffer is not a valid encoded payload."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class EncodePlan:
    """Where every item of a payload goes; ``size`` is the total number of bytes to allocate."""

    header: bytes
    size: int
    writes: tuple[tuple[int, Any], ...]   # (offset, tensor or bytes)


_local = threading.local()


def _pack(obj) -> bytes:
    """``msgpack.packb`` with a per-thread packer: building a Packer per call costs more than
    packing a small header (a Packer is not thread-safe, hence one per thread)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)


_PLACEHOLDER_OFFSET = 2**63 - 1   # the widest msgpack int: a header never grows when real offsets replace it
EXTRA_HEADER_ROOM = 1024          # header bytes a reservation keeps for the items put_reserved adds


def _item(name, value) -> tuple[dict, Any]:
    """A payload item's header entry (offset still unset) and the data to write (None: inline)."""
    if not isinstance(name, str):
        raise CodecError(f"payload keys must be str, got {type(name).__name__}")
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPE_NAMES:
            raise CodecError(f"{name}: unsupported dtype {value.dtype}")
        # Each step is skipped when it would be a no-op: on the hot path (a contiguous CPU
        # tensor) a torch call costs about as much as packing the header.
        tensor = value.detach() if value.requires_grad else value
        if not tensor.is_cpu:
            tensor = tensor.cpu()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        tensor = tensor.contiguous()
        return {"n": name, "k": "t", "dt": _DTYPE_NAMES[tensor.dtype], "sh": list(tensor.shape),
                "nb": tensor.nbytes}, tensor
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = memoryview(value)
        data = data.cast("B") if data.c_contiguous else memoryview(data.tobytes())
        return {"n": name, "k": "b", "nb": data.nbytes}, data
    return {"n": name, "k": "v", "val": value}, None


def _checked_pack(entries: list[dict]) -> bytes:
    """The header for ``entries``; CodecError for a value msgpack cannot take."""
    try:
        return _pack({"v": 1, "entries": entries})
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"payload value is not msgpack-able: {exc}") from None


def _place(entries: list[dict], pending: list, offset: int) -> tuple[list, int]:
    """Give every non-inline entry an offset from ``offset`` on (64-aligned); (writes, end)."""
    writes = []
    for entry, data in zip(entries, pending):
        if entry["k"] == "v":
            continue
        entry["o"] = offset
        writes.append((offset, data))
        offset = _align(offset + entry["nb"])
    return writes, offset


def plan(payload: dict[str, Any]) -> EncodePlan:
    entries, pending = [], []
    for name, value in payload.items():
        entry, data = _item(name, value)
        entries.append(entry)
        pending.append(data)
    # Offsets depend on the header length, and the header holds the offsets: fix the header size
    # first with placeholder offsets, then fill them in.
    for entry in entries:
        if entry["k"] != "v":
            entry["o"] = _PLACEHOLDER_OFFSET
    start = _align(_LEN.size + len(_checked_pack(entries)))
    writes, end = _place(entries, pending, start)
    header = _pack({"v": 1, "entries": entries})
    return EncodePlan(header=_LEN.pack(len(header)) + header, size=max(end, start), writes=tuple(writes))


@dataclasses.dataclass(frozen=True)
class ReservedLayout:
    """Where :func:`reserve_layout` put a reservation's tensors in an encoded buffer: header room
    first, then each tensor 64-aligned (``entries`` are their finished header entries)."""

    entries: tuple[dict, ...]
    start: int   # bytes kept for the length prefix and the header
    end: int     # end of the reserved tensors; items added at publish time go after it
    bare_header: bytes = b""   # the length-prefixed header when nothing is added at publish time


def reserve_layout(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> ReservedLayout:
    """Lay out tensors to be written in place before the rest of the payload is known. Memoised:
    a producer reserves the same few layouts over and over (a KV layer per sequence length)."""
    return _reserve_layout(tuple((name, tuple(shape), dtype) for name, (shape, dtype) in layout.items()))


@functools.lru_cache(maxsize=1024)
def _reserve_layout(layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]) -> ReservedLayout:
    entries = []
    for name, shape, dtype in layout:
        if dtype not in _DTYPE_NAMES:
            raise CodecError(f"{name}: unsupported dtype {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        entries.append({"n": name, "k": "t", "dt": _DTYPE_NAMES[dtype], "sh": list(shape),
                        "nb": numel * dtype.itemsize, "o": _PLACEHOLDER_OFFSET})
    start = _align(_LEN.size + len(_checked_pack(entries)) + EXTRA_HEADER_ROOM)
    _, end = _place(entries, [None] * len(entries), start)
    header = _pack({"v": 1, "entries": entries})
    return ReservedLayout(entries=tuple(entries), start=start, end=end, bare_header=_LEN.pack(len(header)) + header)


def reserved_views(buf: memoryview, reserved: ReservedLayout) -> dict[str, torch.Tensor]:
    """The reservation's tensors as writable views of ``buf`` (which holds the encoded payload)."""
    out = {}
    for entry in reserved.entries:
        dtype, shape = _DTYPES[entry["dt"]], entry["sh"]
        if entry["nb"] == 0:
            out[entry["n"]] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=dtype, count=entry["nb"] // dtype.itemsize, offset=entry["o"])
        out[entry["n"]] = flat.view(shape)
    return out


def plan_reserved(reserved: ReservedLayout, extra: dict[str, Any]) -> EncodePlan | None:
    """The plan that completes a reservation filled in place: the header (reserved tensors at their
    fixed offsets, then ``extra``'s items) and writes for ``extra``'s data only, placed after the
    tensors. None when the header does not fit the room kept for it (publish by copying instead)."""
    if not extra:
        return EncodePlan(header=reserved.bare_header, size=max(reserved.end, reserved.start), writes=())
    entries = [dict(e) for e in reserved.entries]
    added, added_data = [], []
    for name, value in extra.items():
        entry, data = _item(name, value)
        added.append(entry)
        added_data.append(data)
    writes, end = _place(added, added_data, reserved.end)
    entries += added
    header = _checked_pack(entries)
    if _LEN.size + len(header) > reserved.start:
        return None
    return EncodePlan(header=_LEN.pack(len(header)) + header, size=max(end, reserved.start), writes=tuple(writes))


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor of any dtype (bfloat16 and float8 included, which
    ``Tensor.numpy`` refuses), without a torch call per copy. Valid while ``tensor`` lives."""
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def write_into(buf: memoryview, encode_plan: EncodePlan) -> None:
    """Write an encoded payload into ``buf`` (at least ``encode_plan.size`` bytes, writable)."""
    buf[: len(encode_plan.header)] = encode_plan.header
    for offset, data in encode_plan.writes:
        if isinstance(data, torch.Tensor):
            if data.nbytes:
                buf[offset: offset + data.nbytes] = _tensor_bytes(data)   # one memcpy
        else:
            buf[offset: offset + data.nbytes] = data


def encode(payload: dict[str, Any]) -> bytearray:
    """Encode into a fresh ``bytearray`` (for backends that send bytes rather than map memory)."""
    encode_plan = plan(payload)
    out = bytearray(encode_plan.size)
    write_into(memoryview(out), encode_plan)
    return out


def decode(buf) -> dict[str, Any]:
    """Decode a payload. Tensors are zero-copy views into ``buf`` when it is writable
    (copy-on-write mappings count), so they keep ``buf`` alive. A read-only ``buf`` (``bytes``) is
    copied once, so no tensor ever aliases memory its owner considers immutable."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise CodecError("buffer must be contiguous")
    view = view.cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    if view.nbytes < _LEN.size:
        raise CodecError("buffer shorter than the length prefix")
    (header_len,) = _LEN.unpack_from(view, 0)
    if header_len > _MAX_HEADER or _LEN.size + header_len > view.nbytes:
        raise CodecError("header length out of bounds")
    try:
        header = msgpack.unpackb(view[_LEN.size: _LEN.size + header_len], raw=False, strict_map_key=False)
    except Exception as exc:
        raise CodecError(f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict) or header.get("v") != 1 or not isinstance(header.get("entries"), list):
        raise CodecError("unsupported header")
    out: dict[str, Any] = {}
    for entry in header["entries"]:
        if not isinstance(entry, dict) or type(entry.get("n")) is not str or entry.get("k") not in ("v", "b", "t"):
            raise CodecError("malformed header entry")
        name, kind = entry["n"], entry["k"]
        if kind == "v":
            if "val" not in entry:
                raise CodecError(f"{name}: value entry without a value")
            out[name] = entry["val"]
            continue
        offset, nbytes = entry.get("o"), entry.get("nb")
        if type(offset) is not int or type(nbytes) is not int:
            raise CodecError(f"{name}: offset and size must be integers")
        if offset < 0 or nbytes < 0 or offset + nbytes > view.nbytes:
            raise CodecError(f"{name}: data out of bounds")
        if kind == "b":
            out[name] = bytes(view[offset: offset + nbytes])
        elif kind == "t":
            dt = entry.get("dt")
            dtype = _DTYPES.get(dt) if isinstance(dt, str) else None
            shape = entry.get("sh")
            if dtype is None or not isinstance(shape, list):
                raise CodecError(f"{name}: bad dtype or shape")
            numel = 1
            for s in shape:
                if type(s) is not int or s < 0:
                    raise CodecError(f"{name}: bad dtype or shape")
                numel *= s
            if numel * dtype.itemsize != nbytes:
                raise CodecError(f"{name}: shape does not match byte count")
            if numel == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                flat = torch.frombuffer(view, dtype=dtype, count=numel, offset=offset)
                out[name] = flat if len(shape) == 1 else flat.view(shape)
    return out
