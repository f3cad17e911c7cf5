"""The autoscaler against a real cluster: load rises and it adds a decode worker, load falls and it
drains one, and no request fails on the way. Real broker, gateway and worker processes; the
autoscaler reads the gateway's /cluster and /metrics and starts/drains workers as local processes.
The same through ``omni-serve --autoscale`` (the autoscaler on omni-serve's own thread).

Also, without processes: the policy's hysteresis, cool-downs and bounds, the latency window over
Prometheus histograms, and the exact command lines of the systemd actuator."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import threading
import time

import openai
import pytest
import requests

from cluster import Cluster, greedy_chat
from conftest import ServeProcess, child_pids, pid_alive
from omnirelay.fleet.actuators import LocalProcessActuator, SystemdActuator
from omnirelay.fleet.autoscaler import Autoscaler, RolePolicy
from omnirelay.fleet.signals import GatewayProbe, LatencyWindow, RoleLoad, quantile, role_loads


# ------------------------------------------------------------------------------ policy, no processes


class CountingActuator:
    """Counts only: the policy tests need no process. (The real actuators are tested below.)"""

    def __init__(self) -> None:
        self.n: dict[str, int] = {}

    def start(self, role: str) -> str:
        self.n[role] = self.n.get(role, 0) + 1
        return f"{role}-{self.n[role]}"

    def drain(self, role: str) -> str | None:
        if not self.n.get(role):
            return None
        self.n[role] -= 1
        return f"{role}-{self.n[role] + 1}"

    def active(self, role: str) -> int:
        return self.n.get(role, 0)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass


def _decide(scaler: Autoscaler, load: RoleLoad, now: float, latency=None) -> str:
    decision = scaler.decide("decode", load, latency, scaler.actuator.active("decode"), now)
    if decision.action == "up":
        scaler.actuator.start("decode")
        scaler._state["decode"].last_up = scaler._state["decode"].last_change = now
        scaler._state["decode"].hot = 0
    elif decision.action == "down":
        scaler.actuator.drain("decode")
        scaler._state["decode"].last_change = now
        scaler._state["decode"].cold = 0
    return decision.action


def test_policy_hysteresis_cooldowns_and_bounds():
    policy = RolePolicy(min_workers=1, max_workers=3, up_samples=2, down_samples=3, up_cooldown_s=10,
                        down_cooldown_s=30, latency_slo_s=0.05)
    actuator = CountingActuator()
    scaler = Autoscaler("m", {"decode": policy}, actuator)
    scaler.ensure_minimum()
    assert actuator.active("decode") == 1
    hot = lambda n: RoleLoad("decode", n, 4 * n, 4 * n, 3 * n)     # noqa: E731  full and queueing
    middle = lambda n: RoleLoad("decode", n, 4 * n, 2 * n, 0)      # noqa: E731  50 %: inside the gap
    cold = lambda n: RoleLoad("decode", n, 4 * n, 0, 0)            # noqa: E731
    assert _decide(scaler, hot(1), 0) == "hold"                     # one hot sample is not enough
    assert _decide(scaler, hot(1), 1) == "up"
    assert _decide(scaler, hot(1), 2) == "hold"                     # started worker not registered yet
    assert _decide(scaler, hot(2), 3) == "hold"                     # cool-down after the add
    assert _decide(scaler, hot(2), 12) == "up"
    assert _decide(scaler, hot(3), 30) == "hold" and _decide(scaler, hot(3), 31) == "hold"   # max_workers
    for t in range(40, 60):
        assert _decide(scaler, middle(3), t) == "hold"              # between thresholds: nothing moves
    assert [_decide(scaler, cold(3), t) for t in (60, 61, 62)] == ["hold", "hold", "down"]
    assert _decide(scaler, cold(2), 70) == "hold" and actuator.active("decode") == 2   # down cool-down
    # The cold streak counts on through the cool-down: the third cold sample drains once it is over.
    assert [_decide(scaler, cold(2), t) for t in (93, 94)] == ["hold", "down"]
    assert [_decide(scaler, cold(1), t) for t in range(200, 210)] == ["hold"] * 10      # min_workers
    # Latency over the SLO makes a role hot even with room; under half the SLO it may cool.
    assert [_decide(scaler, middle(1), t, latency=0.08) for t in (300, 301)] == ["hold", "up"]


def test_latency_window_and_role_loads():
    text = lambda c1, c2, c3: (  # noqa: E731
        '# TYPE vllm:inter_token_latency_seconds histogram\n'
        f'vllm:inter_token_latency_seconds_bucket{{le="0.01",model_name="m"}} {c1}\n'
        f'vllm:inter_token_latency_seconds_bucket{{le="0.1",model_name="m"}} {c2}\n'
        f'vllm:inter_token_latency_seconds_bucket{{le="+Inf",model_name="m"}} {c3}\n'
        f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {c3}\n'
        f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} 1.0\n')
    window = LatencyWindow("vllm:inter_token_latency_seconds", "m")
    assert window.update(text(100, 100, 100), 0.9) == pytest.approx(0.009)   # all under 10 ms
    # The next 100 observations all fell in (10 ms, 100 ms]: the window sees only them.
    assert window.update(text(100, 200, 200), 0.9) == pytest.approx(0.01 + 0.09 * 0.9)
    assert window.update(text(100, 200, 200), 0.9) is None                   # nothing new
    assert quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.9) is None
    cluster = {"workers": [{"model": "m", "role": "decode", "capacity": 4, "assigned": 3},
                           {"model": "m", "role": "decode", "capacity": 4, "assigned": 1},
                           {"model": "x", "role": "decode", "capacity": 4, "assigned": 4}],
               "queued": {"m/decode": 2, "m/prefill": 0, "x/decode": 9}}
    loads = role_loads(cluster, "m")
    assert loads["decode"] == RoleLoad("decode", 2, 8, 4, 2) and loads["decode"].utilisation == 0.5
    assert loads["prefill"] == RoleLoad("prefill", 0, 0, 0, 0)


def test_systemd_actuator_builds_the_real_command_lines(tmp_path):
    """The command lines are checked as strings, and run through a stand-in ``systemctl`` script that
    records its argv (no systemd in the test environment: the real systemctl is not exercised)."""
    record = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {record}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    actuator = SystemdActuator(systemctl=[str(fake)])
    assert actuator.command("start", "decode-100") == [str(fake), "start", "omni-worker@decode-100.service"]
    assert actuator.start("decode") == "decode-100" and actuator.start("decode") == "decode-101"
    assert actuator.drain("decode") == "decode-101" and actuator.active("decode") == 1
    actuator.close()
    assert record.read_text().splitlines() == ["start omni-worker@decode-100.service",
                                               "start omni-worker@decode-101.service",
                                               "stop --no-block omni-worker@decode-101.service",
                                               "stop --no-block omni-worker@decode-100.service"]
    with pytest.raises(ValueError):
        actuator.start("de-code")
    failing = SystemdActuator(systemctl=["false"])
    with pytest.raises(subprocess.CalledProcessError):
        failing.start("decode")
    assert failing.active("decode") == 0


# ------------------------------------------------------------------------------ real cluster


async def _load_until(url: str, concurrency: int, until, timeout_s: float, outcomes: list) -> None:
    """Keep ``concurrency`` greedy requests in flight until ``until()`` or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    counter = iter(range(10**6))
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        async def lane() -> None:
            while not until() and time.monotonic() < deadline:
                try:
                    tokens = await greedy_chat(client, next(counter), max_tokens=32)
                    outcomes.append(("ok", len(tokens)))
                except openai.APIError as exc:
                    outcomes.append(("failed", repr(exc)))
        await asyncio.gather(*(lane() for _ in range(concurrency)))


