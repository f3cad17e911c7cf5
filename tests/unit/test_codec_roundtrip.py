"""Round trips through omnirelay.connectors.codec, the payload wire format every connector uses.

Covers every dtype in the codec's closed table, odd shapes (0-dim, empty, large, non-contiguous),
bytes and msgpack values (and the values encode must refuse), 64-byte alignment of data offsets and
zero-copy decoding. Reserved (write-in-place) layouts are in test_codec_reservations.py; corrupt and
hostile buffers in test_codec_corrupt_buffers.py.
"""

from __future__ import annotations

import struct
import warnings

import pytest
import torch

from omnirelay.connectors import codec
from omnirelay.connectors.codec import CodecError

from codec_support import ALL_DTYPES, LEN, assert_same_tensor, header_of, make_tensor


def roundtrip(payload):
    return codec.decode(codec.encode(payload))


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

