"""Several hosts, for real: network namespaces joined by veth pairs through a bridge stand for the
machines of a small cluster, each daemon runs on "its" host, and only the network joins them.

    gw  10.211.0.1   broker (CURVE on tcp://10.211.0.1) + gateway (HTTP :8091, token socket)
    pf  10.211.0.2   encode worker + prefill worker
    d1  10.211.0.3   decode worker A
    d2  10.211.0.4   decode worker B, later decode worker C
    rd  10.211.0.5   redis-server (password) — the KV cache crosses hosts through it (stage YAML)
    cl  10.211.0.6   the client: bounded load, health and /cluster probes

The model is the tiny Qwen2.5-Omni, so a request with an image passes encode → prefill → decode:
its embeddings and then its KV cache cross hosts through Redis. Under text load a third decode worker joins, then decode worker A is drained with SIGTERM: no request
may fail. Every namespace (and with it every veth and the bridge), process and file is removed in
``finally``. Skipped only where this machine cannot create network namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from cluster import Proc
from netns import Hosts, NamespacesUnavailable

from omnirelay.security import keygen_main
from repo_paths import SUPPORT_DIR

HERE = str(SUPPORT_DIR)
MODEL_NAME = "tiny-omni"
REDIS_PASSWORD = "multihost-test-secret"


def _client(hosts: Hosts, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([*hosts.prefix("cl"), sys.executable, os.path.join(HERE, "netns_client.py"), *args],
                          capture_output=True, text=True, timeout=timeout)


def _cluster(hosts: Hosts, url: str) -> dict:
    result = _client(hosts, "cluster", url, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def _wait(predicate, timeout: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.output()[-1500:]}" for p in procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def _decoders(cluster: dict) -> dict[str, dict]:
    return {w["worker_id"]: w for w in cluster["workers"] if w["role"] == "decode"}


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> str:
    from omnirelay.deploy.builders.omni import build_tiny_omni
    return str(build_tiny_omni(tmp_path_factory.mktemp("models") / "tiny-omni", seed=0))


def test_kv_crosses_hosts_over_redis_with_curve_bus_and_a_drain_loses_nothing(tiny_omni):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; .ci/run installs it)")
    hosts = Hosts({"gw": 1, "pf": 2, "d1": 3, "d2": 4, "rd": 5, "cl": 6})
    work = tempfile.mkdtemp(prefix="omnirelay-multihost-")
    procs: list[Proc] = []
    load: subprocess.Popen | None = None
    redis: subprocess.Popen | None = None
    try:
        try:
            hosts.create()
        except NamespacesUnavailable as exc:
            pytest.skip(f"cannot create network namespaces here: {exc}")

        # Keys, as an operator makes them (omni-keygen), and the stage YAML every host reads.
        keys = os.path.join(work, "keys")
        assert keygen_main([keys, "broker", "gateway", "worker"]) == 0
        redis_url = f"redis://:{REDIS_PASSWORD}@{hosts.address('rd')}:6379/0"
        pipeline = os.path.join(work, "pipeline.yaml")
        with open(pipeline, "w") as handle:
            handle.write(f"""stages:
  - {{name: encode, role: encode, runtime: {{max_batch_size: 4}}}}
  - {{name: prefill, role: prefill, runtime: {{max_batch_size: 8}}}}
  - {{name: decode, role: decode, runtime: {{max_batch_size: 16}}}}
connectors:
  kv: {{type: redis, options: {{url: "{redis_url}", ttl_s: 120}}}}
edges:
  - {{from: encode, to: prefill, connector: kv}}
  - {{from: prefill, to: decode, connector: kv}}