@pytest.mark.slow
def test_autoscaler_adds_a_decode_worker_under_load_and_drains_one_after(tiny_model, tmp_path):
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    actuator = None
    stop = threading.Event()
    thread = None
    try:
        cluster.start_broker()
        cluster.start_worker("prefill", "--capacity", "8")
        worker_argv = lambda role, index: [  # noqa: E731
            "omnirelay.workers.daemon", "--role", role, "--model", tiny_model, "--served-model-name", "tiny-llm",
            "--broker", cluster.broker_endpoint, "--capacity", "2", "--drain-timeout", "60", "--log-level", "INFO"]
        actuator = LocalProcessActuator(worker_argv, log_dir=str(tmp_path))
        policy = RolePolicy(min_workers=1, max_workers=2, up_samples=2, down_samples=3, up_cooldown_s=2.0,
                            down_cooldown_s=4.0, up_utilisation=0.9, down_utilisation=0.35)
        cluster.start_gateway()
        scaler = Autoscaler("tiny-llm", {"decode": policy}, actuator, GatewayProbe(cluster.url), interval_s=0.5)
        scaler.ensure_minimum()
        cluster.wait_healthy()
        thread = threading.Thread(target=scaler.run, args=(stop,), name="autoscaler")
        thread.start()

        def decode_live() -> int:
            return sum(1 for w in cluster.workers() if w["role"] == "decode")

        outcomes: list = []
        # Load rises: 6 streams against one decode worker holding 2 → queue and full utilisation.
        grown = lambda: actuator.active("decode") == 2 and decode_live() == 2   # noqa: E731
        asyncio.run(_load_until(cluster.url, 6, grown, 240, outcomes))
        assert grown(), (scaler.history, cluster.logs()[-3000:])
        assert scaler.history[0].action == "up"
        # Load falls: 1 stream over two workers (25 % utilisation) → one is drained while it serves.
        drained = lambda: ("exited", "decode-1") in actuator.events   # noqa: E731
        asyncio.run(_load_until(cluster.url, 1, drained, 240, outcomes))
        assert drained(), (scaler.history, actuator.events)
        assert [d.action for d in scaler.history] == ["up", "down"]
        assert scaler.history[1].worker == "decode-1"     # the one it added last, LIFO
        assert actuator.active("decode") == 1 and decode_live() == 1
        failed = [o for o in outcomes if o[0] != "ok"]
        assert not failed and len(outcomes) >= 10, (failed, len(outcomes))
        # The drained worker left by drain: it unregistered and exited 0, and no death was detected.
        assert actuator.exit_codes["decode-1"] == 0
        assert "unregistered" in cluster.logs() and "missed heartbeats" not in cluster.logs()
        print(f"\nautoscale: {len(outcomes)} requests, 0 failed; decisions: "
              f"{[(d.action, d.worker, d.reason) for d in scaler.history]}")
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
        if actuator is not None:
            actuator.close()
        cluster.stop()


