"""Slow and stalled clients (slowloris): the gateway's header and read timeouts, over raw sockets.

A client that dribbles its request head byte by byte is closed ``--header-timeout`` after it
connected; one that sends a head and then its body byte by byte, or never, gets a structured 408
``--read-timeout`` after the head and its connection closed. Meanwhile normal clients are served,
and the stalled ones hold nothing that matters: the body is read before anything is submitted, so
no worker runs for them, the decode worker's KV pool stays at its idle count, and they take no
stream slot (the gateway allows one stream per client here, and the normal client — from the same
address — still gets it).
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
import urllib.parse

import aiohttp
import openai
import pytest

from cluster import Cluster, settled_workers
from omnirelay.gateway.config import GatewayConfig, ServedModel

HEADER_TIMEOUT_S, READ_TIMEOUT_S = 3.0, 4.0
SLACK_S = 1.5          # scheduling on a loaded 2-core machine; aiohttp's timers fire on time
DRIBBLE_EVERY_S = 0.2  # a byte every 200 ms: far faster than any timeout, so only a total deadline stops it

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gateway(tiny_model, tmp_path_factory):
    with Cluster(model=tiny_model, log_dir=str(tmp_path_factory.mktemp("slow-clients"))) as cluster:
        cluster.start_broker()
        cluster.start_worker("prefill")
        cluster.start_worker("decode", "--capacity", "8")
        cluster.start_gateway()   # default limits, for the load of clients that leave mid-stream
        cluster.open_url = cluster.url
        cluster.start_gateway("--header-timeout", str(HEADER_TIMEOUT_S), "--read-timeout", str(READ_TIMEOUT_S),
                              "--max-streams-per-client", "1")
        cluster.wait_healthy()
        cluster.idle_kv = _decode(cluster)["free_kv_blocks"]
        yield cluster


def _decode(cluster: Cluster, timeout: float = 30.0) -> dict:
    """The decode worker once every answered or cancelled request is counted in its figures (they
    travel in heartbeats: :func:`settled_workers` waits for the cluster to say they are final)."""
    return next(w for w in settled_workers(cluster.url, timeout) if w["role"] == "decode")


class SlowClient(threading.Thread):
    """A raw TCP client that sends ``head`` at once and then ``dribble`` one byte every
    ``DRIBBLE_EVERY_S`` (after that, nothing), reading whatever the server answers until it closes
    the connection. ``closed_after``: seconds from connect (``after_head``: from the end of the
    head) to the close; None if the server never closed it within ``give_up_s``."""

    def __init__(self, url: str, head: bytes, dribble: bytes = b"", give_up_s: float = 30.0):
        super().__init__(daemon=True)
        parts = urllib.parse.urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.head, self.dribble, self.give_up_s = head, dribble, give_up_s
        self.received = b""
        self.closed_after: float | None = None
        self.after_head: float | None = None
        self.answered_after: float | None = None   # from connect to the first byte of an answer
        self.connected = threading.Event()

    def run(self) -> None:
        with socket.create_connection(self.address, timeout=5) as sock:
            started = time.monotonic()
            self.connected.set()
            pending = self.dribble
            try:
                sock.sendall(self.head)
                head_sent = time.monotonic()
                while time.monotonic() - started < self.give_up_s:
                    if pending:
                        sock.sendall(pending[:1])
                        pending = pending[1:]
                    readable, _, _ = select.select([sock], [], [], DRIBBLE_EVERY_S)
                    if readable:
                        data = sock.recv(65536)
                        if not data:
                            break
                        if not self.received:
                            self.answered_after = time.monotonic() - started
                        self.received += data
                else:
                    return   # never closed
            except (ConnectionResetError, BrokenPipeError):
                pass   # closed while we were still sending: the same outcome
            self.closed_after = time.monotonic() - started
            self.after_head = time.monotonic() - head_sent

    def status(self) -> int | None:
        line = self.received.split(b"\r\n", 1)[0]
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None

    def body(self) -> dict:
        return json.loads(self.received.split(b"\r\n\r\n", 1)[1])


def _chat_body(content: str = "hello") -> bytes:
    return json.dumps({"model": "tiny-llm", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 8, "temperature": 0}).encode()


def _head(body_length: int, path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_length}\r\n\r\n").encode()


def _normal_stream(url: str) -> int:
    """A well-behaved streaming client: the number of tokens it was sent."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.chat.completions.create(model="tiny-llm", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    return [chunk.usage.completion_tokens for chunk in stream if chunk.usage][-1]


