"""Repeated broker failover: a symmetric pair (each broker ``--standby-of`` the other) survives kill -9
of the active, then, once the dead one has come back with its same command line as the survivor's
standby, kill -9 of the new active; the standby's watch works over CURVE; and a broker that took
over holds the gateways' messages until its workers have registered.

The load is streamed through the official ``openai`` client (its raw SSE lines, so that an error
event's whole body, ``request_id`` and ``stage`` included, can be judged). Every request must
complete with the tokens of the undisturbed run (greedy) or end with a structured error; none may
hang past its bound or end without either (0 hung, 0 lost, 0 wrong, 0 unstructured)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx2
import openai
import pytest
import zmq

from cluster import TOPICS, Cluster, assert_contract, classify, free_tcp_endpoint, is_structured_error
from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.daemon import BrokerDaemon
from omnirelay.lifecycle import Shutdown
from omnirelay.security import CurveKeys, keygen_main
from zmq_dealers import Dealers

N_PROMPTS, CONCURRENCY, MAX_TOKENS = 32, 8, 24
MAX_REQUESTS = 600          # the load runs while the faults do, but never past this
REQUEST_TIMEOUT_S = 60.0    # "hung": no end of the stream within this


class StreamEnded(Exception):
    def __init__(self, outcome: str, why: object):
        super().__init__(why)
        self.outcome, self.why = outcome, why


async def streamed_chat(client: openai.AsyncOpenAI, i: int) -> list[int]:
    """Request ``i`` (prompt ``i % N_PROMPTS``) as a stream; its token ids, or StreamEnded.
    ``logprobs`` makes every chunk that carries tokens go out, even one whose text is held back."""
    content = f"Request {i % N_PROMPTS}: say something about {TOPICS[i % len(TOPICS)]}."
    tokens: list[int] = []
    finished = False
    async with client.chat.completions.with_streaming_response.create(
            model="tiny-llm", messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=MAX_TOKENS, stream=True, logprobs=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}) as response:
        async for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise StreamEnded("error" if is_structured_error(event) else "unstructured", event)
            for choice in event["choices"]:
                tokens += choice.get("token_ids") or []
                finished = finished or bool(choice.get("finish_reason"))
    if not finished:
        raise StreamEnded("unstructured", f"stream ended without finish_reason or error after {len(tokens)} tokens")
    return tokens


async def _attempt(client: openai.AsyncOpenAI, i: int):
    try:
        return "completed", await asyncio.wait_for(streamed_chat(client, i), REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        return "hung", "no end of the stream in time"
    except StreamEnded as exc:
        return exc.outcome, exc.why
    except openai.APIStatusError as exc:   # refused before the stream began
        try:
            body = exc.response.json()
        except ValueError:
            body = None
        return ("error" if is_structured_error(body) else "unstructured"), f"{exc.status_code} {body}"
    except (openai.APIConnectionError, httpx2.HTTPError) as exc:   # the client's transport, mid-stream
        return "unstructured", repr(exc)


async def _load(url: str, n: int, busy=lambda: False) -> list:
    """At least ``n`` requests, ``CONCURRENCY`` at a time, and more while ``busy()`` (a fault is
    being played), up to ``MAX_REQUESTS``; results in request order."""
    results: list = []
    counter = iter(range(MAX_REQUESTS))
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S + 5) as client:
        async def lane() -> None:
            for i in counter:
                if i >= n and not busy():
                    return
                results.append((i, await _attempt(client, i)))
        await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    return [result for _, result in sorted(results, key=lambda item: item[0])]


def _wait_for_line(proc, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output():
        if time.monotonic() > deadline or not proc.alive():
            raise AssertionError(f"{proc.name}: no {text!r}:\n{proc.output()[-3000:]}")
        time.sleep(0.1)


class BrokerPair:
    """Two brokers, each the standby of the other, started (and restarted) with the same command lines."""

    def __init__(self, cluster: Cluster, *curve_args: str):
        self.cluster = cluster
        self.endpoints = cluster.broker_endpoint.split(",")
        self.curve_args = list(curve_args)
        self.procs: dict[str, object] = {}

    def start(self, endpoint: str):
        peer = next(e for e in self.endpoints if e != endpoint)
        name = f"broker-{self.endpoints.index(endpoint)}"
        self.procs[endpoint] = self.cluster._start(name, ["omnirelay.broker.daemon", "--endpoint", endpoint,
                                                          "--standby-of", peer, "--log-level", "INFO",
                                                          *self.curve_args])
        return self.procs[endpoint]

    def cold_start(self) -> None:
        """The first one finds nobody and takes over after its liveness period; then the second
        finds it answering and waits."""
        first, second = self.endpoints
        _wait_for_line(self.start(first), "omni-broker ready on " + first)
        _wait_for_line(self.start(second), "standby: the active broker at " + first + " answers")

    def fail_over(self, active: str) -> str:
        """kill -9 the broker at ``active``; the standby binds; the dead one comes back (same
        command line) as the new active's standby. Returns the new active endpoint."""
        standby = next(e for e in self.endpoints if e != active)
        self.procs[active].kill9()
        _wait_for_line(self.procs[standby], "omni-broker ready on " + standby)
        _wait_for_line(self.start(active), "standby: the active broker at " + standby + " answers")
        return standby


