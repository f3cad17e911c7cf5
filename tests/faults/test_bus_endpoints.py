"""Bus fields that name an endpoint (issue #27, item 1): ``reply_to`` is checked where it enters (the
broker refuses a Submit with a structured error) and where it is used (a worker fails such a task,
and its reply sockets never keep its ZeroMQ context from terminating); the worker's reply sockets
are bounded in number and closed when idle.

Before: ``tcp://127.0.0.1:notaport`` was admitted, the worker's ``connect()`` raised on it, the
socket was never closed and the worker hung in ``ctx.term()`` for ever at shutdown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.broker.config import BrokerConfig
from omnirelay.broker.core import BrokerCore
from omnirelay.endpoints import endpoint_error
from omnirelay.security import CurveKeys
from omnirelay.workers.runtime.reply_sockets import ReplySockets

BAD = ["tcp://127.0.0.1:notaport", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://*:5555", "tcp://:5555",
       "inproc://worker-internal", "udp://127.0.0.1:5", "tcp://127.0.0.1", "tcp://a;b:5", "tcp://[nope]:5",
       "tcp://host:5\n", "ipc://", "tcp://" + "h" * 300 + ":5"]
GOOD = ["tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://gateway-3.internal:40001", "ipc:///tmp/gw.sock"]
FAR = 1e12


def _core() -> BrokerCore:
    core = BrokerCore(BrokerConfig(endpoint="ipc:///unused"))
    core.on_message(b"pre", p.Register("pre", "prefill", "m", 4), 0.0)
    core.on_message(b"pre", p.Credit("pre", 4), 0.0)
    return core


@pytest.mark.parametrize("endpoint", BAD)
def test_broker_refuses_a_submit_whose_reply_to_is_not_an_endpoint(endpoint):
    core = _core()
    out = core.on_message(b"gw", p.Submit("r1", "m", ["prefill"], [1, 2], TextParams(), FAR, endpoint), 0.0)
    assert [type(msg) for _, msg in out] == [p.RequestFailed], out   # no Task reaches a worker
    failed = out[0][1]
    assert (failed.request_id, failed.error_type) == ("r1", "bad_request")
    assert failed.message.startswith("reply_to: ")
    assert core.requests == {}


@pytest.mark.parametrize("endpoint", GOOD)
def test_broker_admits_a_well_formed_reply_to(endpoint):
    assert endpoint_error(endpoint) == ""
    out = _core().on_message(b"gw", p.Submit("r1", "m", ["prefill"], [1, 2], TextParams(), FAR, endpoint), 0.0)
    assert [(type(msg), msg.reply_to) for _, msg in out] == [(p.Task, endpoint)]


# ---------------------------------------------------------------------- the worker's reply sockets


def _terminates(ctx: zmq.Context, timeout: float = 10.0) -> bool:
    """Whether ``ctx.term()`` returns within ``timeout`` (it waits for every socket to be closed)."""
    thread = threading.Thread(target=ctx.term, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def _pulls(ctx: zmq.Context, n: int) -> list[tuple[str, zmq.Socket]]:
    out = []
    for _ in range(n):
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.bind("tcp://127.0.0.1:*")
        out.append((sock.getsockopt_string(zmq.LAST_ENDPOINT), sock))
    return out


def _delta(n: int) -> p.TokenDelta:
    return p.TokenDelta("r1", n, [n])


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:notaport", "inproc://x"])
def test_a_refused_endpoint_leaves_no_socket_open(endpoint):
    ctx = zmq.Context()
    replies = ReplySockets(ctx)
    replies.send(endpoint, _delta(0))
    replies.send(endpoint, _delta(1))
    assert replies.open_sockets == 0
    assert _terminates(ctx)   # no close() first: nothing may be left open


def test_a_failed_set_up_closes_its_socket():
    """A socket whose set-up raises (here a CURVE key that is not one) is closed at once."""
    public, secret = zmq.curve_keypair()
    ctx = zmq.Context()
    replies = ReplySockets(ctx, CurveKeys(public=public, secret=secret))
    replies.note_key("tcp://127.0.0.1:5555", "not a z85 key")
    replies.send("tcp://127.0.0.1:5555", _delta(0))
    assert replies.open_sockets == 0
    assert _terminates(ctx)


def test_reply_sockets_are_bounded_least_recently_used_first():
    ctx = zmq.Context()
    gateways = _pulls(ctx, 3)
    replies = ReplySockets(ctx, max_sockets=2)
    try:
        for i, (endpoint, pull) in enumerate(gateways):
            replies.send(endpoint, _delta(i))
            assert p.decode(pull.recv_multipart()) == _delta(i)
        assert replies.open_sockets == 2          # the first gateway's socket was closed for the third
        first, pull = gateways[0]
        replies.send(first, _delta(7))            # opened again on its next send
        assert p.decode(pull.recv_multipart()) == _delta(7)
        assert replies.open_sockets == 2
    finally:
        replies.close()
        for _, pull in gateways:
            pull.close(0)
    assert _terminates(ctx)


def test_idle_reply_sockets_are_closed():
    ctx = zmq.Context()
    (endpoint, pull), = _pulls(ctx, 1)
    replies = ReplySockets(ctx, idle_s=60.0)
    try:
        replies.send(endpoint, _delta(0), now=100.0)
        assert p.decode(pull.recv_multipart()) == _delta(0)
        assert replies.close_idle(now=150.0) == 0 and replies.open_sockets == 1
        assert replies.close_idle(now=161.0) == 1 and replies.open_sockets == 0
        replies.send(endpoint, _delta(1), now=170.0)   # a gateway heard from again gets a new one
        assert p.decode(pull.recv_multipart()) == _delta(1)
        assert replies.open_sockets == 1
    finally:
        replies.close()
        pull.close(0)
    assert _terminates(ctx)


# ---------------------------------------------------------------------- a real worker handed such a task


def _recv(router: zmq.Socket, want: type, deadline_s: float) -> p.Message:
    """The next message of type ``want`` from the worker (others, e.g. heartbeats, skipped)."""
    deadline = time.monotonic() + deadline_s
    while (left := deadline - time.monotonic()) > 0:
        if router.poll(int(left * 1000)):
            msg = p.decode(router.recv_multipart()[1:])
            if isinstance(msg, want):
                return msg
    raise AssertionError(f"no {want.__name__} from the worker within {deadline_s}s")


def test_a_worker_fails_a_task_with_a_bad_reply_to_and_still_shuts_down(tiny_model, tmp_path):
    """The worker plays against a peer that sends it what a broker would not (any bus peer can)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    (gateway, pull), = _pulls(ctx, 1)
    shm = tmp_path / "shm"
    shm.mkdir()
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "omnirelay.workers.daemon", "--role", "prefill", "--model", tiny_model,
         "--served-model-name", "tiny-llm", "--worker-id", "pre-1", "--log-level", "INFO",
         "--broker", router.getsockopt_string(zmq.LAST_ENDPOINT),
         "--connector-options", '{"shm_dir": "%s"}' % shm],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _recv(router, p.Credit, 120)
        sampling = TextParams(temperature=0.0, max_tokens=1)
        bad = p.Task("bad", "prefill", "tiny-llm", [1, 2, 3], sampling, None, "tcp://127.0.0.1:notaport", FAR)
        router.send_multipart([b"pre-1", *p.encode(bad)])
        failed = _recv(router, p.StageFailed, 30)
        assert (failed.request_id, failed.error_type) == ("bad", "bad_request")
        assert "reply_to" in failed.message
        # It goes on serving: a good task is answered at its gateway and reported.
        router.send_multipart([b"pre-1", *p.encode(p.Task("good", "prefill", "tiny-llm", [1, 2, 3], sampling,
                                                          None, gateway, FAR))])
        pull.setsockopt(zmq.RCVTIMEO, 30_000)
        assert p.decode(pull.recv_multipart()).request_id == "good"
        done = _recv(router, p.StageDone, 30)
        assert (done.request_id, done.finished) == ("good", True)
        if done.outputs is not None:
            router.send_multipart([b"pre-1", *p.encode(p.CancelTask("good", inputs=done.outputs))])
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        log.close()
        router.close(0)
        pull.close(0)
        ctx.term()


