"""What the KV-connector fault tests set up alike: prefill → decode over a fault-injecting connector
around shared memory, behind two gateways (a short and a long request deadline), and the
shared-memory segments a worker still holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Iterator

from cluster import Cluster


def kv_fault_pipeline(path: pathlib.Path, fault_options: dict, prefill_engine_args: dict | None = None) -> str:
    """Write to ``path`` a prefill → decode pipeline whose KV connector is ``fault_injection`` with
    ``fault_options`` around shared memory; its path."""
    prefill = {"name": "prefill", "role": "prefill"}
    if prefill_engine_args is not None:
        prefill["engine_args"] = prefill_engine_args
    path.write_text(json.dumps({   # YAML is a superset of JSON
        "stages": [prefill, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "fault_injection", "options": {"inner": "shared_memory", **fault_options}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    return str(path)


@contextlib.contextmanager
def kv_fault_cluster(model: str, log_dir: str, pipeline: str, short_timeout_s: float, long_timeout_s: float,
                     prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """A broker, one prefill (``cluster.prefill``) and one decode worker on ``pipeline``, and two
    gateways: ``cluster.short_url`` with ``short_timeout_s`` as the request deadline, ``cluster.url``
    with ``long_timeout_s``; every process it started is stopped on exit."""
    cluster = Cluster(model=model, log_dir=log_dir)
    cluster.prefill = None
    try:
        cluster.start_broker()
        cluster.prefill = cluster.start_worker("prefill", "--stage-configs-path", pipeline, *prefill_args)
        cluster.start_worker("decode", "--stage-configs-path", pipeline, *decode_args)
        cluster.start_gateway("--request-timeout", str(short_timeout_s))
        cluster.short_url = cluster.url
        cluster.start_gateway("--request-timeout", str(long_timeout_s))
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


def segments_of(pid: int) -> list[str]:
    """The per-key shared-memory segments process ``pid`` holds in /dev/shm."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"omnirelay-{pid}-")
            and "-c" not in name[len(f"omnirelay-{pid}"):]]   # buffer-pool files are reused, not per key
