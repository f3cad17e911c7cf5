"""Decode attention read straight from the paged KV pool: a small C kernel, called through ctypes.

Why: on CPU a decode step's attention in torch ops is a gather of every running sequence's blocks
into one padded tensor (a full copy of the batch's KV, per layer) followed by SDPA over that copy;
for small models that is a third of the step. The kernel walks each sequence's block table and
reads keys and values in place: one pass over the bytes, no copy, no padding.

Why C through ctypes rather than a torch C++ extension: plain C against raw float pointers builds
with the system compiler in well under a second (no torch headers), and the ``.so`` is cached by
source hash under the omnirelay cache directory, built once per machine, atomically (concurrent
workers race safely). Without a compiler :func:`load` returns None, and for pool dtypes other than
float32 and bfloat16 the model keeps the torch path; both paths are tested against each other.

Numerics: float32 throughout (a bfloat16 pool's keys and values are widened exactly as they are read,
and the output rounded to bfloat16 once at the end, where the torch path rounds after each op), scores ``q·k * scale``, softmax with the row max subtracted, then the
probability-weighted sum of values — the same math as SDPA in a different summation order (~1e-7
relative), far inside the argmax margins the parity tests check. The kernel is compiled with
``-ffast-math`` (vectorised ``expf``, reassociated sums) but the library is linked without it, so
loading it leaves the process's floating-point mode (no flush-to-zero) untouched; a test checks.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

from omnirelay.paths import cache_root

log = logging.getLogger("omnirelay.worker")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A bfloat16 is the top half of a float32: widening is a shift, exact. */
static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

/* Round a float32 to the nearest bfloat16 (ties to even), kept as a float32. */
static inline float round_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Row ``at`` (D values) of a pool as float32: a float32 pool's row in place; a bfloat16 pool's row
   widened once into ``row`` (then read by all G query heads that share its KV head). Inlined into
   each exported entry point with a constant flag, so each compiles to its own vectorised loops. */
static inline __attribute__((always_inline)) const float *widen(const void *pool, int64_t at, int64_t D,
                                                               float *row, const int bf16) {
    if (!bf16) return (const float *)pool + at;
    const uint16_t *src = (const uint16_t *)pool + at;
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) row[d] = bf16_to_float(src[d]);
    return row;
}

/* Ask for block ``block`` of a pool (all its rows: bs tokens x Hkv heads x D values of ``esize``
   bytes) ahead of its use. Blocks are scattered pages of the pool and the hardware prefetcher stops
   at page boundaries, so without this each block starts with a miss to memory: at B=8 and 256 tokens
   of context on this host that tripled the kernel's time (7.9 ms for 24 layers whose pools sat in
   cache, 20 ms scattered in memory). */
static inline __attribute__((always_inline)) void prefetch_block(const void *pool, int64_t block, int64_t block_elems,
                                                                 int64_t esize) {
    const char *start = (const char *)pool + block * block_elems * esize;
    for (int64_t off = 0; off < block_elems * esize; off += 64) __builtin_prefetch(start + off, 0, 3);
}

/* q [B, q_stride] float32 (head h at q + b*q_stride + h*D), pools [num_blocks, bs, Hkv, D],
   tables [B, W], ctx [B], out [B, H*D] float32. Query heads g*G .. g*G+G-1 share KV head g. */
static inline __attribute__((always_inline)) int attention(
        const float *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int64_t *tables,
        const int64_t *ctx, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t W,
        float scale, const int bf16) {
    const int64_t G = H / Hkv;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) if (ctx[b] > max_ctx) max_ctx = ctx[b];
    float *scores = (float *)malloc(sizeof(float) * (size_t)(G * (max_ctx > 0 ? max_ctx : 1) + D));
    if (!scores) return -1;
    float *row = scores + G * (max_ctx > 0 ? max_ctx : 1);   /* one widened K or V row */
    const int64_t tok_stride = Hkv * D;
    const int64_t block_elems = bs * tok_stride;
    const int64_t esize = bf16 ? 2 : 4;
    /* Walk block by block: no per-token division, and each block's rows are contiguous. */
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = ctx[b];
        const int64_t nblk = (n + bs - 1) / bs;
        const int64_t *table = tables + b * W;
        for (int64_t h = 0; h < Hkv; h++) {
            const float *qh = q + b * q_stride + h * G * D;
            int64_t t = 0;
            for (int64_t j = 0; j < 2 && j < nblk; j++) prefetch_block(k_pool, table[j], block_elems, esize);
            for (int64_t j = 0; j < nblk; j++) {
                /* two blocks ahead; the V pass's first two blocks at the end of the K pass */
                if (j + 2 < nblk) prefetch_block(k_pool, table[j + 2], block_elems, esize);
                else if (j + 2 - nblk < nblk) prefetch_block(v_pool, table[j + 2 - nblk], block_elems, esize);
                int64_t kr = table[j] * bs * tok_stride + h * D;
                const int64_t m = n - t < bs ? n - t : bs;
                for (int64_t o = 0; o < m; o++, t++, kr += tok_stride) {
                    const float *key = widen(k_pool, kr, D, row, bf16);
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = qh + g * D;
                        float acc = 0.0f;
                        #pragma omp simd reduction(+:acc)
                        for (int64_t d = 0; d < D; d++) acc += qg[d] * key[d];
                        scores[g * n + t] = acc * scale;
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = scores + g * n;
                float mx = s[0];   /* n >= 1: the query's own key is always there; no infinities */
                for (int64_t i = 1; i < n; i++) mx = s[i] > mx ? s[i] : mx;
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) { s[i] = expf(s[i] - mx); sum += s[i]; }
                const float inv = 1.0f / sum;
                /* bf16: the unnormalised weights meet V rounded to bf16 and the sum divides after,
                   as torch's CPU flash attention computes a bf16 SDPA (closer greedy parity). */
                if (bf16) for (int64_t i = 0; i < n; i++) s[i] = round_to_bf16(s[i]) * inv;
                else for (int64_t i = 0; i < n; i++) s[i] *= inv;
            }
            float *oh = out + b * H * D + h * G * D;
            for (int64_t i = 0; i < G * D; i++) oh[i] = 0.0f;
            t = 0;
            for (int64_t j = 0; j < nblk; j++) {
                if (j + 2 < nblk) prefetch_block(v_pool, table[j + 2], block_elems, esize);
                else if (b + 1 < B && j + 2 - nblk < (ctx[b + 1] + bs - 1) / bs)   /* the next sequence's keys */
                    prefetch_block(k_pool, tables[(b + 1) * W + j + 2 - nblk], block_elems, esize);
                int64_t vr = table[j] * bs * tok_stride + h * D;
                const int64_t m = n - t < bs ? n - t : bs;
                for (int64_t o = 0; o < m; o++, t++, vr += tok_stride) {
                    const float *value = widen(v_pool, vr, D, row, bf16);
                    for (int64_t g = 0; g < G; g++) {
                        const float p = scores[g * n + t];
                        float *og = oh + g * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) og[d] += p * value[d];
                    }
                }
            }
        }
    }
    free(scores);
    return 0;
}

int paged_decode_attention(const float *q, int64_t q_stride, const float *k_pool, const float *v_pool,
                           const int64_t *tables, const int64_t *ctx, float *out,
                           int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t W, float scale) {
    return attention(q, q_stride, k_pool, v_pool, tables, ctx, out, B, H, Hkv, D, bs, W, scale, 0);
}

/* The same over a bfloat16 pool: keys and values widened to float32 as they are read (the pool
   is never copied), scores, softmax and the weighted sum in float32. */
int paged_decode_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k_pool, const uint16_t *v_pool,
                                const int64_t *tables, const int64_t *ctx, float *out,
                                int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t W, float scale) {
    return attention(q, q_stride, k_pool, v_pool, tables, ctx, out, B, H, Hkv, D, bs, W, scale, 1);
}
"""

