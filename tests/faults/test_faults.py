"""Faults under a bounded load: kill -9 of a prefill worker, of a decode worker, and of the broker.

Each scenario runs 64 greedy requests at concurrency 8 against a cluster of real processes (two
workers per role), injects the fault mid-way, and classifies every request: completed with the
same tokens as the fault-free run, failed with a structured error, wrong output, or hung (no answer
within its time limit). It prints the counts; the contract is 0 hung, 0 wrong, nothing lost.
"""

from __future__ import annotations

import asyncio
import functools
import time

import openai
import pytest

from cluster import Cluster, assert_contract, classify, greedy_chat, run_load, settled_workers

N_REQUESTS, CONCURRENCY, MAX_TOKENS = 64, 8, 24
REQUEST_TIMEOUT_S = 60.0

pytestmark = pytest.mark.slow


def _load(url: str, fault=None, after: int = 16, n: int = N_REQUESTS) -> list:
    """Run ``n`` requests; call ``fault()`` (in a thread) once ``after`` of them have completed."""
    return asyncio.run(run_load(url, functools.partial(greedy_chat, max_tokens=MAX_TOKENS), n,
                                concurrency=CONCURRENCY, timeout_s=REQUEST_TIMEOUT_S, fault=fault, after=after))


@pytest.fixture
def cluster(tiny_model, tmp_path):
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker()
        for role in ("prefill", "prefill", "decode", "decode"):
            cluster.start_worker(role, "--capacity", "16" if role == "decode" else "4")
        cluster.start_gateway()
        cluster.wait_healthy()
        yield cluster


def _assert_contract(name: str, results: list, baseline: list) -> dict[str, int]:
    counts = classify(results, baseline)
    print(f"\n{name}: {counts}")
    assert_contract(counts, results)
    return counts


def _victim(cluster: Cluster, role: str):
    pid = next(w["pid"] for w in cluster.workers() if w["role"] == role)
    return next(proc for proc in cluster.procs if proc.pid == pid)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kill9_worker_under_load(cluster, role):
    baseline = [tokens for _, tokens in _load(cluster.url)]
    victim = _victim(cluster, role)
    _assert_contract(f"kill -9 {role}", _load(cluster.url, fault=victim.kill9), baseline)
    assert not victim.alive()
    # The survivors of the role keep serving.
    assert [w["role"] for w in cluster.workers()].count(role) == 1
    logs = cluster.logs()
    assert "missed heartbeats; dropping it" in logs   # the broker noticed the death itself
    if role == "decode":
        assert "resuming at position" in logs          # streams really moved to the survivor


def test_kill9_broker_and_restart_under_load(cluster):
    baseline = [tokens for _, tokens in _load(cluster.url)]
    broker = next(proc for proc in cluster.procs if proc.name.endswith("broker"))
    gap: dict[str, float] = {}

    def restart_broker() -> None:
        broker.kill9()
        killed_at = time.monotonic()
        cluster.start_broker()
        probe = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=10)
        while time.monotonic() - killed_at < 30:
            try:
                probe.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "probe"}],
                                              max_tokens=2, temperature=0)
                gap["seconds"] = time.monotonic() - killed_at
                return
            except openai.APIError:
                time.sleep(0.1)

    results = _load(cluster.url, fault=restart_broker)
    print(f"\nbroker restart: service back after {gap.get('seconds', float('nan')):.2f}s")
    _assert_contract("kill -9 broker + restart", results, baseline)
    assert gap.get("seconds", 99) < 5.0
    assert "broker restarted; resuming" in cluster.logs()


def test_sigterm_drains_a_worker_and_a_new_one_takes_work(cluster):
    """SIGTERM → the worker stops taking work, finishes what it holds, unregisters, exits 0; a
    worker that joins under load gets work; no request fails."""
    n = 8 * N_REQUESTS   # long enough that the newcomer starts up while the load still runs
    baseline = [tokens for _, tokens in _load(cluster.url, n=n)]
    leaving = _victim(cluster, "decode")
    joined: dict = {}

    def drain_one_and_add_one() -> None:
        joined["proc"] = cluster.start_worker("decode", "--capacity", "16")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(w["pid"] == joined["proc"].pid for w in cluster.workers()):
                break
            time.sleep(0.2)
        joined["registered_at"] = time.monotonic()
        leaving.proc.send_signal(15)

    results = _load(cluster.url, fault=drain_one_and_add_one, after=4, n=n)
    assert joined["registered_at"], "the new worker never registered"
    counts = _assert_contract("drain one decode, add one", results, baseline)
    assert sum(counts.values()) == n
    assert counts["error"] == 0
    assert leaving.proc.wait(30) == 0
    assert "unregistered" in cluster.logs()
    # The newcomer registered and decoded part of the load.
    # Its counters travel in heartbeats: read once the cluster says they are final.
    newcomer = next(w for w in settled_workers(cluster.url) if w["pid"] == joined["proc"].pid)
    assert newcomer["stats"].get("decode_tokens", 0) > 0