@pytest.mark.slow
def test_kill9_active_twice_under_streaming_load(tiny_model, tmp_path):
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path), broker=f"{free_tcp_endpoint()},{free_tcp_endpoint()}")
    pair = BrokerPair(cluster)
    try:
        pair.cold_start()
        cluster.start_worker("prefill", "--capacity", "8")
        cluster.start_worker("decode", "--capacity", "16")
        cluster.start_gateway()
        cluster.wait_healthy()
        cluster.wait_for_workers(2)
        baseline = [tokens for _, tokens in asyncio.run(_load(cluster.url, N_PROMPTS))]
        assert len(baseline) == N_PROMPTS and all(len(t) == MAX_TOKENS for t in baseline), baseline

        actives: list[str] = [pair.endpoints[0]]
        done = threading.Event()

        def two_failovers() -> None:
            try:
                time.sleep(1.0)   # let streams be open mid-way when the first broker dies
                actives.append(pair.fail_over(actives[-1]))
                time.sleep(1.0)
                actives.append(pair.fail_over(actives[-1]))
            finally:
                done.set()

        async def load_with_faults() -> list:
            fault = asyncio.create_task(asyncio.to_thread(two_failovers))
            try:
                return await _load(cluster.url, 4 * N_PROMPTS, busy=lambda: not done.is_set())
            finally:
                await fault   # re-raises a failed fail-over

        results = asyncio.run(load_with_faults())
        counts = classify(results, [baseline[i % N_PROMPTS] for i in range(len(results))])
        print(f"\ntwo kill -9 of the active broker, {len(results)} streamed requests: {counts}; "
              f"actives {actives}")
        assert_contract(counts, results)
        assert actives == [pair.endpoints[0], pair.endpoints[1], pair.endpoints[0]]
        assert counts["completed"] > 0

        # The broker that came back first, then took over the second time, serves the cluster.
        cluster.wait_for_workers(2)
        assert sorted(w["role"] for w in cluster.workers()) == ["decode", "prefill"]
        gateway = next(proc for proc in cluster.procs if proc.name.endswith("gateway"))
        # It followed both take-overs (each time a new broker id: its open streams resumed).
        assert len(re.findall(r"broker restarted; resuming \d+ open requests", gateway.output())) == 2
        after = asyncio.run(_load(cluster.url, N_PROMPTS))
        assert [r[0] for r in after] == ["completed"] * N_PROMPTS
        assert [r[1] for r in after] == baseline
    finally:
        cluster.stop()


@pytest.fixture
def curve_keys(tmp_path):
    root = tmp_path / "keys"
    assert keygen_main([str(root), "broker", "gateway", "worker"]) == 0
    return str(root)