# Compiled with -ffast-math (vectorised expf from libmvec, reassociated sums: ~1.8x faster here) but
# linked without it: GCC links crtfastmath.o into any object it *links* with -ffast-math, and loading
# that switches the whole process to flush-to-zero, which would change torch's float32 results too.
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=c11", "-c"]
_LINK = ["-shared"]
_lock = threading.Lock()
_loaded: dict[str, "PagedDecodeAttention | None"] = {}


def _cache_dir() -> pathlib.Path:
    return cache_root() / "kernels"


# The pool dtypes the kernel reads in place: float32 and bfloat16 (widened as read).
DTYPES = (torch.float32, torch.bfloat16)


class PagedDecodeAttention:
    def __init__(self, lib: ctypes.CDLL):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_attention"), (torch.bfloat16, "paged_decode_attention_bf16")):
            fn = getattr(lib, name)
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] (rows may be strided, heads contiguous), pools [num_blocks, bs, Hkv, D]
        contiguous float32 or bfloat16, tables [B, W] and context_lens [B] int64 → out [B, H * D]
        in the pool's dtype (accumulated in float32 either way)."""
        b, h, d = q.shape
        if q.dtype != torch.float32:
            q = q.float()   # [B, H, D]: a few KiB; the kernel's arithmetic is float32
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        tables = tables.contiguous()
        context_lens = context_lens.contiguous()
        out = torch.empty(b, h * d, dtype=torch.float32)
        rc = self._fns[k_pool.dtype](q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                                     tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), b, h,
                                     k_pool.shape[2], d, k_pool.shape[1], tables.shape[1], scale)
        if rc != 0:
            raise MemoryError("paged_decode_attention: out of memory for the score buffer")
        return out if k_pool.dtype == torch.float32 else out.to(k_pool.dtype)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line for line in handle if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def load() -> PagedDecodeAttention | None:
    """The compiled kernel, building it on first use; None where it cannot be built."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _build_and_load()
        return _loaded["kernel"]


def _build_and_load() -> PagedDecodeAttention | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    # -march=native: a cache directory shared between different CPUs must not share the binary.
    digest = hashlib.sha256((SOURCE + " ".join(_COMPILE + _LINK) + _cpu_flags()).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{digest}.so"
    try:
        if not target.exists():
            if compiler is None:
                log.warning("no C compiler: decode attention uses the torch path")
                return None
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = pathlib.Path(tmp) / "paged_attention.c"
                src.write_text(SOURCE)
                obj, built = pathlib.Path(tmp) / "paged_attention.o", pathlib.Path(tmp) / target.name
                for cmd in ([compiler, *_COMPILE, str(src), "-o", str(obj)],
                            [compiler, *_LINK, str(obj), "-o", str(built), "-lm"]):
                    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                os.replace(built, target)   # atomic: a racing builder's identical file is fine
        return PagedDecodeAttention(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not build the native decode attention (%s): using the torch path", exc)
        return None
