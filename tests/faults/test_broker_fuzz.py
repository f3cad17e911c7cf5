"""Fuzzing the broker's input: the frame decoder (property-based) and a live broker under hostile traffic.

* ``protocol.decode`` is total: any list of frames, any msgpack body under a valid version and tag,
  any mutation of a valid encoding → a :class:`~omnirelay.broker.protocol.Message` of the tag's class or a
  :class:`~omnirelay.broker.protocol.ProtocolError`, never another exception. Every message class built
  from its own type hints round-trips through ``encode``/``decode`` unchanged.
* A real ``omni-broker`` on ``ipc://`` takes ~3 s of garbage from several DEALER sockets (random frame
  counts and bytes, valid version with random or real tags, bad msgpack, wrong field types, frames up to
  1 MB, messages not meant for the broker, and valid-looking messages that impersonate our worker or
  gateway) while the test's own worker + gateway pair keeps getting answers within a bounded latency. At
  the end the broker is alive, logged no handler traceback, and exits 0 on SIGTERM.

The broker's ``malformed_messages`` counter is not exposed on the wire (``StatusReply`` carries workers
and queue depths only), so the live test checks the observable contract instead: every garbage message
is answered with an ``ErrorReply``/``Reregister`` or ignored, and service to well-behaved peers goes on.

Hypothesis runs with a bounded number of examples, no deadline and no example database (nothing is
written into the checkout). Processes are stopped by PID; the fuzzing thread is owned and joined here.
"""

from __future__ import annotations

import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import typing
import types
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnirelay.broker import protocol as p
from omnirelay.image_params import ImageParams
from omnirelay.request_params import MAX_TOP_LOGPROBS, RequestParams, TextParams
from omnirelay.speech_params import SpeechParams
from omnirelay.video_params import VideoParams

from zmq_dealers import Dealers

SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLASSES = sorted(p._REGISTRY.values(), key=lambda cls: cls.TAG)
TAGS = [cls.TAG for cls in CLASSES]
VERSION = bytes([p.PROTOCOL_VERSION])


# ------------------------------------------------------------------------------------ strategies

def msgpack_values(max_leaves: int = 8) -> st.SearchStrategy:
    """Any value msgpack round-trips exactly (str map keys, 64-bit ints, no NaN — NaN != NaN)."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                       st.floats(allow_nan=False), st.text(max_size=12), st.binary(max_size=12))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=max_leaves)


VALID_PARAMS = [TextParams(), TextParams(max_tokens=2**62, top_k=2**31, seed=-2**63, logprobs=20, lora="a"),
                TextParams(speech=SpeechParams("v", stream=True)), SpeechParams("v", reply_start=3),
                ImageParams("p", n=2), VideoParams("p", 64, 48, 8, seed=1)]


def strategy_for(hint: Any) -> st.SearchStrategy:
    """A strategy of valid values for one field annotation of a message class."""
    if hint is Any:
        return msgpack_values()
    if hint == RequestParams:   # range-checked on construction: valid ones of each kind
        return st.sampled_from(VALID_PARAMS)
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):   # nested: TokenDeltas, a hand-off
        return messages_of(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(h) for h in typing.get_args(hint)))
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-2**63, 2**64 - 1)
    if hint is float:
        return st.floats(allow_nan=False)
    if hint is str:
        return st.text(max_size=24)
    if hint is bytes:
        return st.binary(max_size=24)
    if origin is list:
        (item,) = typing.get_args(hint)
        return st.lists(strategy_for(item), max_size=8)
    if origin is dict:
        key, value = typing.get_args(hint)
        assert key is str
        return st.dictionaries(st.text(max_size=8), strategy_for(value), max_size=4)
    raise AssertionError(f"no strategy for field type {hint!r}")


def messages_of(cls) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    fields = {f.name: strategy_for(hints[f.name]) for f in msgspec.structs.fields(cls)}
    if cls is p.TokenDelta:   # its logprob lists line up with token_ids (or are all empty)
        return token_deltas(fields)
    if cls is p.PooledResult:   # checked: one or more little-endian float32 values
        fields["data"] = st.integers(1, 6).flatmap(lambda n: st.binary(min_size=4 * n, max_size=4 * n))
    return st.builds(cls, **fields)


@st.composite
def token_deltas(draw, fields: dict) -> p.TokenDelta:
    values = {name: draw(strategy) for name, strategy in fields.items()
              if name not in ("logprobs", "top_token_ids", "top_logprobs", "cached_tokens", "prompt_logprobs")}
    values["cached_tokens"] = draw(st.integers(0, 2**62))   # checked: never negative
    if draw(st.booleans()):   # checked: its lists line up
        m = draw(st.integers(0, 4))
        values["prompt_logprobs"] = p.PromptLogprobs(draw(st.lists(st.floats(allow_nan=False), min_size=m, max_size=m)),
                                                     draw(st.lists(fields["start"], min_size=m, max_size=m)))
    n, k = len(values["token_ids"]), draw(st.integers(0, MAX_TOP_LOGPROBS))
    if draw(st.booleans()):
        values["logprobs"] = draw(st.lists(st.floats(allow_nan=False), min_size=n, max_size=n))
        if k:
            values["top_token_ids"] = [draw(st.lists(fields["start"], min_size=k, max_size=k)) for _ in range(n)]
            values["top_logprobs"] = [draw(st.lists(st.floats(allow_nan=False), min_size=k, max_size=k))
                                      for _ in range(n)]
    return p.TokenDelta(**values)


ANY_MESSAGE = st.one_of(*(messages_of(cls) for cls in CLASSES))


def field_maps(cls) -> st.SearchStrategy:
    """Maps that look like ``cls``'s body: its field names (and strangers) with arbitrary values."""
    names = [name for name, _, _ in cls._checks]
    keys = st.one_of(st.sampled_from(names), st.text(max_size=8), st.binary(max_size=4))
    return st.dictionaries(keys, msgpack_values(5), max_size=len(names) + 2)


