"""Tests for omnirelay.connectors.codec: the payload wire format every connector uses.

Covers round trips of every dtype in the codec's closed table, odd shapes (0-dim, empty, large,
non-contiguous), bytes and msgpack values, 64-byte alignment of data offsets, zero-copy decoding,
and hostile/corrupt buffers, which must raise ``CodecError`` and nothing else.
"""

from __future__ import annotations

import random
import struct
import warnings

import msgpack
import pytest
import torch

from omnirelay.connectors import codec
from omnirelay.connectors.codec import CodecError

LEN = struct.Struct("<Q")

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
    torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]


# --------------------------------------------------------------------------------------------- helpers


def make_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Deterministic non-trivial values of any dtype in the table (bit patterns, not just zeros)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return (torch.randint(0, 2, (numel,), generator=g) == 1).reshape(shape)
    if dtype.is_complex:
        real_dtype = torch.float32 if dtype == torch.complex64 else torch.float64
        re = torch.randn(numel, generator=g, dtype=real_dtype)
        im = torch.randn(numel, generator=g, dtype=real_dtype)
        return torch.complex(re, im).reshape(shape)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 3).to(dtype).reshape(shape)
    # Integers: random raw bytes reinterpreted, so the full range (sign bit, top bit of uint64) shows up.
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same_tensor(got, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert raw_bytes(got) == raw_bytes(want)  # bitwise: works for NaN, float8, bool, uint64 alike


def roundtrip(payload):
    return codec.decode(codec.encode(payload))


def header_of(buf) -> tuple[int, dict]:
    (n,) = LEN.unpack_from(buf, 0)
    return n, msgpack.unpackb(bytes(buf[LEN.size: LEN.size + n]), raw=False)


DATA_AT = 192  # crafted buffers: header region padded to this many bytes, then the data


def craft(entries, data_size: int = 256, header=None) -> bytearray:
    """A buffer with a hand-written header, zero padding up to ``DATA_AT`` and then ``data_size``
    bytes of 0x11 (so the whole buffer is ``DATA_AT + data_size`` bytes)."""
    head = msgpack.packb({"v": 1, "entries": entries} if header is None else header, use_bin_type=True)
    region = LEN.pack(len(head)) + head
    assert len(region) <= DATA_AT, "crafted header too long for the test layout"
    return bytearray(region + bytes(DATA_AT - len(region)) + b"\x11" * data_size)


def buffer_address(buf: bytearray) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


# ------------------------------------------------------------------------------------------- dtypes


def test_dtype_table_is_exactly_the_documented_set():
    assert set(codec._DTYPES.values()) == set(ALL_DTYPES)
    # Names are the torch names without prefix, one per dtype.
    for name, dtype in codec._DTYPES.items():
        assert str(dtype) == "torch." + name


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_roundtrip_every_dtype(dtype):
    payloads = {
        "vec": make_tensor(dtype, (37,), seed=1),
        "mat": make_tensor(dtype, (5, 9), seed=2),
        "scalar": make_tensor(dtype, (), seed=3),
        "empty": make_tensor(dtype, (0,), seed=4),
        "empty3d": make_tensor(dtype, (3, 0, 2), seed=5),
        "strided": make_tensor(dtype, (8, 6), seed=6)[::2, 1::3],
        "transposed": make_tensor(dtype, (4, 7), seed=7).t(),
    }
    out = roundtrip(payloads)
    assert set(out) == set(payloads)
    for name, t in payloads.items():
        assert_same_tensor(out[name], t)


def test_extreme_integer_values_survive():
    payload = {
        "u64": torch.tensor([0, 1, 2**63, 2**64 - 1], dtype=torch.uint64),
        "i64": torch.tensor([-(2**63), -1, 0, 2**63 - 1], dtype=torch.int64),
        "u32": torch.tensor([0, 2**32 - 1], dtype=torch.uint32),
        "u16": torch.tensor([0, 2**16 - 1], dtype=torch.uint16),
        "f32_special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    }
    out = roundtrip(payload)
    for name, t in payload.items():
        assert_same_tensor(out[name], t)


# -------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (5, 0), (2, 0, 3), (1,), (1, 1, 1, 1), (3, 4, 5, 6)])
def test_shapes(shape):
    t = make_tensor(torch.float32, shape, seed=11)
    out = roundtrip({"t": t})
    assert_same_tensor(out["t"], t)


def test_zero_dim_stays_zero_dim():
    out = roundtrip({"s": torch.tensor(3.5, dtype=torch.float64), "i": torch.tensor(7)})
    assert out["s"].dim() == 0 and out["s"].item() == 3.5
    assert out["i"].dim() == 0 and out["i"].item() == 7


def test_large_tensor():
    t = make_tensor(torch.bfloat16, (1024, 1024), seed=12)  # 2 MiB
    big = torch.arange(1 << 20, dtype=torch.int32)            # 4 MiB
    out = roundtrip({"t": t, "big": big})
    assert_same_tensor(out["t"], t)
    assert torch.equal(out["big"], big)


@pytest.mark.parametrize("view", [
    "transpose", "step_slice", "step_slice_2d", "narrow_offset", "expand", "permute", "channels_last",
    "diagonal", "requires_grad",
])
def test_non_contiguous_and_offset_views(view):
    base = make_tensor(torch.float32, (6, 8, 4), seed=13)
    t = {
        "transpose": base[0].t(),
        "step_slice": base.reshape(-1)[3::5],
        "step_slice_2d": base[::2, 1::3, ::2],
        "narrow_offset": base.reshape(-1)[17:41],            # contiguous but non-zero storage offset
        "expand": torch.arange(4.0).reshape(1, 4).expand(5, 4),  # stride 0
        "permute": base.permute(2, 0, 1),
        "channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "diagonal": base[0, :4].diagonal(),
        "requires_grad": torch.randn(3, 3, requires_grad=True),
    }[view]
    out = roundtrip({"t": t})
    assert_same_tensor(out["t"], t)
    assert out["t"].is_contiguous()
    assert not out["t"].requires_grad


def test_put_copies_source_tensor():
    t = torch.arange(10.0)
    buf = codec.encode({"t": t})
    t.fill_(-1)
    assert torch.equal(codec.decode(buf)["t"], torch.arange(10.0))


@pytest.mark.parametrize("kind", ["conj", "conj_2d", "neg_bit"])
def test_conj_and_neg_views_roundtrip(kind):
    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    t = {"conj": x.conj(), "conj_2d": x.reshape(3, 1).conj(), "neg_bit": torch._neg_view(x.real.contiguous())}[kind]
    out = roundtrip({"t": t})
    assert torch.equal(out["t"], t.resolve_conj().resolve_neg())


# ----------------------------------------------------------------------------------- bytes / values


@pytest.mark.parametrize("value", [
    b"", b"x", b"\x00" * 1000, bytes(range(256)) * 3, bytearray(b"bytearray!"), memoryview(b"a memoryview"),
], ids=["empty", "one", "zeros", "all_bytes", "bytearray", "memoryview"])
def test_bytes_values(value):
    out = roundtrip({"b": value})
    assert isinstance(out["b"], bytes)
    assert out["b"] == bytes(value)


def test_bytes_from_typed_memoryview_are_raw_bytes():
    arr = memoryview(bytearray(range(8))).cast("H")  # 4 uint16 items
    assert roundtrip({"b": arr})["b"] == bytes(range(8))


def test_non_contiguous_memoryview_bytes():
    mv = memoryview(b"abcdefgh")[::2]
    assert roundtrip({"b": mv})["b"] == b"aceg"


@pytest.mark.parametrize("value", [
    None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, -0.25, float("inf"), "", "str",
    "ünïcödé ✓ 中文", [], {}, [1, "two", None, [3.0, [4]]],
    {"a": [1, {"b": None, "c": [True, False]}], "d": "x", "e": {"f": {"g": {}}}},
    {"nested_bytes": b"\x00\x01"},
], ids=repr)
def test_msgpack_values(value):
    out = roundtrip({"v": value})
    assert out["v"] == value
    assert type(out["v"]) is type(value)


def test_tuple_value_comes_back_as_list():
    assert roundtrip({"v": (1, 2, (3,))})["v"] == [1, 2, [3]]


@pytest.mark.parametrize("value", [{1, 2}, object(), [torch.zeros(1)], {"x": torch.zeros(1)}, 1j],
                         ids=["set", "object", "tensor_in_list", "tensor_in_map", "complex"])
def test_unsupported_values_raise_codec_error(value):
    with pytest.raises(CodecError):
        codec.encode({"v": value})


def test_non_str_payload_key_raises_codec_error():
    with pytest.raises(CodecError):
        codec.encode({1: torch.zeros(1)})


@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fnuz], ids=str)
def test_unsupported_dtype_raises_codec_error(dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is "experimental"
        t = torch.zeros(2, dtype=dtype)
    with pytest.raises(CodecError):
        codec.encode({"t": t})


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, [2**70]], ids=repr)
def test_out_of_range_int_raises_codec_error(value):
    with pytest.raises(CodecError):
        codec.encode({"v": value})


