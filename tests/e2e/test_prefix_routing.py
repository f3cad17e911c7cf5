"""Prefix-aware prefill routing: the broker sends a prompt to the worker that caches its longest prefix.

* Core level (``BrokerCore`` driven with fake identities, as in ``test_broker.py``): the choice among
  prefill workers with credit — longest cached prefix first, least-loaded on ties and without hints,
  a load bound so one popular prefix cannot pile onto one worker — and the per-worker key sets that
  heartbeats maintain (deltas, full resync, the memory bound, block-size mismatch).
* The hint's hashing equals the prefill engine's own block naming (the real allocator's names).
* A real cluster (broker, two prefill workers, decode, gateway; the official ``openai`` client):
  requests sharing a long system prompt land on the worker that already holds it — its engine
  counts the cached prefix tokens — and a different system prompt goes to the other worker.
"""

from __future__ import annotations


import pytest

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.broker.prefix_index import PrefixSet, prompt_route_keys, route_keys
from omnirelay.block_hash import block_hashes
from omnirelay.workers.kv.prefix_cache import PrefixCachingAllocator

MODEL = "tiny"
GW = b"gw"
FAR = 1e9
BS = 16
SYSTEM_A = [100 + i % 50 for i in range(8 * BS)]    # 8 blocks of shared "system prompt"
SYSTEM_B = [300 + i % 70 for i in range(8 * BS)]


def make_core(**overrides) -> BrokerCore:
    config = dict(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=3.0, max_queue_per_role=64,
                  prefix_keys_per_worker=1000, prefix_load_slack=2)
    return BrokerCore(BrokerConfig(**{**config, **overrides}))


def register(core, name: str, credits: int = 8, block_size: int = BS, role: str = "prefill") -> None:
    ident = name.encode()
    core.on_message(ident, p.Register(name, role, MODEL, 8, block_size=block_size), 0.0)
    core.on_message(ident, p.Credit(name, credits), 0.0)


def submit(core, request_id: str, prompt: list[int], block_size: int = BS) -> str | None:
    """Submit a prefill-only request with its prefix hint; the worker it was sent to (or None)."""
    spec = p.Submit(request_id, MODEL, ["prefill"], prompt, TextParams(), FAR, "tcp://gw:1",
                    prefix_hashes=prompt_route_keys(prompt, block_size), prefix_block_size=block_size)
    sent = [ident.decode() for ident, msg in core.on_message(GW, spec, 1.0) if isinstance(msg, p.Task)]
    assert len(sent) <= 1
    return sent[0] if sent else None


def finish(core, worker: str, request_id: str) -> None:
    core.on_message(worker.encode(), p.StageDone(worker, request_id, "prefill", finished=True), 1.0)


def heartbeat(core, worker: str, **prefix) -> None:
    core.on_message(worker.encode(), p.Heartbeat(worker, **prefix), 1.0)


def keys_of(prompt: list[int]) -> list[int]:
    return route_keys(block_hashes(prompt, BS))


# ------------------------------------------------------------------------------------ hashing


def test_hint_keys_are_the_engine_block_names_that_a_prompt_can_reuse():
    prompt = SYSTEM_A + [7, 8, 9]
    allocator = PrefixCachingAllocator(64)
    names = block_hashes(prompt, BS)
    for block, name in zip(allocator.allocate(len(names)), names):
        allocator.register(block, name)
    added, evicted = allocator.drain_events()
    assert evicted == [] and route_keys(added) == prompt_route_keys(prompt, BS)
    # The block holding the last prompt token is never reused (its logits are always computed).
    assert len(prompt_route_keys(SYSTEM_A, BS)) == 7 and len(prompt_route_keys(SYSTEM_A + [1], BS)) == 8
    assert prompt_route_keys(SYSTEM_A, BS, max_blocks=3) == prompt_route_keys(SYSTEM_A, BS)[:3]
    assert prompt_route_keys([1, 2], BS) == [] and prompt_route_keys(SYSTEM_A, 0) == []
    assert all(0 <= key < 2**64 for key in prompt_route_keys(SYSTEM_A, BS))


# ------------------------------------------------------------------------------------ routing choice


