"""LoRA adapter affinity (issue #29): the broker sends a request to a worker that holds its adapter.

* Core level (``BrokerCore`` driven with fake identities, as in ``test_prefix_routing.py``): a holder
  of the adapter wins over the least-loaded worker; beyond ``lora_load_slack`` more assigned tasks
  the cold worker gets it (and becomes a holder); a heartbeat made before a dispatch does not make
  the broker forget the adapter it just sent; base requests and adapter-less pools route by load.
* A real cluster (broker, two prefill and two decode workers with ``--enable-lora``, gateway; the
  official ``openai`` client): requests for adapter x, one after another, all run on the prefill
  and decode workers that ran the first x, and requests for y then all on the other pair. Without
  affinity the least-loaded order lets idle workers take turns, so the second x would change worker.
"""

from __future__ import annotations

import openai
import pytest

from omnirelay.broker import protocol as p
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.broker.lora_affinity import request_adapter
from omnirelay.request_params import TextParams

MODEL = "tiny"
GW = b"gw"
FAR = 1e9


def make_core(**overrides) -> BrokerCore:
    config = dict(endpoint="ipc:///unused", heartbeat_interval_s=1.0, liveness_s=3.0, max_queue_per_role=64,
                  lora_load_slack=2)
    return BrokerCore(BrokerConfig(**{**config, **overrides}))


def register(core, name: str, credits: int = 8, loras: tuple[str, ...] | None = ()) -> None:
    """A prefill worker holding ``loras`` (None: a worker without LoRA, which reports nothing)."""
    held = None if loras is None else list(loras)
    core.on_message(name.encode(), p.Register(name, "prefill", MODEL, 8, loras=held), 0.0)
    core.on_message(name.encode(), p.Credit(name, credits), 0.0)


def submit(core, request_id: str, lora: str = "") -> str | None:
    """Submit a prefill-only request under adapter ``lora`` ("": the base); the worker it went to."""
    spec = p.Submit(request_id, MODEL, ["prefill"], [1, 2, 3], TextParams(lora=lora), FAR, "tcp://gw:1")
    sent = [ident.decode() for ident, msg in core.on_message(GW, spec, 1.0) if isinstance(msg, p.Task)]
    assert len(sent) <= 1
    return sent[0] if sent else None


def finish(core, worker: str, request_id: str) -> None:
    core.on_message(worker.encode(), p.StageDone(worker, request_id, "prefill", finished=True), 1.0)


def heartbeat(core, worker: str, loras: list[str] | None, received: int) -> None:
    core.on_message(worker.encode(), p.Heartbeat(worker, loras=loras, received=received), 1.0)


def test_the_adapter_is_read_from_the_request_params():
    def spec(params):
        return p.Submit("r", MODEL, ["prefill"], [1], params, FAR, "tcp://gw:1")

    assert request_adapter(spec(TextParams(lora="x", lora_path="/a/x"))) == "x"
    assert request_adapter(spec(TextParams())) == "" and request_adapter(spec(TextParams(lora="x" * 300))) == ""


def test_a_holder_wins_until_it_is_slack_tasks_busier_than_the_least_loaded():
    core = make_core()
    register(core, "cold")
    register(core, "hot", loras=("x",))
    # "hot" is the busier one from the second request on, yet keeps every x while within the slack (2).
    assert [submit(core, f"x{i}", "x") for i in range(3)] == ["hot"] * 3
    # Now 3 tasks against 0: beyond the slack, the cold worker takes x (and holds it from now on) …
    assert submit(core, "x3", "x") == "cold"
    assert "x" in core.workers["cold"].loras and core.counters["lora_routed"] == 3
    # … and the next x goes to whichever holder is less loaded.
    assert submit(core, "x4", "x") == "cold"
    # Base requests ignore the holders: least-loaded order.
    assert submit(core, "b0") == "cold"
    for i in range(4):
        finish(core, "hot" if i < 3 else "cold", f"x{i}")
    assert submit(core, "x5", "x") == "hot"


@pytest.mark.parametrize("lora_workers", [True, False])
def test_the_worker_sent_an_adapter_holds_it_in_a_lora_pool(lora_workers):
    core = make_core()
    register(core, "a", loras=() if lora_workers else None)
    register(core, "b", loras=() if lora_workers else None)
    # Idle workers take turns (fewest dispatched first) …
    assert [submit(core, f"r{i}") for i in range(2)] == ["a", "b"]
    first = submit(core, "x0", "x")
    for worker, request_id in ((first, "x0"), ("a", "r0"), ("b", "r1")):
        finish(core, worker, request_id)
    other = "b" if first == "a" else "a"
    # … but once a LoRA worker was sent x it holds it: the next x follows although the other is due.
    # Workers without LoRA hold nothing: turns as before.
    assert submit(core, "x1", "x") == (first if lora_workers else other)
    assert core.workers[first].loras == ({"x"} if lora_workers else None)