def test_map_with_int_keys_roundtrips_or_is_rejected_at_encode():
    payload = {"v": {1: "one", 2: [3]}}
    try:
        buf = codec.encode(payload)
    except CodecError:
        return  # rejecting at encode time is acceptable; producing an undecodable buffer is not
    assert codec.decode(buf) == payload


def test_mixed_payload():
    payload = {
        "kv": make_tensor(torch.bfloat16, (2, 4, 16, 8), seed=21),
        "mask": make_tensor(torch.bool, (16,), seed=22),
        "ids": torch.arange(16, dtype=torch.int64),
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "blob": b"\x00\xffraw",
        "meta": {"request_id": "r-1", "positions": [0, 1, 2], "eos": None},
        "count": 3,
        "scale": make_tensor(torch.float8_e4m3fn, (4, 4), seed=23).t(),
    }
    out = roundtrip(payload)
    assert list(out) == list(payload)  # order preserved
    for name, value in payload.items():
        if isinstance(value, torch.Tensor):
            assert_same_tensor(out[name], value)
        else:
            assert out[name] == value


def test_empty_payload():
    buf = codec.encode({})
    assert len(buf) % codec.ALIGN == 0
    assert codec.decode(buf) == {}


# ------------------------------------------------------------------------------ layout / alignment


