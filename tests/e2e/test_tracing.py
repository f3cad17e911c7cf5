"""Traces across the daemons (omnirelay/tracing.py): a real broker, prefill and decode workers and
gateway export to a real OTLP/HTTP receiver in the test (an HTTP server decoding the protobuf with
``opentelemetry-proto``), and a chat request's spans form one tree under the client's traceparent:
gateway → broker → stage prefill → prefill worker (→ its KV put), and broker → stage decode → decode
worker (→ its KV get).
Tracing off: no traceparent on the wire and no OpenTelemetry module loaded."""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import numpy as np
import openai
import pytest
from PIL import Image
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams

from cluster import Cluster
from repo_paths import REPO_ROOT


@dataclasses.dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    error: bool
    events: tuple = ()    # (name, attributes) in order


class OtlpReceiver:
    """``POST /v1/traces`` (OTLP/HTTP, protobuf): every span received, by arrival."""

    def __init__(self):
        self.spans: list[Span] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):   # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    events = tuple((e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events)
                    spans.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                      s.start_time_unix_nano, s.end_time_unix_nano, attributes,
                                      s.status.code == 2, events))
        with self._changed:
            self.spans.extend(spans)
            self._changed.notify_all()

    def wait_for(self, trace_id: str, names: set[str] | collections.Counter, timeout: float = 60.0) -> list[Span]:
        """The spans of ``trace_id`` once ``names`` have arrived (a Counter: that many of each name),
        waiting on their arrival, at most ``timeout`` seconds."""
        wanted = collections.Counter(names)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                spans = [s for s in self.spans if s.trace_id == trace_id]
                missing = wanted - collections.Counter(s.name for s in spans)
                if not missing:
                    return spans
                left = deadline - time.monotonic()
                assert left > 0, f"spans never arrived: {dict(missing)} (got {spans})"
                self._changed.wait(left)

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(10)
        self._server.server_close()


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


