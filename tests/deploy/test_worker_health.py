"""A worker's HTTP health endpoint (``omni-worker --health-port``, workers/runtime/health_server.py),
what the Kubernetes manifests probe: ``/live`` fails only for a wedged loop or a dead broker link,
``/ready`` passes only while the worker serves."""

from __future__ import annotations

import signal
import socket
import time

import pytest
import requests

from omnirelay.workers.runtime.health_server import HealthServer, WorkerHealth

from cluster import Cluster


@pytest.mark.parametrize("state, live, ready", [
    ("starting", 200, 503), ("serving", 200, 200), ("draining", 200, 503), ("wedged", 503, 503),
    ("link_down", 503, 503),
])
def test_each_state_answers_its_status(state, live, ready):
    server = HealthServer(lambda: WorkerHealth(state, "decode", "decode-1", 0.25), "127.0.0.1", 0)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        answer = requests.get(base + "/live", timeout=5)
        assert answer.status_code == live
        assert answer.json() == {"state": state, "role": "decode", "worker_id": "decode-1", "step_age_s": 0.25}
        assert requests.get(base + "/ready", timeout=5).status_code == ready
        assert requests.get(base + "/metrics", timeout=5).status_code == 404
    finally:
        server.close()
    with pytest.raises(requests.ConnectionError):   # closed: nothing listens any more
        requests.get(base + "/live", timeout=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_real_worker_is_ready_once_serving_and_exits_cleanly(tiny_model, tmp_path):
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    port = _free_port()
    try:
        cluster.start_broker()
        worker = cluster.start_worker("decode", "--health-port", str(port), "--worker-id", "decode-probed")
        deadline = time.monotonic() + 120
        answer = None
        while answer is None or answer.status_code != 200:
            assert time.monotonic() < deadline and worker.alive(), worker.output()[-3000:]
            try:
                answer = requests.get(f"http://127.0.0.1:{port}/ready", timeout=5)
            except requests.ConnectionError:   # still loading the model: not listening yet
                time.sleep(0.2)
        assert answer.json()["state"] == "serving" and answer.json()["worker_id"] == "decode-probed"
        assert requests.get(f"http://127.0.0.1:{port}/live", timeout=5).status_code == 200
        assert worker.stop(signal.SIGTERM) == 0   # drains (nothing held), closes the endpoint, exits 0
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/live", timeout=5)
    finally:
        cluster.stop()
