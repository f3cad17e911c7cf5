"""A spoken request cancelled and dispatched again to the same generate worker while its first
attempt's synthesis thread still runs (issue #42): the broker does this when a request is failed
and resubmitted with one generate worker. The new attempt must be spoken and answered, and the
first attempt's thread collected without touching it (before: the new attempt overwrote the old
one's place, its audio was swallowed as the cancelled one's, and it died at its deadline with its
inputs' keys left behind).

Real processes: a broker and one generate worker of the tiny Qwen2.5-Omni on a shared-memory
directory of this test's own. The test plays the gateway on the bus (hello, Submit, Cancel, the
``reply_to`` socket) and the prefill stage before generate (a registered worker on the bus that
writes the thinker's states to the connector and reports its stage done with their hand-off). The
first attempt's reply is streamed and its second chunk never comes, so that attempt's synthesis
thread is waiting for the thinker when the cancel and the new attempt arrive (it notices the cancel
only at the end of its current wait slice).
"""

from __future__ import annotations

import base64
import time

import pytest
import torch
import zmq

from omnirelay.broker import protocol as p
from omnirelay.connectors.shared_memory import SharedMemoryConnector
from omnirelay.deploy.builders.omni import build_tiny_omni
from omnirelay.errors import TransferFailed
from omnirelay.handoffs import ChunkStream, SpeechHandoff
from omnirelay.speech_params import SpeechParams

from cluster import Cluster, free_tcp_endpoint
from zmq_dealers import Dealers

pytestmark = pytest.mark.slow

MODEL = "tiny-omni"
GATEWAY = b"gw-redispatch"
PREFILL = "prefill-played-by-the-test"
PROMPT = [101, 305, 77, 850, 412, 96, 733, 250, 618, 149, 902]
REPLY = [220, 517, 388, 940, 131, 705, 262]
BOUND_S = 60.0   # "hung": the answer has not come within this (the deadline is later)


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shm-redispatch")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shm_dir):
    model = build_tiny_omni(tmp_path_factory.mktemp("models") / MODEL, seed=0)
    c = Cluster(str(model), str(tmp_path_factory.mktemp("redispatch-logs")), model_name=MODEL)
    try:
        c.start_broker()
        c.start_worker("generate", "--connector", "shared_memory",
                       "--connector-options", f'{{"shm_dir": "{shm_dir}"}}', "--capacity", "2")
        yield c
    finally:
        c.stop()


