"""CURVE on the bus: unauthorised peers are refused, authorised ones served, and an endpoint off
loopback is refused outright without keys."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import zmq

from omnirelay.broker import protocol as p
from omnirelay.security import is_loopback, keygen_main

from cluster import Cluster, free_tcp_endpoint


@pytest.fixture
def keys(tmp_path):
    root = tmp_path / "keys"
    assert keygen_main([str(root), "broker", "gateway", "worker"]) == 0
    # An outsider: a valid key pair that is not in the authorised directory.
    outsider = tmp_path / "outsider"
    assert keygen_main([str(outsider), "intruder"]) == 0
    return {"dir": str(root), "outsider": str(outsider / "intruder.key_secret")}


def _status_query(endpoint: str, secret_file: str | None, server_file: str | None, timeout_ms: int = 1500):
    import zmq.auth
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if secret_file:
            public, secret = zmq.auth.load_certificate(secret_file)
            sock.curve_secretkey, sock.curve_publickey = secret, public
            sock.curve_serverkey = zmq.auth.load_certificate(server_file)[0]
        sock.connect(endpoint)
        sock.send_multipart(p.encode(p.StatusQuery(7)))
        if not sock.poll(timeout_ms):
            return None
        return p.decode(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


def test_loopback_detection():
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://localhost:1") and is_loopback("ipc:///x")
    assert is_loopback("tcp://[::1]:5555")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://10.0.0.5:5555") and not is_loopback("tcp://broker.internal:5555")


def test_broker_off_loopback_without_keys_refuses_to_start():
    result = subprocess.run([sys.executable, "-m", "omnirelay.broker.daemon", "--endpoint", "tcp://0.0.0.0:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "CURVE keys are required" in result.stderr


def test_only_authorised_keys_reach_the_broker(keys, tmp_path):
    cluster = Cluster(model=".", log_dir=str(tmp_path), broker=free_tcp_endpoint(), curve=keys)
    broker = cluster.start_broker()
    try:
        authorised = None
        for _ in range(20):   # the broker may still be starting
            authorised = _status_query(cluster.broker_endpoint, f"{keys['dir']}/worker.key_secret",
                                       f"{keys['dir']}/broker.key", timeout_ms=500)
            if authorised is not None:
                break
        assert isinstance(authorised, p.StatusReply) and authorised.query_id == 7
        assert _status_query(cluster.broker_endpoint, keys["outsider"], f"{keys['dir']}/broker.key") is None
        assert _status_query(cluster.broker_endpoint, None, None) is None   # plain text: refused
        assert broker.alive()
    finally:
        cluster.stop()


def test_chat_end_to_end_with_curve(keys, tiny_model, tmp_path):
    with Cluster(model=tiny_model, log_dir=str(tmp_path), curve=keys) as cluster:
        cluster.start_llm()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 6


def test_omni_serve_broker_on_tcp_with_curve_admits_an_outside_worker(keys, tiny_model, tmp_path):
    """omni-serve --broker binds a TCP endpoint with CURVE; a worker started elsewhere (another
    process with the worker key) joins the same cluster."""
    import os
    import time

    import requests

    from cluster import Proc
    from conftest import ServeProcess

    endpoint = free_tcp_endpoint()
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--broker", endpoint,
                         "--curve-keys", keys["dir"], log_path=str(tmp_path / "serve.log"))
    outsider = None
    try:
        outsider = Proc("outside-decode", [
            "omnirelay.workers.daemon", "--role", "decode", "--model", tiny_model, "--served-model-name",
            "tiny-llm", "--broker", endpoint, "--curve-secret-key", os.path.join(keys["dir"], "worker.key_secret"),
            "--curve-server-key", os.path.join(keys["dir"], "broker.key")], str(tmp_path))
        deadline = time.monotonic() + 60
        pids: set = set()
        while time.monotonic() < deadline and outsider.pid not in pids:
            pids = {w["pid"] for w in requests.get(serve.url + "/cluster", timeout=10).json()["workers"]}
            time.sleep(0.3)
        assert outsider.pid in pids
    finally:
        if outsider is not None:
            outsider.stop()
        serve.stop()


def test_omni_serve_refuses_an_open_broker_without_keys(tiny_model):
    result = subprocess.run([sys.executable, "-m", "omnirelay.deploy.serve", tiny_model, "--broker",
                             "tcp://0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--curve-keys" in result.stderr
