"""One side (producer or consumer) of a ``benchmarks/connectors.py`` measurement, in its own process
(not a benchmark script of its own).

    python benchmarks/connector_child.py ROLE KIND OPTIONS_JSON

``KIND`` is a connector name (``create_connector``), ``baseline:NAME`` (that connector as of
``--baseline REV``), or one of the raw transports ``tcp``, ``raw_redis``, ``raw_te``, ``raw_store``,
``raw_shm``, ``raw_yuanrong``. The parent (``connector_runs.Child``) drives it over stdin/stdout with JSON lines, one
answer per command (no pickle): ``put``/``get`` answer their own time in ``dt``, ``send``/``recv``
(raw TCP) their clock at the first byte sent / last byte received.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from connector_baseline import baseline_connector


def run(role: str, kind: str, options: dict) -> int:
    """Set up ``kind`` for ``role``, say ``{"ready": …}``, then answer one JSON line per command until ``exit``."""
    import torch
    torch.set_num_threads(1)
    out = sys.stdout

    def say(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    state: dict = {}
    if kind == "tcp":
        if role == "consumer":
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            say({"ready": server.getsockname()[1]})
            state["sock"], _ = server.accept()
            server.close()
        else:
            say({"ready": 0})
    elif kind == "raw_redis":
        import redis
        state["r"] = redis.Redis.from_url(options["url"])
        say({"ready": 0})
    elif kind == "raw_te":
        from mooncake.engine import TransferEngine
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        state["engine"], state["peer"] = engine, f"127.0.0.1:{engine.get_rpc_port()}"
        say({"ready": 0})
    elif kind == "raw_store":
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", options["segment_mb"] << 20, 16 << 20, "tcp", "",
                           options["master"]) == 0
        config = ReplicateConfig()
        config.preferred_segment = store.get_hostname()
        state["store"], state["config"] = store, config
        say({"ready": 0})
    elif kind == "raw_yuanrong":
        from yr.datasystem.kv_client import KVClient
        host, port = options["address"].rsplit(":", 1)
        state["kv"] = KVClient(host, int(port), connect_timeout_ms=2000, req_timeout_ms=60000)
        state["kv"].init()
        say({"ready": 0})
    elif kind == "raw_shm":
        import mmap
        state["maps"] = {}   # size → (path, mapping), one warm segment per size, mapped once
        say({"ready": 0})
    elif kind.startswith("baseline:"):   # the connector as it was at --baseline REV
        state["conn"] = baseline_connector(kind.split(":", 1)[1], options)
        say({"ready": 0})
    else:
        from omnirelay.connectors import create_connector
        state["conn"] = create_connector(kind, options)
        say({"ready": 0})

    buffers: dict[int, object] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        size = cmd.get("size", 0)
        if op == "connect":
            state["sock"] = socket.create_connection(("127.0.0.1", cmd["port"]))
            say({})
            continue
        if size not in buffers:   # warm source / destination buffers, allocated once
            t = torch.ones(size, dtype=torch.uint8)
            t.add_(0)
            buffers[size] = t
            if "engine" in state:
                assert state["engine"].register_memory(t.data_ptr(), size) == 0
            if "store" in state:
                assert state["store"].register_buffer(t.data_ptr(), size) == 0
        data = buffers[size]
        if kind == "tcp":
            sock = state["sock"]
            if op == "send":
                t0 = time.perf_counter()
                sock.sendall(memoryview(data.numpy()))
                say({"t0": t0})
            else:
                view, got = memoryview(data.numpy()), 0
                while got < size:
                    got += sock.recv_into(view[got:], size - got)
                say({"t1": time.perf_counter()})
        elif kind == "raw_redis":
            r = state["r"]
            if op == "put":
                value = state.setdefault(("bytes", size), bytes(data.numpy()))
                t0 = time.perf_counter()
                r.set(cmd["key"], value)
                say({"dt": time.perf_counter() - t0, "handle": None})
            else:
                t0 = time.perf_counter()
                value = r.get(cmd["key"])
                dt = time.perf_counter() - t0
                assert value is not None and len(value) == size
                del value
                r.delete(cmd["key"])
                say({"dt": dt})
        elif kind == "raw_yuanrong":   # the KV client's own set of the bytes, get (a bytes copy), delete
            from omnirelay.connectors.yuanrong import store_name
            kv, name = state["kv"], store_name("bench:", cmd["key"])
            if op == "put":
                t0 = time.perf_counter()
                kv.set(name, memoryview(data.numpy()))
                say({"dt": time.perf_counter() - t0, "handle": None})
            else:
                t0 = time.perf_counter()
                value = kv.get([name])[0]
                dt = time.perf_counter() - t0
                assert value is not None and len(value) == size
                del value
                kv.delete([name])
                say({"dt": dt})
        elif kind == "raw_shm":   # no protocol: one copy into a mapped segment, one view of it
            path = os.path.join(options["shm_dir"], f"raw-{size}")
            if size not in state["maps"]:
                fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
                os.ftruncate(fd, size)
                state["maps"][size] = mmap.mmap(fd, size)
                os.close(fd)
            mapping = state["maps"][size]
            if op == "put":
                t0 = time.perf_counter()
                memoryview(mapping)[:] = memoryview(data.numpy())
                say({"dt": time.perf_counter() - t0, "handle": None})
            else:
                t0 = time.perf_counter()
                view = torch.frombuffer(mapping, dtype=torch.uint8, count=size)
                dt = time.perf_counter() - t0
                del view
                say({"dt": dt})
        elif kind == "raw_te":   # the data sits in the producer's registered buffer; the consumer reads it
            if op == "put":
                say({"dt": 0.0, "handle": {"peer": state["peer"], "addr": data.data_ptr()}})
            else:
                t0 = time.perf_counter()
                rc = state["engine"].transfer_sync_read(cmd["handle"]["peer"], data.data_ptr(), cmd["handle"]["addr"],
                                                        size)
                dt = time.perf_counter() - t0
                assert rc == 0
                say({"dt": dt})
        elif kind == "raw_store":
            store = state["store"]
            if op == "put":
                t0 = time.perf_counter()
                rc = store.upsert_from(cmd["key"], data.data_ptr(), size, state["config"])
                say({"dt": time.perf_counter() - t0, "handle": None})
                assert rc == 0
            else:
                t0 = time.perf_counter()
                got = store.get_into(cmd["key"], data.data_ptr(), size)
                dt = time.perf_counter() - t0
                assert got == size
                store.remove(cmd["key"], True)
                say({"dt": dt})
        else:
            conn = state["conn"]
            if op == "put" and cmd.get("in_place"):
                # The producer builds its tensor in connector memory: reserve and publish are
                # timed; its own write of the bytes (which produces them) is not.
                t0 = time.perf_counter()
                reservation = conn.reserve({"t": ((size,), torch.uint8)})
                dt = time.perf_counter() - t0
                reservation.tensors["t"].copy_(data)
                t0 = time.perf_counter()
                handle = conn.put_reserved(cmd["key"], reservation)
                say({"dt": dt + time.perf_counter() - t0, "handle": handle})
            elif op == "put":
                t0 = time.perf_counter()
                handle = conn.put(cmd["key"], {"t": data})
                say({"dt": time.perf_counter() - t0, "handle": handle})
            else:
                t0 = time.perf_counter()
                payload = conn.get(cmd["key"], cmd["handle"], timeout=60)
                if cmd.get("touch"):
                    payload["t"].view(torch.int64).sum()   # read every byte
                dt = time.perf_counter() - t0
                assert payload["t"].numel() == size
                del payload
                conn.delete(cmd["key"])
                say({"dt": dt})
    if "conn" in state:
        state["conn"].close()
    if "store" in state:
        state["store"].close()
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