def test_submit_and_task_leave_traceparent_off_the_wire_when_untraced():
    submit = p.Submit(request_id="r", model="m", stages=["prefill"], prompt_token_ids=[1], params=TextParams(),
                      deadline=1.0, reply_to="tcp://127.0.0.1:1")
    assert b"traceparent" not in p.encode(submit)[2]
    traced = msgspec.structs.replace(submit, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert p.decode(p.encode(traced)).traceparent == traced.traceparent


def test_an_unsampled_request_hands_on_no_traceparent(receiver):
    """Sampling is decided at the gateway: an unsampled span gives "" (nothing downstream traces),
    a client's sampled traceparent is followed whatever the ratio."""
    from omnirelay.tracing import Tracing
    tracing = Tracing("test", receiver.url, ratio=0.0)
    try:
        unsampled = tracing.start("request")
        assert tracing.traceparent(unsampled) == ""
        unsampled.end()
        parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
        followed = tracing.start("request", parent)
        assert tracing.traceparent(followed).startswith("00-" + "a" * 32 + "-")
        followed.end()
    finally:
        tracing.shutdown()


def test_no_opentelemetry_module_loads_without_the_flag():
    code = ("import sys, omnirelay.gateway.daemon, omnirelay.broker.daemon, omnirelay.workers.daemon;"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_chat_request_span_tree(tiny_model, tmp_path, receiver, monkeypatch):
    # Export within a fraction of a second instead of the SDK's 5 s batches (read by each daemon).
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    trace_args = ("--otlp-traces-endpoint", receiver.url)
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker(*trace_args)
        cluster.start_worker("prefill", *trace_args, "--worker-id", "prefill-t")
        cluster.start_worker("decode", *trace_args, "--worker-id", "decode-t")
        cluster.start_gateway(*trace_args)
        cluster.wait_healthy()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
        answer = client.chat.completions.create(
            model="tiny-llm", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        spans = receiver.wait_for(trace_id, {"POST /v1/chat/completions", "broker request", "stage prefill",
                                             "stage decode", "prefill", "decode", "put shared_memory",
                                             "get shared_memory"})
    by_name = {}
    for span in spans:
        if span.name.startswith(("put ", "get ")):
            continue   # a hand-off may be more than one transfer; checked below
        assert span.name not in by_name, f"two {span.name!r} spans for one request without a resume"
        by_name[span.name] = span
    # The KV cache crosses the connector: prefill's put and decode's get, children of their worker spans.
    for op, role in (("put", "prefill"), ("get", "decode")):
        transfers = [s for s in spans if s.name == f"{op} shared_memory"]
        assert transfers and all(t.parent_id == by_name[role].span_id for t in transfers), (op, transfers)
        assert any(t.attributes["key"].startswith("kv/") for t in transfers)
        assert sum(t.attributes["bytes"] for t in transfers) > 0
        assert all(t.attributes["backend"] == "shared_memory" and not t.error for t in transfers)
    gateway, broker = by_name["POST /v1/chat/completions"], by_name["broker request"]
    # The tree: the client's span → gateway → broker → each stage → its worker.
    assert gateway.parent_id == client_span and gateway.service == "omni-gateway"
    assert broker.parent_id == gateway.span_id and broker.service == "omni-broker"
    for role in ("prefill", "decode"):
        stage, worker = by_name[f"stage {role}"], by_name[role]
        assert stage.parent_id == broker.span_id and stage.service == "omni-broker"
        assert stage.attributes["worker_id"] == f"{role}-t" and stage.attributes["queue_wait_s"] >= 0
        assert worker.parent_id == stage.span_id and worker.service == f"omni-worker-{role}"
        assert worker.attributes["worker_id"] == f"{role}-t"
        # Its engine steps: alone on the worker, every step that produced for it was a batch of one.
        assert worker.attributes["steps"] >= 1 and worker.attributes["batch_size_max"] == 1
        assert [name for name, _ in worker.events].count("first output") == 1
        assert stage.start_ns <= worker.start_ns <= worker.end_ns
        assert not stage.error and not worker.error
    # Decode is queued the moment prefill reports (the broker's clock for both). The broker's span
    # may end after the gateway's: decode pushes the last token to the gateway, then reports.
    assert by_name["stage prefill"].end_ns == by_name["stage decode"].start_ns
    assert gateway.start_ns <= broker.start_ns
    assert gateway.attributes["model"] == "tiny-llm" and gateway.attributes["outcome"] == "ok"
    assert gateway.attributes["completion_tokens"] == answer.usage.completion_tokens
    assert gateway.attributes["http.status_code"] == 200


@pytest.mark.slow
def test_a_stream_resumed_after_kill9_of_its_decode_worker_shows_in_its_trace(tiny_model, tmp_path, receiver,
                                                                             monkeypatch):
    """kill -9 of the decode worker mid-stream: the broker fails the submission as resumable, the
    gateway submits again from the tokens already sent, and the trace shows both submissions under
    the one gateway span: the first ended in error, the second resumed at a position > 0 and served
    by the surviving decode worker."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    trace_args = ("--otlp-traces-endpoint", receiver.url)
    with Cluster(model=tiny_model, log_dir=str(tmp_path)) as cluster:
        cluster.start_broker(*trace_args)
        cluster.start_worker("prefill", *trace_args)
        cluster.start_worker("decode", *trace_args, "--worker-id", "decode-a")
        cluster.start_worker("decode", *trace_args, "--worker-id", "decode-b")
        cluster.start_gateway(*trace_args)
        cluster.wait_healthy()
        cluster.wait_for_workers(3)
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        trace_id = os.urandom(16).hex()
        streamed, killed = [], None
        for chunk in client.completions.create(model="tiny-llm", prompt="Once upon a time", max_tokens=600,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True},
                                               extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}):
            streamed += [chunk.choices[0].text] if chunk.choices else []
            if killed is None and len(streamed) >= 8:
                busy = [w for w in cluster.workers() if w["role"] == "decode" and w["assigned"] > 0]
                assert len(busy) == 1, busy
                victim = busy[0]["worker_id"]
                killed = next(proc for proc in cluster.procs if proc.pid == busy[0]["pid"])
                killed.kill9()
        assert killed is not None and "resuming at position" in cluster.logs()
        survivor = "decode-b" if victim == "decode-a" else "decode-a"
        spans = receiver.wait_for(trace_id, {"POST /v1/completions": 1, "broker request": 2, "stage decode": 2,
                                             "decode": 1})
    (gateway,) = [s for s in spans if s.name == "POST /v1/completions"]
    assert gateway.attributes["resumes"] == 1 and gateway.attributes["outcome"] == "ok"
    first, second = sorted((s for s in spans if s.name == "broker request"), key=lambda s: s.start_ns)
    assert first.parent_id == second.parent_id == gateway.span_id
    # The first submission failed as resumable when its decode worker died …
    assert first.error and first.attributes["resumable"] is True
    assert first.attributes["error_type"] == "worker_lost"
    assert first.attributes["position_offset"] == 0
    lost = next(s for s in spans if s.name == "stage decode" and s.parent_id == first.span_id)
    assert lost.attributes["worker_id"] == victim
    # … and the second resumed from the tokens already sent, on the survivor.
    assert second.attributes["position_offset"] > 0 and not second.error
    resumed = next(s for s in spans if s.name == "stage decode" and s.parent_id == second.span_id)
    assert resumed.attributes["worker_id"] == survivor
    (worker,) = [s for s in spans if s.name == "decode"]   # the killed worker's span died with it
    assert worker.parent_id == resumed.span_id and worker.attributes["worker_id"] == survivor


@pytest.mark.slow
def test_spoken_answer_span_tree(tmp_path, receiver, monkeypatch):
    """Chat with an image in and speech out on the tiny Qwen2.5-Omni: encode → prefill → decode →
    generate, each a stage span under the broker's and each with its worker's span."""
    from omnirelay.deploy.builders.omni import build_tiny_omni
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    model = str(build_tiny_omni(tmp_path / "tiny-omni", seed=0))
    pipeline = os.path.join(REPO_ROOT, "deploy", "pipelines", "omni.yaml")
    trace_args = ("--otlp-traces-endpoint", receiver.url, "--stage-configs-path", pipeline)
    cluster = Cluster(model, str(tmp_path), model_name="tiny-omni")
    roles = ("encode", "prefill", "decode", "generate")
    try:
        cluster.start_broker("--otlp-traces-endpoint", receiver.url)
        for role in roles:
            cluster.start_worker(role, *trace_args)
        cluster.start_gateway(*trace_args)
        cluster.wait_healthy(timeout=180)
        png = io.BytesIO()
        Image.fromarray((np.random.RandomState(5).rand(64, 80, 3) * 255).astype("uint8")).save(png, "PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        trace_id = os.urandom(16).hex()
        answer = client.chat.completions.create(
            model="tiny-omni", messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]}],
            modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"}, max_tokens=8,
            extra_body={"max_audio_tokens": 16}, extra_headers={"traceparent": f"00-{trace_id}-{'c' * 16}-01"})
        assert answer.choices[0].message.audio.data
        spans = receiver.wait_for(trace_id, {"POST /v1/chat/completions", "broker request",
                                             *(f"stage {role}" for role in roles), *roles,
                                             "put shared_memory", "get shared_memory"})
    finally:
        cluster.stop()
    by_name = {span.name: span for span in spans if not span.name.startswith(("put ", "get "))}
    broker = by_name["broker request"]
    # The image's embeddings cross the connector: encode puts them, prefill gets them.
    for op, role in (("put", "encode"), ("get", "prefill")):
        assert any(s.name == f"{op} shared_memory" and s.parent_id == by_name[role].span_id
                   and s.attributes["key"].startswith("mm/") and s.attributes["bytes"] > 0 for s in spans), (op, role)
    assert broker.parent_id == by_name["POST /v1/chat/completions"].span_id
    assert broker.attributes["stages"] == list(roles)
    for role in roles:
        stage, worker = by_name[f"stage {role}"], by_name[role]
        assert stage.parent_id == broker.span_id and not stage.error, role
        assert worker.parent_id == stage.span_id and worker.service == f"omni-worker-{role}", role
    # The spoken answer's audio leaves the generate worker in chunks, each an event of its span.
    chunks = [attrs for name, attrs in by_name["generate"].events if name == "chunk"]
    assert chunks and chunks[-1]["finish"] is True and all(c["mime"].startswith("audio/") for c in chunks)
    # Each stage is queued when the one before it reports or streams its hand-off.
    for before, after in zip(roles, roles[1:]):
        assert by_name[f"stage {after}"].start_ns >= by_name[f"stage {before}"].start_ns