def _gateway_log(cluster: Cluster) -> str:
    return "".join(proc.output() for proc in cluster.procs if proc.name.endswith("gateway"))


def test_dribbled_headers_are_cut_off_while_others_are_served(gateway):
    """Ten connections each dribble a request head; all are closed at the header timeout (not
    before: they send a byte every 200 ms, so only the deadline from connect can stop them), and a
    normal client gets a full stream while they are open."""
    head = _head(len(_chat_body()))
    slow = [SlowClient(gateway.url, b"", dribble=head) for _ in range(10)]   # ~20 s of bytes, far past the timeout
    for client in slow:
        client.start()
    for client in slow:
        client.connected.wait(5)
    served_at = time.monotonic()
    assert _normal_stream(gateway.url) == 8
    served_in = time.monotonic() - served_at
    for client in slow:
        client.join(HEADER_TIMEOUT_S + 30)
    closed = [client.closed_after for client in slow]
    print(f"\ndribbled heads: normal stream served in {served_in:.2f}s; slow connections closed after "
          f"{min(closed):.2f}..{max(closed):.2f}s (header timeout {HEADER_TIMEOUT_S}s)")
    assert served_in < HEADER_TIMEOUT_S   # served while every slow connection was still open
    assert all(HEADER_TIMEOUT_S - 0.2 <= c <= HEADER_TIMEOUT_S + SLACK_S for c in closed), closed
    assert all(client.received == b"" for client in slow)   # no request was ever parsed, nothing answered


@pytest.mark.parametrize("dribble", [True, False], ids=["body-byte-by-byte", "body-never-sent"])
def test_stalled_body_gets_408_and_holds_no_kv_or_stream_slot(gateway, dribble):
    body = _chat_body()
    client = SlowClient(gateway.url, _head(len(body)), dribble=body[:-1] if dribble else b"")
    client.start()
    client.connected.wait(5)
    # While it stalls, the decode worker is idle (the last test's requests all counted) and the one
    # stream this client address may hold is free. Bounded well within the read timeout.
    decode = _decode(gateway, timeout=2)
    assert decode["running"] == 0 and decode["free_kv_blocks"] == gateway.idle_kv, decode
    assert _normal_stream(gateway.url) == 8
    assert client.closed_after is None, "cut off before the read timeout"
    client.join(READ_TIMEOUT_S + 30)
    print(f"\nstalled body ({'dribbled' if dribble else 'never sent'}): HTTP {client.status()} and closed "
          f"{client.after_head:.2f}s after the head (read timeout {READ_TIMEOUT_S}s)")
    assert READ_TIMEOUT_S - 0.2 <= client.after_head <= READ_TIMEOUT_S + SLACK_S, client.after_head
    assert client.status() == 408, client.received[:300]
    error = client.body()
    assert error["error"]["code"] == "request_timeout" and set(error["error"]) == {"message", "type", "param",
                                                                                    "code"}
    assert "request_id" in error and "stage" in error
    assert b"Connection: close" in client.received.split(b"\r\n\r\n", 1)[0]
    assert "Unhandled exception" not in _gateway_log(gateway)
    assert "internal error" not in _gateway_log(gateway)