def assert_total(frames: list[bytes]) -> None:
    """``decode`` returns a message of the tag's class or raises ProtocolError — nothing else."""
    try:
        msg = p.decode(frames)
    except p.ProtocolError:
        return
    assert isinstance(msg, p.Message)
    assert type(msg) is p._REGISTRY[bytes(frames[1])]


# ------------------------------------------------------------------------------------ decoder properties


@SETTINGS
@given(st.lists(st.binary(max_size=48), max_size=6))
def test_decode_of_arbitrary_frames_is_a_message_or_protocol_error(frames):
    assert_total(frames)


@SETTINGS
@given(st.sampled_from(TAGS + [b"", b"NOPE", b"\xff" * 3]), st.binary(max_size=256))
def test_decode_of_arbitrary_bytes_under_a_valid_version(tag, body):
    assert_total([VERSION, tag, body])


BODIES = st.one_of(*(st.tuples(st.just(cls.TAG), st.one_of(field_maps(cls), msgpack_values()))
                     for cls in CLASSES))


@SETTINGS
@given(BODIES)
def test_decode_of_arbitrary_msgpack_bodies_under_a_valid_tag(tag_and_body):
    tag, body = tag_and_body
    assert_total([VERSION, tag, msgpack.packb(body, use_bin_type=True)])


@SETTINGS
@given(ANY_MESSAGE, st.data())
def test_decode_of_mutated_valid_encodings(msg, data):
    version, tag, body = p.encode(msg)
    mutated = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
        at = data.draw(st.integers(0, max(0, len(mutated) - 1)))
        if action == "flip" and mutated:
            mutated[at] ^= data.draw(st.integers(1, 255))
        elif action == "truncate":
            del mutated[at:]
        else:
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    assert_total([version, tag, bytes(mutated)])


@SETTINGS
@given(ANY_MESSAGE)
def test_valid_messages_round_trip(msg):
    frames = p.encode(msg)
    assert len(frames) == 3 and frames[0] == VERSION and frames[1] == msg.TAG
    assert p.decode(frames) == msg


def test_strategies_cover_every_message_class():
    assert {cls.TAG for cls in CLASSES} == set(p._REGISTRY) and len(CLASSES) >= 17


