"""``omni-serve`` as a newcomer runs it: starts, serves, and on Ctrl-C or SIGTERM stops every child
and leaves no process and no shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import time

import openai
import requests

from conftest import ServeProcess, pid_alive, shm_segments_of


def _one_chat(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0)
    return response.choices[0].message.content


def _assert_clean_exit(serve: ServeProcess, sig: int) -> None:
    children = set(serve.children)
    assert len(children) >= 4, "broker, gateway, prefill and decode run as child processes"
    assert serve.stop(timeout=60, sig=sig) == 0
    deadline = time.time() + 5
    while time.time() < deadline and any(pid_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if pid_alive(pid)], "a child outlived omni-serve"
    assert shm_segments_of(children | {serve.proc.pid}) == []


def test_default_model_serves_and_ctrl_c_cleans_up(tmp_path):
    env = {**os.environ, "OMNIRELAY_CACHE_DIR": str(tmp_path / "cache")}
    serve = ServeProcess(None, log_path=str(tmp_path / "serve.log"), env=env)
    try:
        assert _one_chat(serve.url, "tiny-llm") is not None
        assert (tmp_path / "cache").is_dir()
    finally:
        _assert_clean_exit(serve, signal.SIGINT)


def test_sigterm_mid_stream_cleans_up(tiny_model, tmp_path):
    serve = ServeProcess(tiny_model, log_path=str(tmp_path / "serve.log"))
    try:
        assert _one_chat(serve.url, tiny_model) is not None
        body = {"model": tiny_model, "messages": [{"role": "user", "content": "Go on forever."}],
                "max_tokens": 1800, "ignore_eos": True, "temperature": 0, "stream": True}
        with requests.post(serve.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            serve.proc.send_signal(signal.SIGTERM)
            started = time.time()
            # The stream must end (finished, errored or closed) rather than hang.
            try:
                for _ in lines:
                    pass
            except requests.RequestException:
                pass
            assert time.time() - started < 45
    finally:
        _assert_clean_exit(serve, signal.SIGTERM)
