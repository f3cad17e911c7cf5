"""Content names of KV blocks, shared by the prefill engine and whoever routes to it.

Plain Python (hashlib, struct; no torch) so the broker or gateway can import it cheaply. A full
block's name is ``blake2b(parent name || its token ids as little-endian int64)``, 16 bytes, so a
name stands for the block's tokens *and* everything before them; a partial last block has none.
Equal names on two workers mean equal KV (same model and block size).

A LoRA adapter changes every block's KV: under adapter ``X`` the chain starts from
``blake2b("lora:" + X)`` instead of the empty parent (``salt``), so a prefix computed under one
adapter never matches another adapter's or the base's. Without an adapter the names are unchanged.
A request's ``cache_salt`` (vLLM's) enters the same seed (``"lora:" + X + "\\0salt:" + S``), so equal
prompts under different salts share no block: a tenant cannot learn by timing whether another
tenant's prompt is cached. Without a salt the names are unchanged.
"""

from __future__ import annotations

import hashlib
import struct

HASH_BYTES = 16
# Tokens per KV block: the default of every worker's paged cache (WorkerConfig.block_size) and the
# block size gateways hash prompts with for prefix-aware routing (the broker uses a hint only for
# workers whose cache has the hint's block size, so a worker configured otherwise is never misrouted).
DEFAULT_BLOCK_SIZE = 16


def block_hashes(token_ids: list[int], block_size: int, lora: str = "", salt: str = "") -> list[bytes]:
    """Chain hashes of the full blocks of ``token_ids``, first block first; ``lora``: the
    adapter the KV is computed under ("": the base); ``salt``: the request's ``cache_salt``."""
    out: list[bytes] = []
    parent = b""
    if lora or salt:
        seed = b"lora:" + lora.encode() + (b"\x00salt:" + salt.encode() if salt else b"")
        parent = hashlib.blake2b(seed, digest_size=HASH_BYTES).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.blake2b(parent + struct.pack(f"<{block_size}q", *block), digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out