def test_request_goes_to_the_worker_that_reported_its_prefix():
    core = make_core()
    register(core, "w1")
    register(core, "w2")
    heartbeat(core, "w2", prefix_added=keys_of(SYSTEM_A), prefix_full=True)
    assert submit(core, "r1", SYSTEM_A + [1, 2, 3]) == "w2"
    assert core.counters["prefix_routed"] == 1 and core.counters["prefix_hit_blocks"] == 8
    # Without a hint the same worker pair is least-loaded: w2 now has a task, so w1.
    assert submit(core, "r2", [5] * 40, block_size=0) == "w1"


def test_a_new_prefix_is_remembered_at_dispatch_and_another_prefix_spreads():
    core = make_core()
    register(core, "w1")
    register(core, "w2")
    first = submit(core, "a1", SYSTEM_A + [1])
    finish(core, first, "a1")
    # No heartbeat yet: the broker already knows where SYSTEM_A's blocks will be.
    for i in range(2, 6):
        assert submit(core, f"a{i}", SYSTEM_A + [i]) == first
        finish(core, first, f"a{i}")
    other = submit(core, "b1", SYSTEM_B + [1])
    assert other != first   # idle workers take turns: the new prefix goes to the one A did not claim
    finish(core, other, "b1")
    assert submit(core, "b2", SYSTEM_B + [2]) == other
    reply = core.status(1.0)
    by_id = {w["worker_id"]: w for w in reply.workers}
    assert (by_id[first]["dispatched"], by_id[other]["dispatched"]) == (5, 2)
    assert (by_id[first]["prefix_routed"], by_id[other]["prefix_routed"]) == (4, 1)


def test_the_longest_cached_prefix_wins():
    core = make_core()
    for name in ("w1", "w2", "w3"):
        register(core, name)
    prompt = SYSTEM_A + SYSTEM_B
    heartbeat(core, "w1", prefix_added=keys_of(prompt)[:3])
    heartbeat(core, "w2", prefix_added=keys_of(prompt)[:11])
    heartbeat(core, "w3", prefix_added=keys_of(prompt)[5:])   # no first block: no usable prefix
    assert submit(core, "r1", prompt + [1]) == "w2"
    assert core.counters["prefix_hit_blocks"] == 11


def test_a_busy_prefix_holder_is_passed_over_beyond_the_load_slack():
    core = make_core(prefix_load_slack=2)
    register(core, "w1")
    register(core, "w2")
    heartbeat(core, "w1", prefix_added=keys_of(SYSTEM_A), prefix_full=True)
    # w1 takes requests with the prefix while it is at most 2 tasks busier than w2 …
    placed = [submit(core, f"r{i}", SYSTEM_A + [i]) for i in range(3)]
    assert placed == ["w1", "w1", "w1"]
    # … then the next one goes to the idle worker, which is now remembered to hold the prefix too.
    assert submit(core, "r3", SYSTEM_A + [3]) == "w2"
    assert submit(core, "r4", SYSTEM_A + [4]) == "w2"


def test_credit_still_bounds_prefix_routing():
    core = make_core(prefix_load_slack=100)
    register(core, "w1", credits=1)
    register(core, "w2", credits=4)
    heartbeat(core, "w1", prefix_added=keys_of(SYSTEM_A))
    assert submit(core, "r1", SYSTEM_A + [1]) == "w1"
    assert submit(core, "r2", SYSTEM_A + [2]) == "w2"    # w1 has no credit left
    assert core.workers["w1"].credits == 0


def test_hint_at_another_block_size_is_ignored():
    core = make_core()
    register(core, "w1", block_size=32)
    register(core, "w2", block_size=32)
    heartbeat(core, "w2", prefix_added=keys_of(SYSTEM_A))   # (keys at 16: never matched at 32)
    assert submit(core, "r1", SYSTEM_A + [1], block_size=BS) == "w1"   # least-loaded, no hit
    assert core.counters["prefix_routed"] == 0
    assert len(core.workers["w1"].prefix) == 0   # nor remembered: its cache names blocks of 32


# ------------------------------------------------------------------------------------ key sets


def test_heartbeat_deltas_and_full_resync_maintain_the_broker_copy():
    core = make_core()
    register(core, "w1")
    register(core, "w2")
    keys = keys_of(SYSTEM_A)
    heartbeat(core, "w1", prefix_added=keys)
    heartbeat(core, "w1", prefix_evicted=keys[4:])
    assert len(core.workers["w1"].prefix) == 4
    assert submit(core, "r1", SYSTEM_A + [1]) == "w1" and core.counters["prefix_hit_blocks"] == 4
    finish(core, "w1", "r1")
    # A full report replaces the copy, dispatch-time guesses included.
    heartbeat(core, "w1", prefix_added=[1, 2, 3], prefix_full=True)
    assert [k in core.workers["w1"].prefix for k in (1, 2, 3, keys[0])] == [True, True, True, False]
    assert core.status(1.0).workers[0]["prefix_keys"] == 3