def _answers(endpoint: str, keys: CurveKeys | None, timeout_ms: int = 5000) -> bool:
    """Whether the broker at ``endpoint`` answers a status query from a client with ``keys``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:
            keys.make_client(sock)
        sock.connect(endpoint)
        sock.send_multipart(p.encode(p.StatusQuery(1)))
        return bool(sock.poll(timeout_ms)) and isinstance(p.decode(sock.recv_multipart()), p.StatusReply)
    finally:
        sock.close(0)
        ctx.term()


def test_standby_watch_over_curve_and_failover_twice(tmp_path, curve_keys):
    """Both brokers with CURVE (the pair's shared broker key): the standby hears the active through
    a CURVE handshake, takes over when it dies, and the restarted one watches the new active the
    same way; a CURVE client (a worker's key) is served by whichever is active."""
    cluster = Cluster(model="unused", log_dir=str(tmp_path), broker=f"{free_tcp_endpoint()},{free_tcp_endpoint()}",
                      curve={"dir": curve_keys})
    pair = BrokerPair(cluster, *cluster._curve_args("broker", server=True, client=False))
    worker = CurveKeys.load(os.path.join(curve_keys, "worker.key_secret"), os.path.join(curve_keys, "broker.key"))
    try:
        pair.cold_start()
        first, second = pair.endpoints
        assert _answers(first, worker)
        assert pair.fail_over(first) == second
        assert _answers(second, worker)
        assert pair.fail_over(second) == first
        assert _answers(first, worker)
        assert not _answers(first, None, timeout_ms=500)   # CURVE is still required of everyone else
    finally:
        cluster.stop()


def test_standby_with_curve_refuses_a_key_its_active_would_not_admit(tmp_path, curve_keys):
    """A watch the active refuses would look like a dead active: the standby must not start."""
    os.remove(os.path.join(curve_keys, "authorized", "broker.key"))
    result = subprocess.run([sys.executable, "-m", "omnirelay.broker.daemon", "--endpoint", free_tcp_endpoint(),
                             "--standby-of", free_tcp_endpoint(),
                             "--curve-secret-key", os.path.join(curve_keys, "broker.key_secret"),
                             "--curve-authorized-keys", os.path.join(curve_keys, "authorized")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "public certificate is not in" in result.stderr


def test_a_broker_that_took_over_holds_gateway_messages_until_its_workers_registered(tmp_path):
    """Right after a take-over the broker knows no worker: a resubmitted request would fail at once
    as ``unavailable``. During the warm-up the gateway's messages wait (HelloAck included) and then
    reach the core in order, after the worker that registered meanwhile."""
    model, far = "m", time.time() + 600
    shutdown = Shutdown()
    daemon = BrokerDaemon(BrokerConfig(endpoint=f"ipc://{tmp_path}/broker", liveness_s=60.0), shutdown, warm_up_s=5.0)
    runner = threading.Thread(target=daemon.run, name="broker-daemon")
    runner.start()
    dealers = Dealers(daemon.endpoint)
    dealer = dealers.connect

    def recv(sock: zmq.Socket, timeout_s: float = 30.0):
        assert sock.poll(int(timeout_s * 1000)), "no reply"
        return p.decode(sock.recv_multipart())

    try:
        gateway, worker = dealer(b"gw-1"), dealer(b"w1")
        gateway.send_multipart(p.encode(p.GatewayHello("gw-1")))
        gateway.send_multipart(p.encode(p.Submit("r1", model, ["prefill"], [1, 2], TextParams(), far, "ipc://reply")))
        gateway.send_multipart(p.encode(p.StatusQuery(1)))   # answered at once: the gateway sees no worker yet
        assert recv(gateway) == p.StatusReply(1, [], {})
        for msg in (p.Register("w1", "prefill", model, capacity=2), p.Credit("w1", 2), p.StatusQuery(2)):
            worker.send_multipart(p.encode(msg))
        assert [w["worker_id"] for w in recv(worker).workers] == ["w1"]
        assert not gateway.poll(0)   # the hello waits for the warm-up's end

        task = recv(worker)
        assert isinstance(task, p.Task) and task.request_id == "r1"   # dispatched, not failed as unavailable
        assert isinstance(recv(gateway), p.HelloAck)
    finally:
        shutdown.request()
        runner.join(30)
        dealers.close()
    assert not runner.is_alive()
