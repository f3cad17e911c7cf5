"""A cluster of real daemons for tests: broker, workers and gateway as separate processes.

Unlike ``omni-serve``, each piece is started and killed by the test on its own, which is what
fault tests need (kill -9 a worker, restart the broker on the same endpoint). Every process runs in
its own session, logs to a file under the test's directory, and is stopped by PID.

The fault tests share one way to judge a fault: :func:`run_load` sends a bounded load through the
``openai`` client and fires the fault mid-way, :func:`classify` counts each request as completed
(same output as the fault-free run), structured error, wrong, hung, unstructured or lost, and
:func:`assert_contract` holds them to 0 hung, 0 lost, 0 wrong, 0 unstructured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import openai
import requests

from omnirelay.connectors.shared_memory import sweep_orphans


def free_tcp_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class Proc:
    """``python -m ARGV`` as its own session, output to ``LOG_DIR/NAME.log``. ``prefix`` goes before
    the interpreter (``["ip", "netns", "exec", NS]`` runs it in a network namespace: ``ip`` execs
    the command, so ``pid`` is still the daemon's)."""

    def __init__(self, name: str, argv: list[str], log_dir: str, prefix: list[str] | None = None):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", *argv], stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.alive():
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            code = self.proc.wait(10)
        self._log.close()
        return code

    def output(self) -> str:
        with open(self.log_path) as handle:
            return handle.read()


def pause_process(pid: int, seconds: float) -> None:
    """Stop ``pid`` (SIGSTOP) for ``seconds``, then let it go on (SIGCONT, whatever happened meanwhile):
    the pause is the fault itself, longer than the broker's liveness when a test wants it to look dead."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def settled_workers(url: str, timeout: float = 30.0) -> list[dict]:
    """The workers of the gateway at ``url`` (its ``/cluster`` view) once every answered request is
    counted in their stats. Those travel in heartbeats; the cluster says when they are final
    (``settled``: no request in flight, and each worker's last heartbeat counts every stage report
    the broker has from it), and a worker heartbeats right after going idle, so this asks the
    cluster until it says so — no sleeping across heartbeats."""
    deadline = time.monotonic() + timeout
    while True:
        view = requests.get(url + "/cluster", timeout=10).json()
        if view["settled"]:
            return view["workers"]
        assert time.monotonic() < deadline, f"the cluster did not settle: {view}"
        time.sleep(0.02)   # a settling worker is one message away


class Cluster:
    def __init__(self, model: str, log_dir: str, broker: str | None = None, model_name: str = "tiny-llm",
                 curve: dict | None = None):
        """``curve``: {"dir": keygen dir} → every process uses CURVE with the keys written there."""
        self.model = model
        self.model_name = model_name
        self.log_dir = log_dir
        self.broker_endpoint = broker or free_tcp_endpoint()
        self.curve = curve
        self.procs: list[Proc] = []
        self.url: str | None = None
        self._counter = 0

    def _curve_args(self, name: str, server: bool, client: bool) -> list[str]:
        if not self.curve:
            return []
        root = self.curve["dir"]
        args = ["--curve-secret-key", os.path.join(root, f"{name}.key_secret")]
        if client:
            args += ["--curve-server-key", os.path.join(root, "broker.key")]
        if server:
            args += ["--curve-authorized-keys", os.path.join(root, "authorized")]
        return args

    def _start(self, name: str, argv: list[str]) -> Proc:
        self._counter += 1
        proc = Proc(f"{self._counter:02d}-{name}", argv, self.log_dir)
        self.procs.append(proc)
        return proc

    def start_broker(self, *extra: str) -> Proc:
        return self._start("broker", ["omnirelay.broker.daemon", "--endpoint", self.broker_endpoint,
                                      "--log-level", "INFO", *self._curve_args("broker", True, False), *extra])

    def start_worker(self, role: str, *extra: str) -> Proc:
        return self._start(role, ["omnirelay.workers.daemon", "--role", role, "--model", self.model,
                                  "--served-model-name", self.model_name, "--broker", self.broker_endpoint,
                                  "--log-level", "INFO", *self._curve_args("worker", False, True), *extra])

    def start_gateway(self, *extra: str) -> Proc:
        ready = os.path.join(self.log_dir, f"gateway-{self._counter + 1}.url")
        proc = self._start("gateway", ["omnirelay.gateway.daemon", "--model", self.model, "--served-model-name",
                                       self.model_name, "--broker", self.broker_endpoint, "--port", "0",
                                       "--ready-file", ready, "--log-level", "INFO",
                                       *self._curve_args("gateway", True, True), *extra])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.alive():
            if os.path.exists(ready):
                with open(ready) as handle:
                    self.url = handle.read().strip()
                return proc
            time.sleep(0.1)
        raise RuntimeError(f"gateway did not start:\n{proc.output()[-3000:]}")

    def start_llm(self, *, broker: tuple[str, ...] = (), prefill: tuple[str, ...] = (),
                  decode: tuple[str, ...] = (), gateway: tuple[str, ...] = ()) -> tuple[Proc, Proc]:
        """The usual text cluster: a broker, one prefill and one decode worker and a gateway, each
        with its extra flags; returns (prefill, decode) once the gateway reports healthy."""
        self.start_broker(*broker)
        workers = self.start_worker("prefill", *prefill), self.start_worker("decode", *decode)
        self.start_gateway(*gateway)
        self.wait_healthy()
        return workers

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError("cluster not healthy:\n" + "\n".join(p.output()[-1500:] for p in self.procs))

    def wait_for_workers(self, n: int, timeout: float = 60.0) -> None:
        """Until ``n`` workers are registered (healthy needs only one per role) or ``timeout``
        passes; what is then missing is for the test's own assertions to say."""
        deadline = time.monotonic() + timeout
        while len(self.workers()) < n and time.monotonic() < deadline:
            time.sleep(0.2)

    def workers(self) -> list[dict]:
        return requests.get(self.url + "/cluster", timeout=10).json()["workers"]

    def broker_counters(self) -> dict:
        return requests.get(self.url + "/cluster", timeout=10).json()["broker"]

    def logs(self) -> str:
        """Every process's output so far, in start order."""
        return "".join(proc.output() for proc in self.procs)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
        killed = {proc.pid for proc in reversed(self.procs) if proc.stop(timeout=30) == -signal.SIGKILL}
        # A daemon that did not drain within 30 s (a starved host) was killed: its segments are what a
        # kill leaves, not a leak of a clean exit; only those PIDs' are swept.
        if killed:
            sweep_orphans(owners=killed)


@contextlib.contextmanager
def prefill_pair_cluster(model: str, log_dir: str, **kwargs) -> Iterator[Cluster]:
    """Broker, prefill workers ``prefill-a`` and ``prefill-b``, one decode worker and the gateway, once
    both prefill workers have registered (the prefix-routing set-up); every process stopped on exit.
    ``kwargs`` go to :class:`Cluster`."""
    with Cluster(model=model, log_dir=log_dir, **kwargs) as cluster:
        cluster.start_broker()
        cluster.start_worker("prefill", "--worker-id", "prefill-a")
        cluster.start_worker("prefill", "--worker-id", "prefill-b")
        cluster.start_worker("decode")
        cluster.start_gateway()
        cluster.wait_healthy()
        deadline = time.monotonic() + 120
        while sum(w["role"] == "prefill" for w in cluster.workers()) < 2:
            assert time.monotonic() < deadline, "two prefill workers never registered"
            time.sleep(0.2)
        yield cluster


# ---------------------------------------------------------------------- a bounded load with a fault

Result = tuple[str, object]   # ("completed", output) or (outcome, why) with outcome "hung", "error", "unstructured"


def is_structured_error(body: object) -> bool:
    """The gateway's error contract: ``{"error": {message, type, param, code}, "request_id", "stage"}``."""
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and {"message", "type", "param", "code"} <= set(body["error"]) and "request_id" in body
            and "stage" in body)


