"""The autoscaler's Ray actuator on a real two-node Ray cluster (loopback; tests/deploy/test_ray.py's
RayCluster): a decode worker started as a Ray actor registers with a real broker, and its drain
(SIGTERM through the actor) unregisters it and ends the actor."""

from __future__ import annotations

import time

import pytest

from cluster import Cluster
from test_ray import RayCluster

pytestmark = pytest.mark.slow


def _decode_workers(cluster: Cluster) -> int:
    return sum(1 for w in cluster.workers() if w["role"] == "decode")


def test_ray_actuator_starts_and_drains_a_worker(tiny_model, tmp_path, monkeypatch):
    # As test_ray's driver processes: Ray keeps 127.0.0.1 rather than rewriting it to a public address
    # (read when ray is imported, so set first).
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray = pytest.importorskip("ray")
    from omnirelay.fleet.actuators import RayActuator

    ray_cluster = RayCluster()
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    actuator = None
    try:
        ray_cluster.start()
        ray.init(address=ray_cluster.address, logging_level="ERROR")
        cluster.start_broker()
        cluster.start_gateway()
        argv = lambda role, index: ["omnirelay.workers.daemon", "--role", role, "--model", tiny_model,  # noqa: E731
                                    "--served-model-name", "tiny-llm", "--broker", cluster.broker_endpoint,
                                    "--capacity", "2", "--drain-timeout", "10"]
        actuator = RayActuator(argv, num_cpus=1, drain_s=30)
        assert actuator.start("decode") == "decode-autoscaled-0" and actuator.active("decode") == 1
        deadline = time.monotonic() + 180
        while _decode_workers(cluster) < 1 and time.monotonic() < deadline:
            time.sleep(1)
        assert _decode_workers(cluster) == 1, ray_cluster.output()[-3000:]
        assert actuator.drain("decode") == "decode-autoscaled-0" and actuator.active("decode") == 0
        deadline = time.monotonic() + 60
        while (_decode_workers(cluster) or actuator._draining) and time.monotonic() < deadline:
            actuator.poll()
            time.sleep(0.5)
        assert _decode_workers(cluster) == 0 and not actuator._draining
        assert "unregistered" in cluster.logs() and "missed heartbeats" not in cluster.logs()
    finally:
        if actuator is not None:
            actuator.close()
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
        ray_cluster.stop()