def test_a_heartbeat_made_before_a_dispatch_keeps_the_adapter_sent():
    core = make_core()
    register(core, "a")
    register(core, "b")
    assert submit(core, "x0", "x") == "a"   # a's first Task (sent = 1)
    heartbeat(core, "a", [], received=0)     # made before a read that Task: x is kept
    assert core.workers["a"].loras == {"x"}
    finish(core, "a", "x0")
    assert submit(core, "x1", "x") == "a"
    finish(core, "a", "x1")
    heartbeat(core, "a", ["x"], received=2)  # counts both Tasks: the report is the whole truth
    assert core.workers["a"].loras == {"x"} and core.workers["a"].lora_pending == {}
    heartbeat(core, "a", ["y"], received=2)  # x evicted on the worker: forgotten here too
    assert core.workers["a"].loras == {"y"}
    assert submit(core, "x2", "x") == "b"    # least-loaded again (fewer dispatched)
    assert submit(core, "y0", "y") == "a"
    heartbeat(core, "a", None, received=2)   # a keepalive reports nothing: no change
    assert core.workers["a"].loras == {"y"}


def test_a_worker_that_leaves_is_no_holder():
    core = make_core()
    register(core, "a", loras=("x",))
    register(core, "b")
    core.on_message(b"a", p.Unregister("a"), 1.0)
    assert submit(core, "x0", "x") == "b" and core.workers["b"].loras == {"x"}
    register(core, "a")   # back, holding nothing
    assert core.workers["a"].loras == set()
    assert submit(core, "x1", "x") == "b"


# ------------------------------------------------------------------------------ real cluster


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("peft")
    from omnirelay.deploy.builders.lora import build_tiny_lora
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(build_tiny_lora(tiny_model, root / name, rank=4, targets=("q_proj", "v_proj"), seed=seed))
            for seed, name in enumerate(("x", "y"), 1)}


def test_requests_follow_the_workers_that_hold_their_adapter(tiny_model, adapters, tmp_path):
    from cluster import Cluster, settled_workers

    lora = ["--enable-lora", "--max-loras", "1", *(a for n, d in adapters.items() for a in ("--lora-modules", f"{n}={d}"))]
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker()
        for role in ("prefill", "prefill", "decode", "decode"):
            cluster.start_worker(role, *lora)
        cluster.start_gateway(*lora)
        cluster.wait_healthy()
        cluster.wait_for_workers(4)
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def run(model: str, i: int) -> dict[str, str]:
            """One request (a prompt under one block: no prefix hint steers it); the worker of each role
            whose dispatched count grew, read from the settled cluster."""
            before = {w["worker_id"]: w["dispatched"] for w in settled_workers(cluster.url)}
            answer = client.completions.create(model=model, prompt=f"{i} {model} hello", max_tokens=4,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert answer.model == model and answer.usage.completion_tokens == 4
            grew = [w for w in settled_workers(cluster.url) if w["dispatched"] > before.get(w["worker_id"], 0)]
            assert sorted(w["role"] for w in grew) == ["decode", "prefill"], grew
            return {w["role"]: w["worker_id"] for w in grew}

        assert len(cluster.workers()) == 4
        on_x = [run("x", i) for i in range(3)]
        assert all(where == on_x[0] for where in on_x), on_x
        on_y = [run("y", i) for i in range(3)]
        assert all(where == on_y[0] for where in on_y), on_y
        # y went to the other pair: each worker of a role was dispatched one adapter, and holds it.
        assert all(on_x[0][role] != on_y[0][role] for role in ("prefill", "decode")), (on_x, on_y)
        view = {w["worker_id"]: w for w in settled_workers(cluster.url)}
        for where, name in ((on_x[0], "x"), (on_y[0], "y")):
            for worker_id in where.values():
                assert view[worker_id]["loras"] == [name], view[worker_id]
        # The second and third x went against the least-loaded order (the other worker was due).
        assert all(view[worker_id]["lora_routed"] == 2 for worker_id in on_x[0].values()), view
        assert cluster.broker_counters().get("prefix_routed", 0) == 0