def test_a_socket_closed_for_room_reopens_with_its_gateways_curve_key():
    ctx = zmq.Context()
    server_public, server_secret = zmq.curve_keypair()
    curve_gateway = ctx.socket(zmq.PULL)
    curve_gateway.setsockopt(zmq.LINGER, 0)
    curve_gateway.setsockopt(zmq.RCVTIMEO, 5000)
    curve_gateway.curve_secretkey, curve_gateway.curve_publickey = server_secret, server_public
    curve_gateway.curve_server = True
    curve_gateway.bind("tcp://127.0.0.1:*")
    endpoint = curve_gateway.getsockopt_string(zmq.LAST_ENDPOINT)
    (other, other_pull), = _pulls(ctx, 1)
    public, secret = zmq.curve_keypair()
    replies = ReplySockets(ctx, CurveKeys(public=public, secret=secret), max_sockets=1)
    try:
        replies.note_key(endpoint, server_public.decode())
        replies.send(endpoint, _delta(0))
        assert p.decode(curve_gateway.recv_multipart()) == _delta(0)
        replies.note_key(other, "")
        replies.send(other, _delta(1))                 # the CURVE gateway's socket is closed for room
        assert p.decode(other_pull.recv_multipart()) == _delta(1)
        replies.send(endpoint, _delta(2))              # reopened, with the key noted before
        assert p.decode(curve_gateway.recv_multipart()) == _delta(2)
    finally:
        replies.close()
        curve_gateway.close(0)
        other_pull.close(0)
    assert _terminates(ctx)