def test_key_sets_are_bounded_per_worker():
    core = make_core(prefix_keys_per_worker=50)
    register(core, "w1")
    heartbeat(core, "w1", prefix_added=list(range(10_000)))
    heartbeat(core, "w1", prefix_added=list(range(20_000, 20_100)), prefix_evicted=list(range(10_000)))
    heartbeat(core, "w1", prefix_added=list(range(30_000, 40_000)), prefix_full=True)
    prefix = core.workers["w1"].prefix
    assert len(prefix) == 50 and 39_999 in prefix and 30_000 not in prefix
    register(core, "w2")   # a long hint is cut to MAX_PROMPT_BLOCKS, and the set stays bounded
    spec = p.Submit("r1", MODEL, ["prefill"], [1], TextParams(), FAR, "tcp://gw:1",
                    prefix_hashes=list(range(100_000)), prefix_block_size=BS)
    core.on_message(GW, spec, 1.0)
    assert all(len(w.prefix) <= 50 for w in core.workers.values())


def test_prefix_set_keeps_the_most_recently_touched_keys():
    keys = PrefixSet(3)
    keys.add([1, 2, 3])
    keys.add([1])          # touched again: now the newest
    keys.add([4])          # evicts 2, the oldest
    assert [k in keys for k in (1, 2, 3, 4)] == [True, False, True, True]
    assert keys.hit_blocks([1, 3, 9, 4]) == 2 and keys.hit_blocks([2, 1]) == 0


def test_workers_without_a_prefix_cache_route_least_loaded():
    core = make_core()
    register(core, "d1", role="decode", block_size=0)
    register(core, "d2", role="decode", block_size=0)
    spec = p.Submit("r1", MODEL, ["decode"], SYSTEM_A, TextParams(), FAR, "tcp://gw:1",
                    prefix_hashes=prompt_route_keys(SYSTEM_A, BS), prefix_block_size=BS)
    out = core.on_message(GW, spec, 1.0)
    assert [ident for ident, msg in out if isinstance(msg, p.Task)] == [b"d1"]
    assert core.workers["d1"].prefix is None and core.counters["prefix_routed"] == 0


# ------------------------------------------------------------------------------------ real cluster


@pytest.fixture
def two_prefill_cluster(tiny_model, tmp_path):
    from cluster import prefill_pair_cluster
    with prefill_pair_cluster(tiny_model, str(tmp_path)) as cluster:
        yield cluster


def test_shared_system_prompt_goes_to_the_worker_that_holds_it(two_prefill_cluster):
    import openai
    from cluster import settled_workers
    cluster = two_prefill_cluster
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    system_a = "You are a careful assistant. " + " ".join(f"rule{i} applies" for i in range(60))
    system_b = "You answer in verse only. " + " ".join(f"meter{i} rhymes" for i in range(60))
    for system, questions in ((system_a, ("one", "two", "three", "four")), (system_b, ("five", "six", "seven"))):
        for question in questions:   # one at a time: placement comes from the prefix, not from load
            reply = client.chat.completions.create(
                model=cluster.model_name, max_tokens=2, temperature=0.0,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            assert reply.choices[0].finish_reason in ("stop", "length")
    # All four A requests on one worker, all three B requests on the other; every request after a
    # prefix's first was routed for its prefix, and each engine reused the cached blocks (its
    # counters travel in heartbeats: read once the cluster says they are final).
    prefill = sorted((w for w in settled_workers(cluster.url) if w["role"] == "prefill"),
                     key=lambda w: w["dispatched"], reverse=True)
    hits = [w["stats"].get("prefix_hit_requests", 0) for w in prefill]
    assert {w["worker_id"] for w in prefill} == {"prefill-a", "prefill-b"}
    assert [w["dispatched"] for w in prefill] == [4, 3], prefill
    assert [w["prefix_routed"] for w in prefill] == [3, 2], prefill
    assert hits == [3, 2], prefill
    assert all(w["stats"]["prefix_cached_tokens"] >= n * 4 * BS for w, n in zip(prefill, (3, 2))), prefill
