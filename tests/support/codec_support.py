"""What the codec tests share: the codec's dtype table as the tests know it, deterministic tensors of
any of those dtypes, a bitwise tensor comparison, and a reader for an encoded buffer's header."""

from __future__ import annotations

import struct

import msgpack
import torch

LEN = struct.Struct("<Q")  # the length prefix in front of every encoded header

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
    torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]


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


def header_of(buf) -> tuple[int, dict]:
    (n,) = LEN.unpack_from(buf, 0)
    return n, msgpack.unpackb(bytes(buf[LEN.size: LEN.size + n]), raw=False)