def test_offsets_are_64_aligned_and_disjoint():
    payload = {
        "a": torch.ones(3, dtype=torch.int8),        # 3 bytes: forces padding
        "b": torch.ones(5, dtype=torch.float64),
        "v": {"x": "y" * 100},                        # inflates the header
        "c": b"odd-length-bytes",
        "d": torch.ones(7, dtype=torch.bfloat16),
        "e": torch.ones(0, dtype=torch.float32),
        "f": torch.ones((), dtype=torch.complex128),
    }
    buf = codec.encode(payload)
    p = codec.plan(payload)
    assert len(buf) == p.size
    assert len(buf) % 64 == 0
    n, header = header_of(buf)
    assert header["v"] == 1
    spans = []
    for entry in header["entries"]:
        if entry["k"] == "v":
            assert "o" not in entry
            continue
        assert entry["o"] % 64 == 0, entry
        assert entry["o"] >= LEN.size + n
        assert entry["o"] + entry["nb"] <= len(buf)
        spans.append((entry["o"], entry["o"] + entry["nb"]))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start


def test_tensor_data_addresses_are_64_aligned_in_aligned_buffer():
    import mmap
    payload = {"a": torch.ones(3, dtype=torch.int8), "b": torch.randn(17), "c": torch.randn(2, 3).double()}
    p = codec.plan(payload)
    with mmap.mmap(-1, p.size) as m:  # page-aligned, like a shared memory segment
        codec.write_into(memoryview(m), p)
        out = codec.decode(m)
        for t in out.values():
            assert t.data_ptr() % 64 == 0
        del out, t


def test_write_into_larger_buffer():
    payload = {"t": torch.arange(12.0).reshape(3, 4), "b": b"xyz", "v": [1, 2]}
    p = codec.plan(payload)
    buf = bytearray(p.size + 4096)
    codec.write_into(memoryview(buf), p)
    out = codec.decode(buf)
    assert torch.equal(out["t"], payload["t"]) and out["b"] == b"xyz" and out["v"] == [1, 2]


# ---------------------------------------------------------------------------------------- zero-copy