""")
        broker = f"tcp://{hosts.address('gw')}:5555"
        url = f"http://{hosts.address('gw')}:8091"
        secret = lambda name: os.path.join(keys, f"{name}.key_secret")  # noqa: E731
        worker_keys = ["--curve-secret-key", secret("worker"), "--curve-server-key", os.path.join(keys, "broker.key")]
        counter = iter(range(1, 100))

        def start(host: str, name: str, argv: list[str]) -> Proc:
            proc = Proc(f"{next(counter):02d}-{name}", argv, work, prefix=hosts.prefix(host))
            procs.append(proc)
            return proc

        redis_dir = os.path.join(work, "redis")
        os.makedirs(redis_dir)
        redis = subprocess.Popen([*hosts.prefix("rd"), "redis-server", "--bind", hosts.address("rd"), "--port", "6379",
                                  "--requirepass", REDIS_PASSWORD, "--save", "", "--appendonly", "no",
                                  "--dir", redis_dir, "--logfile", os.path.join(redis_dir, "redis.log")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

        def worker(host: str, role: str, name: str) -> Proc:
            return start(host, name, ["omnirelay.workers.daemon", "--role", role, "--model", tiny_omni,
                                      "--served-model-name", MODEL_NAME, "--broker", broker,
                                      "--stage-configs-path", pipeline, "--drain-timeout", "20",
                                      "--log-level", "INFO", *worker_keys])

        start("gw", "broker", ["omnirelay.broker.daemon", "--endpoint", broker, "--log-level", "INFO",
                               "--curve-secret-key", secret("broker"),
                               "--curve-authorized-keys", os.path.join(keys, "authorized")])
        start("gw", "gateway", ["omnirelay.gateway.daemon", "--model", tiny_omni, "--served-model-name", MODEL_NAME,
                                "--broker", broker, "--host", hosts.address("gw"), "--port", "8091",
                                "--reply-host", hosts.address("gw"), "--stage-configs-path", pipeline,
                                "--log-level", "INFO", "--curve-secret-key", secret("gateway"),
                                "--curve-server-key", os.path.join(keys, "broker.key"),
                                "--curve-authorized-keys", os.path.join(keys, "authorized")])
        worker("pf", "encode", "encode")
        worker("pf", "prefill", "prefill")
        decode_a = worker("d1", "decode", "decode-a")
        worker("d2", "decode", "decode-b")

        health = _client(hosts, "health", url, "150", timeout=170)
        assert health.returncode == 0, health.stdout + "\n".join(p.output()[-1500:] for p in procs)
        assert all(p.alive() for p in procs)
        assert redis.poll() is None
        first = _decoders(_cluster(hosts, url))
        assert len(first) == 2

        # An image from the client host: encoded on pf, its embeddings and KV cache through Redis.
        media = _client(hosts, "media", url, MODEL_NAME, timeout=150)
        assert media.returncode == 0, media.stdout + media.stderr[-2000:]
        assert json.loads(media.stdout)["finish_reason"] in ("stop", "length"), media.stdout
        _wait(lambda: any(w["stats"].get("encoded_requests", 0) >= 1 for w in _cluster(hosts, url)["workers"]
                          if w["role"] == "encode"), 15, "the encode worker to report the image", procs)

        # Bounded load from the client host: until told to stop, 400 requests or 150 s at most.
        out = os.path.join(work, "load.json")
        stop_file = os.path.join(work, "stop-load")
        load = subprocess.Popen([*hosts.prefix("cl"), sys.executable, os.path.join(HERE, "netns_client.py"), "load",
                                 url, MODEL_NAME, out, "--concurrency", "3", "--max-requests", "400",
                                 "--max-seconds", "150", "--stop-file", stop_file],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

        def answered() -> int:
            try:
                with open(out + ".progress") as handle:
                    return json.load(handle)["ok"]
            except (OSError, ValueError):
                return 0

        _wait(lambda: answered() >= 6, 60, "the load to get going", procs)

        # Scale out: a third decode worker joins on d2 and takes work.
        worker("d2", "decode", "decode-c")
        _wait(lambda: len(_decoders(_cluster(hosts, url))) == 3, 90, "the third decode worker to register", procs)
        new_id = next(iter(set(_decoders(_cluster(hosts, url))) - set(first)))
        _wait(lambda: _decoders(_cluster(hosts, url)).get(new_id, {}).get("stats", {}).get("kv_loads", 0) > 0, 60,
              "the third decode worker to load a KV cache from Redis", procs)

        # Scale in: decode worker A drains (SIGTERM) while the load goes on.
        before_drain = answered()
        assert decode_a.stop(signal.SIGTERM, timeout=60) == 0, decode_a.output()[-3000:]
        _wait(lambda: len(_decoders(_cluster(hosts, url))) == 2, 30, "the drained worker to leave", procs)
        _wait(lambda: answered() >= before_drain + 6, 60, "requests after the drain", procs)

        open(stop_file, "w").close()
        load.wait(90)
        with open(out) as handle:
            result = json.load(handle)
        print("load:", result)
        assert result["failed"] == 0, result
        assert result["ok"] >= 18, result

        # The KV caches went through Redis: prefill put them there, the decoders got them back.
        workers = _cluster(hosts, url)["workers"]
        puts = sum(w["stats"].get("connector_puts", 0) for w in workers if w["role"] == "prefill")
        gets = sum(w["stats"].get("connector_gets", 0) for w in workers if w["role"] == "decode")
        # Heartbeat counters lag by up to a second, and a request whose first token ends it never
        # hands KV off, so only require that both sides really used Redis.
        assert puts > 0 and gets > 0, workers
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait(10)
        for proc in reversed(procs):
            if proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            proc.stop(timeout=30)
        if redis is not None and redis.poll() is None:
            redis.terminate()
            try:
                redis.wait(10)
            except subprocess.TimeoutExpired:
                redis.kill()
                redis.wait(10)
        left = hosts.remove()
        shutil.rmtree(work, ignore_errors=True)
    assert not left and not hosts.existing(), f"namespaces left behind: {left or hosts.existing()}"