async def _attempt(client: openai.AsyncOpenAI, request: Callable[[openai.AsyncOpenAI, int], Awaitable[object]],
                   i: int, timeout_s: float) -> Result:
    try:
        return "completed", await asyncio.wait_for(request(client, i), timeout_s)
    except asyncio.TimeoutError:
        return "hung", "no answer in time"
    except openai.APIStatusError as exc:
        # exc.body is only the inner "error" map (the client unwraps it); the contract is about the whole body.
        try:
            body = exc.response.json()
        except ValueError:
            body = None
        outcome = "error" if is_structured_error(body) else "unstructured"
        return outcome, f"{exc.status_code} {body or exc.response.text[:200]}"


async def run_load(url: str, request: Callable[[openai.AsyncOpenAI, int], Awaitable[object]], n: int, *,
                   concurrency: int, timeout_s: float, fault: Callable[[], None] | None = None,
                   after: int = 0) -> list[Result | None]:
    """Requests ``0..n-1`` (``await request(client, i)`` returns what a completed one is compared
    by), ``concurrency`` at a time, each given ``timeout_s`` to answer; ``fault()`` runs in a thread
    once ``after`` of them have answered, while the rest of the load goes on."""
    results: list[Result | None] = [None] * n
    done = 0
    fired = asyncio.Event()
    semaphore = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=timeout_s + 5) as client:
        async def one(i: int) -> None:
            nonlocal done
            async with semaphore:
                results[i] = await _attempt(client, request, i, timeout_s)
            done += 1
            if fault is not None and done >= after and not fired.is_set():
                fired.set()
                await asyncio.to_thread(fault)

        await asyncio.gather(*(one(i) for i in range(n)))
    return results


def classify(results: list[Result | None], reference: list) -> dict[str, int]:
    """Counts per outcome; a completed request whose output differs from ``reference`` is "wrong"."""
    counts = {"completed": 0, "error": 0, "wrong": 0, "hung": 0, "unstructured": 0, "lost": 0}
    for result, expected in zip(results, reference):
        if result is None:
            counts["lost"] += 1
        elif result[0] == "completed":
            counts["completed" if result[1] == expected else "wrong"] += 1
        else:
            counts[result[0]] += 1
    return counts


def assert_contract(counts: dict[str, int], results: list[Result | None]) -> None:
    """Every request completed with the reference output or failed with a structured error."""
    assert counts["hung"] == 0 and counts["lost"] == 0 and counts["unstructured"] == 0, (counts, results)
    assert counts["wrong"] == 0, counts
    assert counts["completed"] + counts["error"] == len(results), counts


TOPICS = ["the sea", "a cat", "rain", "trains", "bread", "the moon", "music", "winter"]


async def greedy_chat(client: openai.AsyncOpenAI, i: int, *, max_tokens: int) -> list[int]:
    """Request ``i`` of a tiny-llm load: greedy, a fixed length, compared by its token ids."""
    response = await client.chat.completions.create(
        model="tiny-llm", messages=[{"role": "user", "content": f"Request {i}: say something about "
                                                                f"{TOPICS[i % len(TOPICS)]}."}],
        temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True, "return_token_ids": True})
    return response.choices[0].model_extra["token_ids"]