def test_omni_serve_autoscale_hook_uses_the_roles_worker_command(tiny_model):
    """omni-serve --autoscale: each model's autoscaler gets the role's own worker command line and
    bounds; its loop runs on a thread that close() joins (no worker starts: MIN is 0 and the
    gateway URL answers nothing, so every pass is skipped and logged)."""
    from omnirelay.deploy.served_models import plan_models
    from omnirelay.deploy.serve import build_parser, worker_commands
    from omnirelay.fleet import serve_hook

    args = build_parser().parse_args([tiny_model, "--autoscale", "decode=0:3"])
    plans = plan_models([(tiny_model, "tiny-llm")], None, args.connector)
    handle = serve_hook.start(args, plans, "ipc:///tmp/none.sock", "http://127.0.0.1:9")
    try:
        (actuator,) = handle.actuators
        assert [t.is_alive() for t in handle.threads] == [True]
        expected = next(c.argv for c in worker_commands(args, plans, "ipc:///tmp/none.sock") if c.role == "decode")
        assert actuator._argv("decode", 0) == list(expected) and actuator.active("decode") == 0
    finally:
        handle.close()
    assert not any(t.is_alive() for t in handle.threads)


def _decode_pids(serve) -> set[int]:
    """omni-serve's decode worker processes (its fixed one and any the autoscaler started)."""
    pids = set()
    for pid in child_pids(serve.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if b"omnirelay.workers.daemon" in argv and argv[argv.index(b"--role") + 1] == b"decode":
            pids.add(pid)
    return pids


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_omni_serve_autoscale_adds_a_decode_worker_under_load_and_drains_it_after(tiny_model, tmp_path):
    """``omni-serve --autoscale decode=0:1``: the autoscaler inside omni-serve (its default policy:
    a 2 s interval, 2 hot samples to add, 4 cold ones to drain, 10 s / 20 s cool-downs) adds a decode
    worker when load rises and drains it when load falls, with no request failed. The stage file
    holds a decode worker to 2 sequences, so 6 streams fill it (utilisation 1, a queue) and 1 stream
    over two workers (25 %) is cold."""
    stages = (tmp_path / "llm.yaml")
    stages.write_text("stages:\n"
                      "  - {name: prefill, role: prefill, runtime: {max_batch_size: 8}}\n"
                      "  - {name: decode, role: decode, runtime: {max_batch_size: 2}}\n"
                      "connectors:\n  kv: {type: shared_memory, options: {ttl_s: 300}}\n"
                      "edges:\n  - {from: prefill, to: decode, connector: kv}\n")
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--stage-configs-path", str(stages),
                         "--autoscale", "decode=0:1", "--log-level", "INFO", "--drain-timeout", "30",
                         log_path=str(tmp_path / "serve.log"))
    try:
        fixed = _decode_pids(serve)
        assert len(fixed) == 1

        def decode_live() -> int:
            return sum(1 for w in requests.get(serve.url + "/cluster", timeout=10).json()["workers"]
                       if w["role"] == "decode")

        outcomes: list = []
        asyncio.run(_load_until(serve.url, 6, lambda: decode_live() == 2, 240, outcomes))
        assert decode_live() == 2, serve.output()[-4000:]
        assert "autoscale decode up" in serve.output()
        (extra,) = _decode_pids(serve) - fixed
        asyncio.run(_load_until(serve.url, 1, lambda: "autoscale decode down" in serve.output()
                                and not pid_alive(extra), 240, outcomes))
        log = serve.output()
        assert "autoscale decode down" in log and not pid_alive(extra), log[-4000:]
        assert decode_live() == 1 and _decode_pids(serve) == fixed   # the one it added went, the fixed one stays
        failed = [o for o in outcomes if o[0] != "ok"]
        assert not failed and len(outcomes) >= 10, (failed, len(outcomes))
        # It left by drain: the broker saw it unregister, and never missed its heartbeats.
        assert "unregistered" in log and "missed heartbeats" not in log
        print(f"\nomni-serve --autoscale: {len(outcomes)} requests, 0 failed; "
              + "; ".join(line for line in log.splitlines() if "autoscale decode" in line))
    finally:
        assert serve.stop(timeout=90) == 0