class Gateway:
    """The test's side of the bus: a DEALER to the broker under :data:`GATEWAY` and a PULL socket at
    ``reply_to`` for what the worker pushes."""

    def __init__(self, cluster: Cluster):
        self.dealers = Dealers(cluster.broker_endpoint)
        self.bus = self.dealers.connect(GATEWAY)
        self.prefill = self.dealers.connect(PREFILL.encode())
        self.reply_to = free_tcp_endpoint()
        self.pull = self.dealers.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.reply_to)
        self.dealers.socks.append(self.pull)
        self.hello = 0.0

    def send(self, msg: p.Message) -> None:
        self.bus.send_multipart(p.encode(msg))

    def as_prefill(self, msg: p.Message) -> None:
        self.prefill.send_multipart(p.encode(msg))

    def say_hello(self) -> None:
        """A gateway that stops saying hello has its requests dropped, a worker that stops beating
        its tasks (broker liveness)."""
        if time.monotonic() - self.hello > 0.5:
            self.send(p.GatewayHello(GATEWAY.decode()))
            self.as_prefill(p.Heartbeat(PREFILL))
            self.hello = time.monotonic()

    def poll(self, timeout_ms: int = 100) -> list[p.Message]:
        """What the broker and the worker sent since (the prefill role's messages too)."""
        self.say_hello()
        out = []
        for sock in zmq.select([self.bus, self.pull, self.prefill], [], [], timeout_ms / 1000)[0]:
            while True:
                try:
                    out.append(p.decode(sock.recv_multipart(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return out

    def wait_for_workers(self) -> None:
        """The test's prefill registered, and the generate worker."""
        self.as_prefill(p.Register(PREFILL, "prefill", MODEL, 4))
        self.as_prefill(p.Credit(PREFILL, 4))
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            self.send(p.StatusQuery(1))
            for msg in self.poll(200):
                if isinstance(msg, p.StatusReply) and {w["role"] for w in msg.workers} == {"prefill", "generate"}:
                    return
        raise AssertionError("no generate worker registered")

    def prefill_done(self, handoff: SpeechHandoff) -> None:
        """Answer the prefill Task of the request with ``handoff`` for generate."""
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            for msg in self.poll():
                assert not isinstance(msg, (p.RequestFailed, p.ErrorReply)), msg
                if isinstance(msg, p.Task) and msg.stage == "prefill":
                    self.as_prefill(p.StageDone(PREFILL, msg.request_id, "prefill", handoff, attempt=msg.attempt))
                    self.as_prefill(p.Credit(PREFILL, 1))
                    return
        raise AssertionError("no prefill task")

    def close(self) -> None:
        self.dealers.close()


def _write_prompt(connector: SharedMemoryConnector, key: str, hidden: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    connector.put(key, {"hidden": torch.randn(len(PROMPT), hidden, generator=gen), "image_grids": [],
                        "audio_lengths": []})


def _submit(request_id: str, reply_to: str) -> p.Submit:
    params = SpeechParams(voice="Ethan", format="pcm", seed=3, max_codes=24)
    return p.Submit(request_id, MODEL, ["prefill", "generate"], PROMPT, params, time.time() + 2 * BOUND_S,
                    reply_to)


def _gone(connector: SharedMemoryConnector, key: str) -> bool:
    try:
        connector.get(key, timeout=0.05)
    except TransferFailed:
        return True
    return False


def test_a_request_redispatched_while_its_old_thread_runs_is_answered(cluster, shm_dir):
    from omnirelay.deploy.builders.omni import HIDDEN
    connector = SharedMemoryConnector({"shm_dir": str(shm_dir)})
    gw = Gateway(cluster)
    try:
        gw.wait_for_workers()
        # Attempt 1: the reply streamed, its first chunk written, its second never.
        stream = ChunkStream("r1-reply", max_chunks=16, window=4)
        _write_prompt(connector, "r1-prompt-a", HIDDEN, 1)
        gen = torch.Generator().manual_seed(2)
        connector.put(stream.chunk(0), {"token_ids": REPLY[:4], "hidden": torch.randn(3, HIDDEN, generator=gen),
                                        "end": False})
        gw.send(_submit("r1", gw.reply_to))
        gw.prefill_done(SpeechHandoff("r1-prompt-a", reply_stream=stream))
        deadline = time.monotonic() + BOUND_S
        while not _gone(connector, stream.chunk(0)):   # read (and deleted): its talker waits for chunk 1
            assert time.monotonic() < deadline, "the generate worker never read the first reply chunk"
            refused = [m for m in gw.poll(50) if isinstance(m, (p.RequestFailed, p.ErrorReply))]
            assert not refused, refused
        # Cancelled, and dispatched again at once (to the only generate worker), a whole reply this time.
        _write_prompt(connector, "r1-prompt-b", HIDDEN, 1)
        connector.put("r1-reply-b", {"token_ids": REPLY, "hidden": torch.randn(len(REPLY) - 1, HIDDEN, generator=gen)})
        gw.send(p.Cancel("r1"))
        gw.send(_submit("r1", gw.reply_to))
        gw.prefill_done(SpeechHandoff("r1-prompt-b", speech_reply_key="r1-reply-b"))
        audio, finished, failed = b"", False, None
        deadline = time.monotonic() + BOUND_S
        while not finished and failed is None and time.monotonic() < deadline:
            for msg in gw.poll():
                if isinstance(msg, p.MediaResult) and msg.request_id == "r1":
                    audio += base64.b64decode(msg.data)
                    finished = msg.finish
                elif isinstance(msg, p.RequestFailed):
                    failed = msg
        assert failed is None, f"the new attempt failed: {failed}"
        assert finished, "the new attempt was never answered (its audio swallowed as the cancelled one's)"
        assert audio
        # Both attempts' inputs are gone: the first's at its cancel, the second's once its audio was out.
        for key in ("r1-prompt-a", "r1-prompt-b", "r1-reply-b"):
            assert _gone(connector, key), key
    finally:
        gw.close()
        connector.close()