def test_decode_is_zero_copy_from_writable_buffer():
    payload = {"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    buf = codec.encode(payload)
    out = codec.decode(buf)
    base, end = buffer_address(buf), buffer_address(buf) + len(buf)
    _, header = header_of(buf)
    offsets = {e["n"]: e["o"] for e in header["entries"]}
    for name, t in out.items():
        assert base <= t.data_ptr() < end
        assert t.data_ptr() - base == offsets[name]
    # Mutating the buffer is visible in the tensor and vice versa.
    a_off = offsets["a"]
    buf[a_off: a_off + 4] = struct.pack("<f", 42.0)
    assert out["a"][0].item() == 42.0
    out["b"][1, 2] = -7
    assert struct.unpack_from("<q", buf, offsets["b"] + 5 * 8)[0] == -7


def test_decoded_tensor_keeps_buffer_alive():
    import gc
    buf = codec.encode({"t": torch.arange(1000, dtype=torch.int32)})
    t = codec.decode(buf)["t"]
    del buf
    gc.collect()
    assert torch.equal(t, torch.arange(1000, dtype=torch.int32))


def test_decode_accepts_memoryview_and_bytes():
    payload = {"t": torch.arange(5.0), "b": b"q"}
    buf = codec.encode(payload)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for src in (memoryview(buf), bytes(buf)):
            out = codec.decode(src)
            assert torch.equal(out["t"], payload["t"]) and out["b"] == b"q"


def test_decode_of_readonly_bytes_does_not_alias_immutable_memory():
    src = bytes(codec.encode({"t": torch.zeros(4)}))
    snapshot = bytes(bytearray(src))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the UserWarning from torch.frombuffer fails the test
        out = codec.decode(src)
    out["t"].add_(1)
    assert src == snapshot


# ------------------------------------------------------------------- reservations (write in place)


RESERVE_SHAPES = {"vec": (37,), "mat": (5, 9), "scalar": (), "empty": (0,), "empty3d": (3, 0, 2)}


def reserved_buffer(layout: dict, room: int) -> tuple[codec.ReservedLayout, bytearray, dict[str, torch.Tensor]]:
    """Lay out ``layout`` the way a backend lends it: a buffer with ``room`` bytes after the reserved
    tensors for the items added at publish time, and the tensors as writable views into it."""
    reserved = codec.reserve_layout(layout)
    buf = bytearray(reserved.end + room)
    return reserved, buf, codec.reserved_views(memoryview(buf), reserved)


def publish_reserved(reserved: codec.ReservedLayout, buf: bytearray, extra: dict) -> dict:
    """plan_reserved + write_into, then decode what a consumer would receive."""
    encode_plan = codec.plan_reserved(reserved, extra)
    assert encode_plan is not None
    assert encode_plan.size <= len(buf)
    codec.write_into(memoryview(buf), encode_plan)
    return codec.decode(memoryview(buf)[: encode_plan.size])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_reserved_tensors_filled_in_place_decode_bit_exact(dtype):
    want = {name: make_tensor(dtype, shape, seed=i) for i, (name, shape) in enumerate(RESERVE_SHAPES.items())}
    want["other_dtype"] = make_tensor(torch.int8 if dtype != torch.int8 else torch.float16, (3, 3), seed=9)
    reserved, buf, views = reserved_buffer({n: (tuple(t.shape), t.dtype) for n, t in want.items()}, room=4096)
    assert list(views) == list(want)
    for name, view in views.items():
        assert view.dtype == want[name].dtype and view.shape == want[name].shape and view.is_contiguous()
        view.copy_(want[name])
    extra = {"extra_tensor": make_tensor(dtype, (2, 3), seed=10).t(), "blob": b"\x00\xffraw" * 7,
             "meta": {"request_id": "r-1", "positions": [0, 1, 2], "eos": None}, "count": 3}
    out = publish_reserved(reserved, buf, extra)

    assert list(out) == [*want, *extra]   # reserved tensors first, in layout order, then the extras
    for name, t in want.items():
        assert_same_tensor(out[name], t)
        if t.numel():   # decoded from the very memory the producer filled: nothing was copied
            assert out[name].data_ptr() == views[name].data_ptr()
    assert_same_tensor(out["extra_tensor"], extra["extra_tensor"])
    assert out["blob"] == extra["blob"] and out["meta"] == extra["meta"] and out["count"] == 3


def test_reserved_offsets_are_64_aligned_after_the_header_room_and_extras_after_them():
    layout = {"a": ((3,), torch.int8), "b": ((5,), torch.float64), "c": ((7,), torch.bfloat16),
              "d": ((0,), torch.float32)}
    reserved, buf, views = reserved_buffer(layout, room=1024)
    for view in views.values():
        view.fill_(1)
    encode_plan = codec.plan_reserved(reserved, {"x": b"odd-length", "y": torch.ones(3, dtype=torch.int8)})
    codec.write_into(memoryview(buf), encode_plan)
    n, header = header_of(buf)
    assert LEN.size + n <= reserved.start
    spans = []
    for entry in header["entries"]:
        assert entry["o"] % 64 == 0 and entry["o"] >= reserved.start, entry
        if entry["n"] in ("x", "y"):
            assert entry["o"] >= reserved.end, entry
        else:
            assert entry["o"] + entry["nb"] <= reserved.end, entry
        spans.append((entry["o"], entry["o"] + entry["nb"]))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start


def test_reservation_without_extras_and_extras_without_reservation():
    reserved, buf, views = reserved_buffer({"t": ((4, 4), torch.float32)}, room=0)
    views["t"].copy_(torch.arange(16.0).reshape(4, 4))
    assert torch.equal(publish_reserved(reserved, buf, {})["t"], torch.arange(16.0).reshape(4, 4))

    reserved, buf, views = reserved_buffer({}, room=256)
    assert views == {}
    assert publish_reserved(reserved, buf, {"v": [1, "two"], "b": b"xyz"}) == {"v": [1, "two"], "b": b"xyz"}


def test_large_extra_bytes_need_no_header_room():
    """Only an item's header entry takes header room; its data goes after the tensors."""
    reserved, buf, views = reserved_buffer({"t": ((8,), torch.int64)}, room=(1 << 20) + 64)
    views["t"].copy_(torch.arange(8))
    blob = bytes(range(256)) * 4096   # 1 MiB
    out = publish_reserved(reserved, buf, {"blob": blob})
    assert out["blob"] == blob and torch.equal(out["t"], torch.arange(8))


@pytest.mark.parametrize("extra", [
    {"meta": "x" * 2000},
    {"names": [f"name-{i}" for i in range(300)]},
    {f"item{i}": i for i in range(200)},
], ids=["long_string", "long_list", "many_items"])
def test_extra_header_that_does_not_fit_the_room_plans_nothing(extra):
    reserved = codec.reserve_layout({"t": ((4,), torch.float32)})
    assert codec.plan_reserved(reserved, extra) is None   # the backend publishes by copying instead
    fitting = {"meta": "x" * 500}   # well inside the room kept for extras
    assert codec.plan_reserved(reserved, fitting) is not None


@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fnuz], ids=str)
def test_reserve_layout_of_an_unsupported_dtype_raises_codec_error(dtype):
    with pytest.raises(CodecError):
        codec.reserve_layout({"ok": ((2,), torch.float32), "t": ((2,), dtype)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexHalf is "experimental"
        t = torch.zeros(2, dtype=dtype)
    with pytest.raises(CodecError):   # nor may an extra tensor have one
        codec.plan_reserved(codec.reserve_layout({"ok": ((2,), torch.float32)}), {"t": t})


@pytest.mark.parametrize("value", [{1, 2}, object(), [torch.zeros(1)], 1j, 2**64],
                         ids=["set", "object", "tensor_in_list", "complex", "int_too_big"])
def test_extra_value_that_msgpack_cannot_take_raises_codec_error(value):
    reserved = codec.reserve_layout({"t": ((4,), torch.float32)})
    with pytest.raises(CodecError):
        codec.plan_reserved(reserved, {"v": value})


# --------------------------------------------------------------------------------- corrupt buffers


def _valid_small():
    return codec.encode({
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "h": torch.ones(3, dtype=torch.bfloat16),
        "b": b"bytes!",
        "v": {"k": [1, None, "s"]},
    })


@pytest.mark.parametrize("buf", [b"", b"\x00", b"\x00" * 7], ids=["empty", "1", "7"])
def test_shorter_than_length_prefix(buf):
    with pytest.raises(CodecError):
        codec.decode(buf)


def test_every_truncation_raises_or_decodes_identically():
    buf = _valid_small()
    _, header = header_of(buf)
    data_end = max(e["o"] + e["nb"] for e in header["entries"] if e["k"] != "v")
    full = codec.decode(buf)
    for n in range(len(buf)):
        cut = bytearray(buf[:n])
        if n < data_end:
            with pytest.raises(CodecError):
                codec.decode(cut)
        else:  # only trailing padding removed
            out = codec.decode(cut)
            assert torch.equal(out["t"], full["t"]) and out["b"] == full["b"]


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, 16 * 1024 * 1024 + 1, 10**6])
def test_header_length_too_big(length):
    buf = _valid_small()
    LEN.pack_into(buf, 0, length)
    with pytest.raises(CodecError):
        codec.decode(buf)


