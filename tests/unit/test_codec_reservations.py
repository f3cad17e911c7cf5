"""Reserved layouts of omnirelay.connectors.codec: tensors a producer fills in place in a buffer a
backend lends, then published with the items added at publish time, and decoded bit-exact without a
copy; what does not fit the reserved header room, or cannot be encoded, is refused."""

from __future__ import annotations

import warnings

import pytest
import torch

from omnirelay.connectors import codec
from omnirelay.connectors.codec import CodecError

from codec_support import ALL_DTYPES, LEN, assert_same_tensor, header_of, make_tensor


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