def test_a_body_that_arrives_in_time_is_served(gateway):
    """The read timeout is a total for the body, not an idle timer — but a body slower than a fast
    client yet inside it is answered normally."""
    body = _chat_body()
    client = SlowClient(gateway.url, _head(len(body)) + body[:-8], dribble=body[-8:])   # the last 8 bytes: 1.6 s
    client.start()
    client.join(READ_TIMEOUT_S + 30)
    assert client.status() == 200, client.received[:300]
    answer = json.loads(client.received.split(b"\r\n\r\n", 1)[1])
    assert answer["usage"]["completion_tokens"] >= 1


def test_idle_after_a_response_is_cut_off_too(gateway):
    """Keep-alive: after a served request, the next head must also arrive within the header timeout."""
    body = _chat_body()
    client = SlowClient(gateway.url, _head(len(body)) + body)
    client.start()
    client.join(HEADER_TIMEOUT_S + 30)
    assert client.status() == 200
    idle = client.closed_after - client.answered_after
    assert HEADER_TIMEOUT_S - 0.2 <= idle <= HEADER_TIMEOUT_S + SLACK_S, idle


def test_clients_leaving_mid_stream_under_load_give_back_every_kv_block(gateway):
    """24 streaming clients at concurrency 8: two in three hang up after a few events of a long
    stream, the rest read theirs to the end. Every leaver's generation is cancelled upstream and the
    decode worker's free KV blocks return to their idle count; the others complete."""
    n, concurrency, leave_after = 24, 8, 3
    cancelled_before = _decode(gateway)["stats"].get("cancelled", 0)

    async def one(session: aiohttp.ClientSession, i: int) -> str:
        leaves = i % 3 != 2
        body = {"model": "tiny-llm", "messages": [{"role": "user", "content": f"Stream {i}, please."}],
                "max_tokens": 400 if leaves else 12, "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            async with asyncio.timeout(60):
                async with session.post(gateway.open_url + "/v1/chat/completions", json=body) as response:
                    if response.status != 200:
                        error = await response.json()
                        return "error" if "error" in error and "request_id" in error else "unstructured"
                    events = 0
                    async for line in response.content:
                        if not line.startswith(b"data: "):
                            continue
                        if line.strip() == b"data: [DONE]":
                            return "completed"
                        if b'"error"' in line:
                            return "error"
                        events += 1
                        if leaves and events == leave_after:
                            response.close()   # hang up mid-stream
                            return "left"
                    return "unstructured"      # the stream ended without [DONE]
        except TimeoutError:
            return "hung"

    async def run() -> list:
        results: list = [None] * n
        semaphore = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as session:
            async def worker(i: int) -> None:
                async with semaphore:
                    results[i] = await one(session, i)
            await asyncio.gather(*(worker(i) for i in range(n)))
        return results

    results = asyncio.run(run())
    counts = {key: results.count(key) for key in ("completed", "left", "error", "hung", "unstructured")}
    counts["lost"] = results.count(None)
    decode = _decode(gateway)   # settled: every hang-up's cancel reached decode and a heartbeat says so
    cancelled = decode["stats"].get("cancelled", 0) - cancelled_before
    print(f"\nclients leaving mid-stream: {counts}; {cancelled} generation(s) cancelled upstream; decode KV "
          f"{decode['free_kv_blocks']}/{gateway.idle_kv} free blocks")
    assert counts["hung"] == counts["lost"] == counts["unstructured"] == counts["error"] == 0, counts
    assert counts == {**counts, "completed": n // 3, "left": n - n // 3}
    assert decode["running"] == 0 and decode["free_kv_blocks"] == gateway.idle_kv, decode
    assert cancelled == counts["left"]   # stopped by the hang-ups, not by running to 400 tokens


def test_timeouts_must_be_positive(tiny_model):
    for field in ("header_timeout_s", "read_timeout_s"):
        with pytest.raises(ValueError, match=field):
            GatewayConfig(models=(ServedModel("m", tiny_model),), **{field: 0})
