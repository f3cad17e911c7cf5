"""Corrupt and hostile buffers given to omnirelay.connectors.codec.decode: truncations, wrong header
lengths, non-msgpack or malformed headers and entries, out-of-bounds offsets, unknown dtypes, shape and
size mismatches, and random corruption; each must raise ``CodecError`` and nothing else."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from omnirelay.connectors import codec
from omnirelay.connectors.codec import CodecError

from codec_support import LEN, header_of


DATA_AT = 192  # crafted buffers: header region padded to this many bytes, then the data


def craft(entries, data_size: int = 256, header=None) -> bytearray:
    """A buffer with a hand-written header, zero padding up to ``DATA_AT`` and then ``data_size``
    bytes of 0x11 (so the whole buffer is ``DATA_AT + data_size`` bytes)."""
    head = msgpack.packb({"v": 1, "entries": entries} if header is None else header, use_bin_type=True)
    region = LEN.pack(len(head)) + head
    assert len(region) <= DATA_AT, "crafted header too long for the test layout"
    return bytearray(region + bytes(DATA_AT - len(region)) + b"\x11" * data_size)


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
