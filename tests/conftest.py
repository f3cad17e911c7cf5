"""Shared fixtures: the tiny model (built once per session) and a real ``omni-serve`` process.

Everything runs for real: the server is the console script as a user starts it, in its own
process group, on a free port of 127.0.0.1; the fixture stops it by PID with SIGTERM and checks it
left nothing behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from omnirelay.deploy.builders.llm import build_tiny_llm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-llm"
    build_tiny_llm(path, seed=0)
    return str(path)


def child_pids(pid: int) -> set[int]:
    """All descendants of ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServeProcess:
    """A running ``omni-serve``; ``url`` is the gateway's base URL."""

    def __init__(self, model: str | None, *extra: str, log_path: str, timeout: float = 180.0,
                 env: dict | None = None):
        # Output goes to a file, not a pipe: a pipe nobody drains would block the server once full.
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnirelay.deploy.serve", *([model] if model else []), "--port", "0", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.url = self._wait_ready(timeout)
        self.children = child_pids(self.proc.pid)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def output(self) -> str:
        with open(self.log_path) as handle:
            return handle.read()

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            match = re.search(r"omni-serve ready: (http://\S+)", self.output())
            if match:
                return match.group(1)
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("omni-serve did not become ready:\n" + self.output()[-4000:])

    def stop(self, timeout: float = 60.0, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(10)
        self._log.close()
        return code


def shm_segments_of(pids: set[int]) -> list[str]:
    return [name for name in os.listdir("/dev/shm")
            if name.startswith("omnirelay-") and name.split("-")[1].isdigit() and int(name.split("-")[1]) in pids]


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("serve") / "omni-serve.log")
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--log-level", "WARNING", log_path=log_path)
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official ``openai`` client on the session's omni-serve (a module may define its own ``client``)."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _leaks() -> list[str]:
    """Processes this test session started and left running, shared-memory segments whose owner
    is gone (a clean shutdown removes them; only a crash may leave them, and we crash on purpose
    only in tests that sweep afterwards), and keys left in a test's redis-server when it stopped
    (recorded by ``connector_servers.RedisServer``, imported only if some test used it)."""
    leaks = [f"process {pid} ({open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' ')[:120]})"
             for pid in sorted(child_pids(os.getpid())) if pid_alive(pid)]
    servers = sys.modules.get("connector_servers")
    for label, keys in (servers.LEFTOVER_REDIS_KEYS.items() if servers else ()):
        leaks.append(f"{label}: {len(keys)} key(s) left: {', '.join(keys[:5])}{' …' if len(keys) > 5 else ''}")
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith("omnirelay-") and len(parts) > 2 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            leaks.append(f"/dev/shm/{name}")
    return leaks


# Leaks the pytest-xdist workers reported (``-n``), for the controlling process to fail the run on.
_WORKER_LEAKS: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    """After the whole suite: no process, no segment, no Redis key left behind. Under pytest-xdist
    each worker checks what it started and hands its findings to the controller
    (``workeroutput``), which fails the run: a worker's own exit status is not the run's."""
    deadline = time.monotonic() + 10
    leaks = _leaks()
    while leaks and time.monotonic() < deadline:
        time.sleep(0.5)
        leaks = _leaks()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["leaks"] = leaks
        return
    leaks += _WORKER_LEAKS
    if leaks:
        print("\nLEAKED after the test session:\n  " + "\n  ".join(leaks))
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker finished; keep what it found left behind."""
    leaks = getattr(node, "workeroutput", {}).get("leaks", [])
    _WORKER_LEAKS.extend(f"{node.gateway.id}: {leak}" for leak in leaks)


_HF_MODELS: dict[str, tuple] = {}


def hf_chat_greedy(path: str, messages: list[dict] | str, max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate()`` on a chat prompt: the reference every parity test compares
    against (model and tokenizer loaded once per directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path not in _HF_MODELS:
        torch.set_num_threads(1)
        _HF_MODELS[path] = (AutoTokenizer.from_pretrained(path),
                            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    tokenizer, model = _HF_MODELS[path]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="session")
def reference(tiny_model):
    """``reference(content, n)``: transformers' greedy tokens for a one-message chat on the tiny model."""
    return lambda content, max_new_tokens: hf_chat_greedy(tiny_model, content, max_new_tokens)


@pytest.fixture
def shm_dir():
    """A fresh directory under /dev/shm for a shared-memory connector; the test must leave it empty."""
    path = f"/dev/shm/ortest-{uuid.uuid4().hex}"
    os.mkdir(path)
    yield path
    left = sorted(os.listdir(path))
    shutil.rmtree(path, ignore_errors=True)
    assert left == [], f"test left files in its shm dir: {left}"