@pytest.mark.parametrize("delta", [-1, -5, +1, +9])
def test_header_length_wrong(delta):
    buf = _valid_small()
    (n,) = LEN.unpack_from(buf, 0)
    LEN.pack_into(buf, 0, n + delta)
    with pytest.raises(CodecError):
        codec.decode(buf)


@pytest.mark.parametrize("head", [b"\xc1", b"\xff\xff\xff", b"\x92\x01", b"\xdd\xff\xff\xff\xff"],
                         ids=["never_used", "junk", "short_array", "huge_array"])
def test_non_msgpack_header(head):
    buf = bytearray(LEN.pack(len(head)) + head + bytes(64))
    with pytest.raises(CodecError):
        codec.decode(buf)


@pytest.mark.parametrize("header", [
    [1, 2], "str", 5, None, {}, {"v": 2, "entries": []}, {"v": 1}, {"v": 1, "entries": {}},
    {"v": 1, "entries": "x"}, {"v": "1", "entries": []},
], ids=repr)
def test_unsupported_header_structure(header):
    with pytest.raises(CodecError):
        codec.decode(craft(None, header=header))


T = {"n": "t", "k": "t", "dt": "float32", "sh": [2], "nb": 8}


def _entry(**kw):
    return {**T, "o": DATA_AT, **kw}


