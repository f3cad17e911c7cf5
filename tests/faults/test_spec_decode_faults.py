"""kill -9 of a decode worker that speculates (``--speculative-config`` ngram), under load.

Real processes: a broker, one prefill worker, two decode workers speculating, a gateway. 48 greedy
requests at concurrency 8 run fault-free, then again with one decode worker killed mid-way: every
stream it held resumes on the survivor (which speculates from the resumed tokens at the end of its
prompt) and each answer must equal the fault-free one token for token, which itself must equal a
cluster that does not speculate. The drafting really happened: the gateway's ``/metrics`` report
vLLM's speculative-decoding counters from the decode workers' heartbeats.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re

import pytest
import requests

from cluster import Cluster, assert_contract, classify, greedy_chat, run_load, settled_workers

N_REQUESTS, CONCURRENCY, MAX_TOKENS = 48, 8, 32
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'

pytestmark = pytest.mark.slow


def _load(url: str, fault=None) -> list:
    return asyncio.run(run_load(url, functools.partial(greedy_chat, max_tokens=MAX_TOKENS), N_REQUESTS,
                                concurrency=CONCURRENCY, timeout_s=60.0, fault=fault, after=12))


def _cluster(tiny_model: str, log_dir: str, *decode_flags: str) -> Cluster:
    os.makedirs(log_dir, exist_ok=True)
    cluster = Cluster(model=tiny_model, log_dir=log_dir)
    cluster.start_broker()
    cluster.start_worker("prefill", "--capacity", "8")
    for _ in range(2):
        cluster.start_worker("decode", "--capacity", "16", *decode_flags)
    cluster.start_gateway()
    cluster.wait_healthy()
    return cluster


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_kill9_of_a_speculating_decode_worker_resumes_exactly(tiny_model, tmp_path):
    with _cluster(tiny_model, str(tmp_path / "plain")) as plain:
        reference = [tokens for _, tokens in _load(plain.url)]
    with _cluster(tiny_model, str(tmp_path / "spec"), "--speculative-config", NGRAM) as cluster:
        baseline = [tokens for _, tokens in _load(cluster.url)]
        assert baseline == reference   # greedy: speculation changes no token
        settled_workers(cluster.url)
        metrics = requests.get(cluster.url + "/metrics", timeout=10).text
        drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
        accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < drafted and _metric(metrics, "vllm:spec_decode_num_drafts_total") > 0
        assert accepted == _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")

        pid = next(w["pid"] for w in cluster.workers() if w["role"] == "decode")
        victim = next(proc for proc in cluster.procs if proc.pid == pid)
        results = _load(cluster.url, fault=victim.kill9)
        counts = classify(results, baseline)
        print(f"\nkill -9 speculating decode: {counts}")
        assert_contract(counts, results)
        assert counts["completed"] == N_REQUESTS   # no error either: every stream resumed, exactly
        assert not victim.alive()
        assert "resuming at position" in cluster.logs()   # streams really moved to the survivor
