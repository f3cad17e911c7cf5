"""Broker high availability: kill -9 of the active broker under load, with a standby
(``omni-broker --standby-of``) that takes over; workers and the gateway know both endpoints.

The same bounded load and contract as tests/faults/test_faults.py (64 greedy requests at concurrency 8,
each completed with the fault-free output or failed with a structured error; 0 hung, 0 lost, 0
wrong). Unlike the restart test there, nothing restarts the dead broker: the standby binds its
own endpoint once the active one has been silent for its liveness period."""

from __future__ import annotations

import asyncio
import functools

import pytest

from cluster import Cluster, assert_contract, classify, free_tcp_endpoint, greedy_chat, run_load

pytestmark = pytest.mark.slow

N_REQUESTS, CONCURRENCY, MAX_TOKENS = 64, 8, 24


def _load(url: str, fault=None) -> list:
    return asyncio.run(run_load(url, functools.partial(greedy_chat, max_tokens=MAX_TOKENS), N_REQUESTS,
                                concurrency=CONCURRENCY, timeout_s=90.0, fault=fault, after=16))


def test_kill9_active_broker_standby_takes_over_under_load(tiny_model, tmp_path):
    active, standby = free_tcp_endpoint(), free_tcp_endpoint()
    with Cluster(model=tiny_model, log_dir=str(tmp_path), broker=f"{active},{standby}") as cluster:
        active_proc = cluster._start("broker-active", ["omnirelay.broker.daemon", "--endpoint", active,
                                                        "--log-level", "INFO"])
        standby_proc = cluster._start("broker-standby", ["omnirelay.broker.daemon", "--endpoint", standby,
                                                          "--standby-of", active, "--log-level", "INFO"])
        for role in ("prefill", "prefill", "decode", "decode"):
            cluster.start_worker(role, "--capacity", "16" if role == "decode" else "4")
        cluster.start_gateway()
        cluster.wait_healthy()
        cluster.wait_for_workers(4)
        assert "taking over" not in standby_proc.output()   # the standby waits while the active answers
        baseline = [tokens for _, tokens in _load(cluster.url)]
        results = _load(cluster.url, fault=active_proc.kill9)
        counts = classify(results, baseline)
        print(f"\nkill -9 active broker with a standby: {counts}")
        assert_contract(counts, results)
        assert not active_proc.alive() and standby_proc.alive()
        assert "taking over" in standby_proc.output()
        assert "omni-broker ready on " + standby in standby_proc.output()
        cluster.wait_for_workers(4)
        assert len(cluster.workers()) == 4   # every worker registered again, with the standby
        # After the take-over the cluster serves as before.
        after = _load(cluster.url)
        assert [r[0] for r in after] == ["completed"] * N_REQUESTS