@pytest.mark.parametrize("entry", [
    5, "entry", None, [1, 2], {}, {"n": "x"}, {"k": "t"}, {"n": "x", "k": "b"}, {"n": "x", "k": "b", "o": 0},
    {"n": "x", "k": "t", "o": 0, "nb": 0}, {"n": "x", "k": "zz", "o": 0, "nb": 0},
    {"n": "x", "k": "b", "o": "abc", "nb": 1}, {"n": "x", "k": "b", "o": 0, "nb": [1]},
    {"n": "x", "k": "b", "o": float("nan"), "nb": 1},
], ids=repr)
def test_malformed_entries(entry):
    with pytest.raises(CodecError):
        codec.decode(craft([entry]))


@pytest.mark.parametrize("entry", [
    _entry(o=-1), _entry(o=-64), _entry(o=10**9), _entry(o=2**63 - 1), _entry(o=2**64 - 1),
    _entry(nb=-8, sh=[-2]), _entry(o=10**6, nb=0, sh=[0]),
    {"n": "b", "k": "b", "o": 0, "nb": 10**9}, {"n": "b", "k": "b", "o": -1, "nb": 1},
    {"n": "b", "k": "b", "o": 2**63, "nb": 2**63},
], ids=repr)
def test_offsets_out_of_bounds(entry):
    buf = craft([entry])
    with pytest.raises(CodecError):
        codec.decode(buf)


@pytest.mark.parametrize("dt", ["float4", "object", "torch.float32", "Float", "", "complex32", "float8_e4m3fnuz",
                                None, 3])
def test_unknown_dtype(dt):
    with pytest.raises(CodecError):
        codec.decode(craft([_entry(dt=dt)]))


@pytest.mark.parametrize("sh, nb", [
    ([3], 8), ([2], 7), ([2], 9), ([], 8), ([0], 8), ([2, 2], 8), ([2**62], 8), ([2**32, 2**32], 0),
    ([2**40, 0], 8), ([-1, -2], 8), ([1.5], 8), (["2"], 8), ([None], 8), ("2", 8), (2, 8), ({"a": 1}, 8), (None, 8),
], ids=repr)
def test_shape_byte_mismatch_and_bad_shapes(sh, nb):
    with pytest.raises(CodecError):
        codec.decode(craft([_entry(sh=sh, nb=nb)]))


def test_crafted_valid_entry_decodes():
    """Sanity check of ``craft``: a well-formed hand-written entry decodes (0x11 bytes)."""
    out = codec.decode(craft([_entry(dt="uint8", sh=[2, 4])]))
    assert torch.equal(out["t"], torch.full((2, 4), 0x11, dtype=torch.uint8))