# ------------------------------------------------------------------------------------ a live broker under fire

MODEL = "fuzz-live"
ROLE = "prefill"
WORKER_ID = "fz-worker"
GATEWAY = b"fz-gw"
FUZZ_SECONDS = 3.0
ANSWER_TIMEOUT_S = 2.0      # the bound on every answer the well-behaved pair waits for


class Fuzzer(threading.Thread):
    """Throws hostile traffic at the broker from several DEALER sockets until stopped or out of time.

    Owned by the test: started, stopped through :attr:`stop_event` and joined there. Its sockets are
    created and closed on this thread (ZeroMQ sockets are not thread-safe; the context is)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, seed: int, seconds: float, sockets: int = 4):
        super().__init__(name="broker-fuzzer", daemon=True)
        self.ctx, self.endpoint, self.seconds, self.n_sockets = ctx, endpoint, seconds, sockets
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.sent = 0
        self.sent_bytes = 0
        self.replies: dict[bytes, int] = {}
        self.kinds: dict[str, int] = {}
        self.error: BaseException | None = None
        self._big = self.rng.randbytes(1 << 20)

    # -- one hostile message per call
    def _frames(self) -> tuple[str, list[bytes]]:
        rng = self.rng
        kind = rng.choices(["random", "random_tag", "real_tag_bytes", "bad_msgpack", "wrong_fields",
                            "big", "not_for_broker", "mutated", "impersonate", "odd_submit"],
                           weights=[12, 10, 10, 8, 14, 2, 6, 14, 12, 12])[0]
        if kind == "random":
            frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 8))]
        elif kind == "random_tag":
            frames = [VERSION, rng.randbytes(rng.randint(0, 8)), msgpack.packb({"x": rng.random()})]
        elif kind == "real_tag_bytes":
            frames = [VERSION, rng.choice(TAGS), rng.randbytes(rng.randint(0, 200))]
        elif kind == "bad_msgpack":
            frames = [VERSION, rng.choice(TAGS), rng.choice([b"\xc1", b"\x82\xa1a", b"\xdf\xff\xff\xff\xff",
                                                             b"\x91" * 2000, b"\xd9\x05ab", b"\x81\xc0\x01"])]
        elif kind == "wrong_fields":
            cls = rng.choice(CLASSES)
            names = [name for name, _, _ in cls._checks]
            junk = [None, True, -1, 2**64 - 1, 1.5, math.inf, "", "x" * 50, b"\x00", [], {}, [1, "a"],
                    {"k": [1]}, {"": None}]
            body = {name: rng.choice(junk) for name in rng.sample(names, rng.randint(0, len(names)))}
            if rng.random() < 0.3:
                body[rng.choice(["extra", "worker_id ", "__class__"])] = 1
            frames = [VERSION, cls.TAG, msgpack.packb(body, use_bin_type=True)]
        elif kind == "big":
            size = rng.randint(100_000, 1 << 20)
            frames = rng.choice([[VERSION, rng.choice(TAGS), self._big[:size]],
                                 [self._big[:size]],
                                 [VERSION, self._big[:size], b""]])
        elif kind == "not_for_broker":
            frames = p.encode(rng.choice([
                p.Task("r", ROLE, MODEL, [1], TextParams(), {}, "ipc://x", 1e12), p.TokenDelta("r", 0, [1, 2]),
                p.TokenDeltas([p.TokenDelta("r", 0, [1]), p.TokenDelta("s", 4, [2], "stop")]),
                p.StatusReply(1, []), p.ErrorReply("x", "y"), p.Reregister(), p.CancelTask("r")]))
        elif kind == "mutated":
            frames = p.encode(p.Submit(f"fz-{rng.random()}", "no-such-model", [ROLE], [1, 2, 3],
                                       TextParams(temperature=0.0), 1e12, "ipc://x"))
            body = bytearray(frames[2])
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            frames[2] = bytes(body)
        elif kind == "impersonate":
            # Valid messages that claim our worker's id or our gateway's requests from another identity.
            frames = p.encode(rng.choice([
                p.Credit(WORKER_ID, rng.choice([-10**9, 10**9, 0])), p.Heartbeat(WORKER_ID, running=-1),
                p.StageDone(WORKER_ID, f"ok-{rng.randint(0, 50)}", ROLE, finished=True),
                p.StageFailed(WORKER_ID, f"ok-{rng.randint(0, 50)}", ROLE, "boom", "x"),
                p.Unregister(WORKER_ID), p.Cancel(f"ok-{rng.randint(0, 50)}"),
                p.Register(f"fz-rogue-{rng.randint(0, 3)}", "decode", "other-model", rng.choice([-5, 0, 10**9])),
            ]))
        else:  # odd_submit: valid Submits with hostile values, some for the model our worker serves
            model = rng.choice([MODEL, "other-model"])
            frames = p.encode(p.Submit(
                f"fz-sub-{rng.randint(0, 20)}", model,
                rng.choice([[], [ROLE], [ROLE, ROLE], ["no-such-role"], [""]]),
                rng.choice([[], [0], list(range(5000))]),
                rng.choice([TextParams(), TextParams(max_tokens=2**62, top_k=2**31), TextParams(seed=-2**63)]),
                rng.choice([0.0, 1e12, -1.0, math.inf, math.nan, time.time() + 0.2]),
                rng.choice(["", "ipc://nowhere", "x" * 1000]),
                position_offset=rng.choice([0, -1, 2**63 - 1])))
        return kind, frames

    def run(self) -> None:
        socks = []
        try:
            for i in range(self.n_sockets):
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 1000)
                sock.setsockopt(zmq.ROUTING_ID, b"fz-attacker-%d" % i)
                sock.connect(self.endpoint)
                socks.append(sock)
            deadline = time.monotonic() + self.seconds
            while not self.stop_event.is_set() and time.monotonic() < deadline:
                sock = self.rng.choice(socks)
                for _ in range(20):   # a burst, then read what came back
                    kind, frames = self._frames()
                    try:
                        sock.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.sent += 1
                    self.sent_bytes += sum(map(len, frames))
                    self.kinds[kind] = self.kinds.get(kind, 0) + 1
                for s in socks:
                    while s.poll(0, zmq.POLLIN):
                        reply = s.recv_multipart()
                        tag = reply[1] if len(reply) == 3 else b"?"
                        self.replies[tag] = self.replies.get(tag, 0) + 1
                time.sleep(0.001)   # leave the broker (and the honest pair) a share of the 2 cores
        except BaseException as exc:   # reported by the test after join
            self.error = exc
        finally:
            for sock in socks:
                sock.close(0)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=5)


@pytest.mark.timeout(30)
def test_live_broker_keeps_serving_while_random_frames_fly(tmp_path):
    endpoint = f"ipc://{tmp_path}/broker.sock"
    log_path = tmp_path / "broker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omnirelay.broker.daemon", "--endpoint", endpoint,
                                 "--log-level", "WARNING"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    dealers = Dealers(endpoint)
    dealer = dealers.connect
    fuzzer: Fuzzer | None = None

    def expect(sock: zmq.Socket, want: type, match, timeout_s: float, on_other=None) -> tuple[p.Message, float]:
        """The first message of type ``want`` for which ``match`` holds, and how long it took."""
        t0 = time.monotonic()
        while True:
            left = t0 + timeout_s - time.monotonic()
            assert left > 0 and sock.poll(int(left * 1000) + 1, zmq.POLLIN), \
                f"no {want.__name__} within {timeout_s} s (broker alive: {proc.poll() is None})"
            msg = p.decode(sock.recv_multipart())
            if isinstance(msg, want) and match(msg):
                return msg, time.monotonic() - t0
            if on_other is not None:
                on_other(msg)

    try:
        gw, worker = dealer(GATEWAY), dealer(WORKER_ID.encode())
        gw.send_multipart(p.encode(p.StatusQuery(0)))
        expect(gw, p.StatusReply, lambda m: True, 20.0)       # the broker is up
        worker.send_multipart(p.encode(p.Register(WORKER_ID, ROLE, MODEL, capacity=64)))
        worker.send_multipart(p.encode(p.Credit(WORKER_ID, 64)))
        worker.send_multipart(p.encode(p.StatusQuery(-1)))     # same socket: answered after the Register
        expect(worker, p.StatusReply, lambda m: m.query_id == -1, 10.0)

        def answer_task(msg: p.Message) -> None:
            """Tasks the fuzzer's valid Submits sent our way: finish them so credit comes back."""
            if isinstance(msg, p.Task):
                worker.send_multipart(p.encode(p.StageDone(WORKER_ID, msg.request_id, msg.stage, finished=True,
                                                           attempt=msg.attempt)))
                worker.send_multipart(p.encode(p.Credit(WORKER_ID, 1)))

        fuzzer = Fuzzer(dealers.ctx, endpoint, seed=int(os.environ.get("FUZZ_SEED", "20250601")), seconds=FUZZ_SECONDS)
        fuzzer.start()
        status_lat, task_lat, rounds = [], [], 0
        started = time.monotonic()
        while fuzzer.is_alive() and time.monotonic() - started < FUZZ_SECONDS + 2:
            rounds += 1
            worker.send_multipart(p.encode(p.Heartbeat(WORKER_ID)))
            gw.send_multipart(p.encode(p.StatusQuery(rounds)))
            reply, took = expect(gw, p.StatusReply, lambda m: m.query_id == rounds, ANSWER_TIMEOUT_S)
            status_lat.append(took)
            assert WORKER_ID in [w["worker_id"] for w in reply.workers], "our worker was dropped"

            rid = f"ok-{rounds}"
            gw.send_multipart(p.encode(p.Submit(rid, MODEL, [ROLE], [1, 2, 3], TextParams(temperature=0.0),
                                                time.time() + 30, "ipc://reply")))
            task, took = expect(worker, p.Task, lambda m: m.request_id == rid, ANSWER_TIMEOUT_S,
                                on_other=answer_task)
            task_lat.append(took)
            answer_task(task)
            time.sleep(0.02)
        fuzzer.join(timeout=10)
        assert not fuzzer.is_alive(), "the fuzzing thread did not stop"
        if fuzzer.error is not None:
            raise fuzzer.error

        # After the storm: the broker still answers at once and still knows our worker.
        gw.send_multipart(p.encode(p.StatusQuery(10**6)))
        reply, _ = expect(gw, p.StatusReply, lambda m: m.query_id == 10**6, ANSWER_TIMEOUT_S)
        assert [w["worker_id"] for w in reply.workers if w["model"] == MODEL] == [WORKER_ID]
        assert proc.poll() is None, "the broker died"

        ms = lambda xs: f"p50 {1000 * statistics.median(xs):.1f} ms, max {1000 * max(xs):.1f} ms"  # noqa: E731
        print(f"fuzzer sent {fuzzer.sent} messages ({fuzzer.sent_bytes / 1e6:.1f} MB) by kind {fuzzer.kinds}; "
              f"replies by tag {fuzzer.replies}; honest rounds {rounds}: StatusReply {ms(status_lat)}, "
              f"Task {ms(task_lat)}")
        assert rounds >= 20, f"only {rounds} honest rounds in {FUZZ_SECONDS} s"
        assert fuzzer.sent >= 1000, f"the fuzzer only sent {fuzzer.sent} messages"
        assert fuzzer.replies.get(p.ErrorReply.TAG, 0) > 0, "garbage was never answered with an ErrorReply"
        assert max(status_lat + task_lat) < ANSWER_TIMEOUT_S

        assert _stop(proc) == 0, "the broker did not shut down cleanly after the fuzzing"
        log_text = log_path.read_text()
        assert "Traceback" not in log_text, "a broker handler raised:\n" + log_text[-4000:]
    except BaseException:
        print("broker log:\n" + log_path.read_text()[-4000:])
        raise
    finally:
        if fuzzer is not None:
            fuzzer.stop_event.set()
            fuzzer.join(timeout=10)
        _stop(proc)
        dealers.close()
