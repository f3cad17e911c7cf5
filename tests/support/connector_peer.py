"""The other side of a connector test, in its own process (not a test module).

    python tests/support/connector_peer.py [<backend> <options json>]

Prints ``{"ready": pid}`` (after creating the connector, when one is named), then answers one JSON
line per command read from stdin (see :func:`handle`); ``{"op": "open", "backend", "options"}``
switches to a new connector (closing the previous one), so one peer process serves every backend
of a test module. Payloads are built from a seed by :func:`make_payload`, identically in
both processes, so each side can check the other's bytes exactly. No pickle crosses the pipe.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time
import traceback

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
          torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


def _random_bits(shape, dtype, g: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN payloads, subnormals and all)."""
    nbytes = int(torch.tensor(shape).prod().item()) * dtype.itemsize if len(shape) else dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def make_payload(seed: int, big_mb: float = 0.0) -> dict:
    """Every dtype, odd and empty shapes, non-contiguous views, bytes and msgpack values."""
    g = torch.Generator().manual_seed(seed)
    payload: dict = {}
    for i, dtype in enumerate(DTYPES):
        payload[f"t_{str(dtype).removeprefix('torch.')}"] = _random_bits((3, 5 + i % 3), dtype, g)
    base = _random_bits((8, 6), torch.float32, g)
    payload.update({
        "kv_layered": _random_bits((2, 2, 7, 3, 16), torch.bfloat16, g),
        "strided": base[::2, 1::2],
        "transposed": base.t(),
        "expanded": torch.arange(4, dtype=torch.int32).expand(3, 4),
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "empty_3d": torch.empty(2, 0, 3, dtype=torch.int64),
        "blob": bytes(range(256)) * 3 + seed.to_bytes(4, "little"),
        "empty_blob": b"",
        "meta": {"seed": seed, "names": ["a", "b"], "none": None, "f": 1.5, "nested": {"x": [1, 2, {"y": True}]}},
        "count": seed,
        "text": f"seed-{seed}-\u00e9\u4e2d",
    })
    if big_mb:
        payload["big"] = _random_bits((int(big_mb * (1 << 20)) // 4,), torch.int32, g)
    return payload


def same_payload(got: dict, want: dict) -> list[str]:
    """Names whose values differ (bitwise, dtype and shape for tensors)."""
    if set(got) != set(want):
        return sorted(set(got) ^ set(want))
    bad = []
    for name, w in want.items():
        value = got[name]
        if isinstance(w, torch.Tensor):
            ok = (isinstance(value, torch.Tensor) and value.dtype == w.dtype and value.shape == w.shape
                  and torch.equal(value.contiguous().reshape(-1).view(torch.uint8),
                                  w.contiguous().reshape(-1).view(torch.uint8)))
        else:
            ok = type(value) is type(w) and value == w
        if not ok:
            bad.append(name)
    return bad


def put_reserved(conn, key: str, payload: dict) -> dict:
    """Publish ``payload`` the in-place way: reserve its tensors' layout (contiguous tensors of the
    same shapes and dtypes), fill them from the payload, and hand the other items over as ``extra``."""
    tensors = {name: value for name, value in payload.items() if isinstance(value, torch.Tensor)}
    extra = {name: value for name, value in payload.items() if not isinstance(value, torch.Tensor)}
    reservation = conn.reserve({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    try:
        for name, t in tensors.items():
            reservation.tensors[name].copy_(t)
    except BaseException:
        conn.release(reservation)
        raise
    return conn.put_reserved(key, reservation, extra)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def handle(conn, command: dict, streams: dict) -> dict:
    """Run one command against ``conn`` and return the reply."""
    op = command["op"]
    if op == "put":
        return {"handle": conn.put(command["key"], make_payload(command["seed"], command.get("big_mb", 0.0)))}
    if op == "put_reserved":   # the same payload as "put", written in place (reserve → put_reserved)
        return {"handle": put_reserved(conn, command["key"], make_payload(command["seed"], command.get("big_mb", 0.0)))}
    if op == "get":
        t0 = time.monotonic()
        try:
            got = conn.get(command["key"], command.get("handle"), timeout=command.get("timeout", 10.0))
        except Exception as exc:  # noqa: BLE001 - the reply carries it to the test
            return {"error": _error(exc), "elapsed": time.monotonic() - t0}
        want = command.get("seed")
        bad = [] if want is None else same_payload(got, make_payload(want, command.get("big_mb", 0.0)))
        return {"bad": bad, "elapsed": time.monotonic() - t0}
    if op == "delete":
        conn.delete(command["key"])
        return {}
    if op == "put_many":   # [[key, seed], …] from `threads` threads at once
        with concurrent.futures.ThreadPoolExecutor(command.get("threads", 2)) as pool:
            handles = list(pool.map(lambda ks: conn.put(ks[0], make_payload(ks[1])), command["items"]))
        return {"handles": handles}
    if op == "get_many":   # [[key, handle or null, seed], …]; deletes each key after checking it
        def one(item):
            key, key_handle, seed = item
            try:
                bad = same_payload(conn.get(key, key_handle, timeout=command.get("timeout", 20.0)), make_payload(seed))
                conn.delete(key)
                return [key, bad]
            except Exception as exc:  # noqa: BLE001
                return [key, _error(exc)]
        with concurrent.futures.ThreadPoolExecutor(command.get("threads", 2)) as pool:
            return {"results": list(pool.map(one, command["items"]))}
    if op == "get_hold":   # get and keep the payload alive (a consumer still using its tensors)
        streams.setdefault("held", []).append(conn.get(command["key"], command.get("handle"), timeout=10.0))
        return {}
    if op == "put_forever":   # never replies: the test kills us mid-transfer
        for i in range(10**9):
            conn.put(f"{command['key']}/{i}", make_payload(i, command.get("big_mb", 0.0)))
    if op == "health":
        return {"health": conn.health()}
    if op == "sleep":
        time.sleep(command["s"])
        return {}
    raise ValueError(f"unknown op {op!r}")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    from omnirelay.connectors import create_connector

    out = sys.stdout

    def say(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    conn = None
    if argv:
        try:
            conn = create_connector(argv[0], json.loads(argv[1]))
        except Exception as exc:  # noqa: BLE001
            say({"crash": _error(exc)})
            return 1
    say({"ready": os.getpid()})
    streams: dict = {}
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] in ("open", "close", "exit"):
                if conn is not None:
                    conn.close()
                    conn, streams = None, {}
                if command["op"] == "exit":
                    say({"closed": True})
                    return 0
                if command["op"] == "open":
                    conn = create_connector(command["backend"], command["options"])
                say({})
                continue
            say(handle(conn, command, streams))
        except Exception as exc:  # noqa: BLE001
            say({"crash": _error(exc) + "\n" + traceback.format_exc()})
    if conn is not None:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