@pytest.mark.parametrize("entry", [
    {"n": [1], "k": "b", "o": 0, "nb": 1},
    {"n": {"a": 1}, "k": "t", "dt": "uint8", "sh": [1], "o": 0, "nb": 1},
    _entry(dt=[1]),
    _entry(dt={"x": 1}),
    {"n": "b", "k": "b", "o": float("inf"), "nb": 1},
    {"n": "b", "k": "b", "o": 0, "nb": float("-inf")},
    _entry(dt="uint8", sh=[True], nb=1),
], ids=["list_name", "map_name", "list_dt", "map_dt", "inf_offset", "inf_nbytes", "bool_shape"])
def test_hostile_entry_fields_raise_codec_error(entry):
    with pytest.raises(CodecError):
        codec.decode(craft([entry]))


def _fuzz(seed: int, iterations: int) -> dict[str, int]:
    """Flip bytes of valid encodings (mostly in the header, where structure lives); decode must either
    raise CodecError or return a dict whose tensors can be read. Returns outcome counts: "ok",
    "CodecError", and any other exception by type name."""
    rng = random.Random(seed)
    bases = [
        _valid_small(),
        codec.encode({"a": torch.arange(4, dtype=torch.int16), "m": {"x": [1.5, "y", None]}, "e": torch.empty(0)}),
        codec.encode({"z": torch.tensor(1.0, dtype=torch.float64), "q": b"", "c": torch.ones(2, dtype=torch.complex64)}),
    ]
    outcomes: dict[str, int] = {}  # outcome name -> count
    for _ in range(iterations):
        base = rng.choice(bases)
        buf = bytearray(base)
        header_end = LEN.size + LEN.unpack_from(base, 0)[0]
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(header_end) if rng.random() < 0.6 else rng.randrange(len(buf))
            buf[pos] = rng.randrange(256) if rng.random() < 0.5 else buf[pos] ^ (1 << rng.randrange(8))
        if rng.random() < 0.1:
            buf = buf[: rng.randrange(len(buf))]
        try:
            out = codec.decode(buf)
        except Exception as exc:  # noqa: BLE001 - anything but CodecError is what we are looking for
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
            continue
        outcomes["ok"] = outcomes.get("ok", 0) + 1
        assert isinstance(out, dict)
        for value in out.values():
            if isinstance(value, torch.Tensor) and value.numel():
                value.reshape(-1).view(torch.uint8).sum()  # touch every byte
    return outcomes


@pytest.mark.parametrize("seed", [20240611, 7])
def test_random_corruption_only_raises_codec_error(seed):
    outcomes = _fuzz(seed=seed, iterations=500)
    assert set(outcomes) <= {"ok", "CodecError"}, outcomes
    # The loop must exercise both paths, or it proves nothing.
    assert outcomes.get("ok", 0) >= 20 and outcomes.get("CodecError", 0) >= 100, outcomes


_HOSTILE_VALUES = [
    None, True, False, 0, 1, -1, 63, 64, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.5, float("inf"),
    float("-inf"), float("nan"), "", "t", "b", "v", "float32", "uint64", "bool", [], [0], [1, 2], [-1], [True],
    [2**40, 2**40], {}, {"n": "x"}, b"\x00",
]


def _structured_fuzz(seed: int, iterations: int) -> dict[str, int]:
    """Re-encode valid headers with one or two fields replaced by a hostile msgpack value of any
    type; decode must raise CodecError or return a dict. Returns outcome counts like ``_fuzz``."""
    rng = random.Random(seed)
    base = _valid_small()
    n, header = header_of(base)
    data = bytes(base[LEN.size + n:])
    outcomes: dict[str, int] = {}
    for _ in range(iterations):
        entries = [dict(e) for e in header["entries"]]
        for _ in range(rng.randint(1, 2)):
            entry = rng.choice(entries)
            entry[rng.choice(["n", "k", "dt", "sh", "o", "nb", "val"])] = rng.choice(_HOSTILE_VALUES)
        head = msgpack.packb({"v": 1, "entries": entries}, use_bin_type=True)
        # Keep data offsets meaningful: pad the new header to the old header's length when possible.
        head_region = LEN.pack(len(head)) + head
        buf = bytearray(head_region + data[max(0, len(head_region) - LEN.size - n):])
        try:
            out = codec.decode(buf)
        except Exception as exc:  # noqa: BLE001
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
            continue
        outcomes["ok"] = outcomes.get("ok", 0) + 1
        assert isinstance(out, dict)
    return outcomes


def test_structured_header_fuzz_only_raises_codec_error():
    outcomes = _structured_fuzz(seed=99, iterations=500)
    assert set(outcomes) <= {"ok", "CodecError"}, outcomes
