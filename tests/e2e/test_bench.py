"""``omni-bench``: the maths and the SSE parser on canned input, a fake server for the odd cases
(no usage, awkward chunking, errors), then the real command against a real ``omni-serve``.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from omnirelay.bench import metrics
from omnirelay.bench.client import RequestResult, StreamAccount, StreamError, Target
from omnirelay.bench.datasets import Prompt, Tokenizer, file_prompts, random_prompts
from omnirelay.bench.progress import ProgressBar
from omnirelay.bench.runner import RunConfig, benchmark
from omnirelay.bench.sse import SSEEvent, SSEParser

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- maths


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for size in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 100) for _ in range(size)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert metrics.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert metrics.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    with pytest.raises(ValueError):
        metrics.percentile([], 50)
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_parse_goodput():
    assert metrics.parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == {"ttft": 500, "tpot": 50.5,
                                                                             "e2el": 2000}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:0"], ["ttft:-1"], ["ttft:1", "ttft:2"], ["tpot:inf"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad)


def _ok(ttft: float, latency: float, tokens: int, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(True, prompt_len=10, output_tokens=tokens, usage_reported=True, ttft=ttft,
                         latency=latency, itl=itl or [])


def test_summary_throughput_tpot_and_goodput():
    results = [
        _ok(0.100, 1.000, 10, [0.1] * 9),      # tpot 0.1
        _ok(0.200, 0.650, 10, [0.05] * 9),     # tpot 0.05
        _ok(0.900, 1.350, 10, [0.05] * 9),     # tpot 0.05, ttft over the SLO
        _ok(0.050, 0.050, 1),                  # one token: no tpot, no itl
        RequestResult(False, error="HTTP 503: overloaded (overloaded)"),
        RequestResult(False, error="HTTP 503: overloaded (overloaded)"),
        RequestResult(False, error="timeout (see --timeout)"),
    ]
    s = metrics.summarize(results, duration=2.0, slo={"ttft": 500, "tpot": 60})
    assert (s["num_prompts"], s["completed"], s["failed"]) == (7, 4, 3)
    assert s["total_output_tokens"] == 31 and s["total_input_tokens"] == 40
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == 15.5
    assert s["total_token_throughput"] == 35.5
    assert s["tpots"] == pytest.approx([0.1, 0.05, 0.05])
    assert s["mean_tpot_ms"] == pytest.approx(200 / 3)
    assert s["median_ttft_ms"] == pytest.approx(150.0)
    assert s["p99_ttft_ms"] == pytest.approx(float(np.percentile([100, 200, 900, 50], 99)))
    assert s["std_e2el_ms"] == pytest.approx(float(np.std([1000, 650, 1350, 50])))
    assert s["mean_itl_ms"] == pytest.approx((0.1 * 9 + 0.05 * 18) / 27 * 1000)
    # good: #2 (ttft 200, tpot 50) and #4 (ttft 50, no tpot); #1 tpot 100 > 60; #3 ttft 900 > 500
    assert s["good_requests"] == 2 and s["request_goodput"] == 1.0
    assert s["errors"] == [{"error": "HTTP 503: overloaded (overloaded)", "count": 2},
                           {"error": "timeout (see --timeout)", "count": 1}]
    empty = metrics.summarize([RequestResult(False, error="x")], duration=1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None
    assert "request_goodput" not in empty


# ---------------------------------------------------------------------- SSE parser

CANNED = ("\ufeffdata: {\"a\": \"caf\u00e9 \U0001F600\"}\r\n\r\n"
          ": a comment line\n"
          "event: update\ndata: line one\ndata:line two\n\n"
          "data: cr only\r\rid: 7\nretry: 10\ndata\n\n"
          "data: [DONE]\n\n"
          "data: incomplete, never closed\n").encode()
EXPECTED = [SSEEvent('{"a": "caf\u00e9 \U0001F600"}'), SSEEvent("line one\nline two", "update"),
            SSEEvent("cr only"), SSEEvent(""), SSEEvent("[DONE]")]


def _parse(pieces: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    return [event for piece in pieces for event in parser.feed(piece)]


def test_sse_whole_and_split_at_every_position():
    assert _parse([CANNED]) == EXPECTED
    for cut in range(len(CANNED) + 1):
        assert _parse([CANNED[:cut], CANNED[cut:]]) == EXPECTED, cut


def test_sse_byte_by_byte_and_random_cuts():
    assert _parse([CANNED[i:i + 1] for i in range(len(CANNED))]) == EXPECTED
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(CANNED)), 4))
        bounds = [0, *cuts, len(CANNED)]
        assert _parse([CANNED[a:b] for a, b in zip(bounds, bounds[1:])] + [b""]) == EXPECTED


def test_sse_crlf_split_between_cr_and_lf_is_one_line_end():
    # "\r" ends one chunk, "\n" starts the next: one line end, so no empty line (no extra dispatch)
    assert _parse([b"data: x\r", b"\ndata: y\r", b"\n\r", b"\n"]) == [SSEEvent("x\ny")]


# ---------------------------------------------------------------------- stream accounting


def test_stream_account_chat_usage_and_errors():
    account = StreamAccount(start=10.0, chat=True)
    chunk = {"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": None}
    account.on_event(json.dumps(chunk), 10.5)                      # role only: not the first token
    for t, text in ((11.0, "Hel"), (11.25, "lo"), (11.75, "!")):
        account.on_event(json.dumps({"choices": [{"delta": {"content": text}}]}), t)
    account.on_event(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}), 12.0)
    account.on_event("[DONE]", 12.0)
    result = account.result(eof=13.0, prompt_len=None)
    assert result.success and result.usage_reported
    assert result.ttft == 1.0 and result.latency == 2.0 and result.itl == [0.25, 0.5]
    assert result.output_tokens == 4 and result.prompt_len == 5
    with pytest.raises(StreamError, match="boom"):
        StreamAccount(0.0, chat=False).on_event('{"error": {"message": "boom", "code": "worker_dead"}}', 1.0)
    with pytest.raises(StreamError, match="malformed"):
        StreamAccount(0.0, chat=False).on_event("{not json", 1.0)
    assert not StreamAccount(0.0, chat=False).result(eof=1.0, prompt_len=3).success


def test_progress_bar_draws_only_when_enabled():
    out = io.StringIO()
    bar = ProgressBar(4, "c=2 ", enabled=True, stream=out)
    for ok in (True, False, True, True):
        bar.update(ok)
    bar.close()
    assert "4/4" in out.getvalue() and "1 failed" in out.getvalue() and out.getvalue().endswith("\n")
    silent = io.StringIO()
    bar = ProgressBar(4, enabled=False, stream=silent)
    bar.update()
    bar.close()
    assert silent.getvalue() == ""


# ---------------------------------------------------------------------- datasets


def test_datasets(tiny_model, tmp_path):
    tokenizer = Tokenizer.from_dir(tiny_model)
    prompts = random_prompts(8, 48, 5, tokenizer, seed=3)
    assert [p.prompt_len for p in prompts] == [48] * 8
    assert all(len(tokenizer.encode(p.text)) == 48 for p in prompts)
    assert prompts == random_prompts(8, 48, 5, tokenizer, seed=3) != random_prompts(8, 48, 5, tokenizer, seed=4)
    words = random_prompts(3, 12, 5, None)
    assert all(len(p.text.split()) == 12 and p.prompt_len is None for p in words)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Hello there", "output_len": 3},
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Why?"},
                           {"from": "gpt", "value": "Because."}]},
        {"unrelated": 1},
        {"conversations": [{"role": "user", "content": "Chat style"}]},
    ]) + "\n")
    loaded = file_prompts(str(path), 5, 7, None)
    assert [(p.text, p.output_len) for p in loaded] == [("Hello there", 3), ("Why?", 7), ("Chat style", 7),
                                                        ("Hello there", 3), ("Why?", 7)]


# ---------------------------------------------------------------------- against a fake server


async def _fake_server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def _no_usage_awkward_chunks(request: web.Request) -> web.StreamResponse:
    """Ignores include_usage; sends 5 tokens in byte pieces cut mid-line, mid-UTF-8 and mid-CRLF."""
    body = await request.json()
    if body["prompt"] == "fail me":
        return web.json_response({"error": {"message": "no capacity", "code": "overloaded"}}, status=503)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    stream = b"".join(b"data: " + json.dumps({"choices": [{"text": t}]}, ensure_ascii=False).encode() + b"\r\n\r\n"
                      for t in ("\u00e9", "b", "\U0001F600", "d", "e")) + b"data: [DONE]\r\n\r\n"
    for start in range(0, len(stream), 7):
        await response.write(stream[start:start + 7])
        await asyncio.sleep(0.002)
    await response.write_eof()
    return response


def test_fake_server_counts_chunks_and_summarises_errors():
    async def scenario():
        runner, url = await _fake_server(_no_usage_awkward_chunks)
        try:
            prompts = [Prompt("fail me" if i % 4 == 3 else f"p{i}", None, 5) for i in range(8)]
            config = RunConfig(Target(url + "/v1/completions", "fake", "completions"), concurrencies=(2, 8),
                               request_rate=math.inf, num_warmups=1, timeout_s=10, progress=False)
            return await benchmark(config, prompts)
        finally:
            await runner.cleanup()

    runs = asyncio.run(scenario())
    assert [run["max_concurrency"] for run in runs] == [2, 8]
    for run in runs:
        assert (run["completed"], run["failed"]) == (6, 2)
        assert run["output_tokens_from_usage"] == 0 and run["output_lens"] == [5] * 6
        assert run["total_output_tokens"] == 30 and all(len(gaps) == 4 for gaps in run["itls"])
        assert run["errors"] == [{"error": "HTTP 503: no capacity (overloaded)", "count": 2}]
        assert all(t <= e for t, e in zip(run["ttfts"], run["e2els"]))


# ---------------------------------------------------------------------- against omni-serve


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnirelay.bench.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _assert_png(path) -> None:
    with open(path, "rb") as handle:
        assert handle.read(8) == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 300 and image.size[1] > 300


def _assert_consistent(run: dict, prompts: int) -> None:
    assert run["completed"] == prompts and run["failed"] == 0 and run["errors"] == []
    assert len(run["ttfts"]) == len(run["e2els"]) == prompts
    assert all(0 < t <= e for t, e in zip(run["ttfts"], run["e2els"]))
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert run[f"p50_{name}_ms"] <= run[f"p90_{name}_ms"] <= run[f"p99_{name}_ms"]
    assert run["p99_ttft_ms"] <= run["p99_e2el_ms"]
    assert run["request_throughput"] > 0 and run["output_throughput"] > 0


def test_random_completions_against_omni_serve(server, tiny_model, tmp_path):
    result_file, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    done = _bench("--base-url", server.url, "--tokenizer", tiny_model, "--random-input-len", "32",
                  "--output-len", "16", "--num-prompts", "16", "--max-concurrency", "4", "--ignore-eos",
                  "--temperature", "0", "--num-warmups", "2", "--goodput", "ttft:60000", "tpot:60000",
                  "--result-file", str(result_file), "--plot-dir", str(plot_dir))
    assert done.returncode == 0, done.stderr
    assert "Output token throughput" in done.stdout
    run = json.loads(result_file.read_text())
    assert run["model"] == "tiny-llm" and run["max_concurrency"] == 4 and run["endpoint_type"] == "completions"
    _assert_consistent(run, 16)
    assert run["total_output_tokens"] == 16 * 16 and run["output_lens"] == [16] * 16
    assert run["output_tokens_from_usage"] == 16                  # omni-serve honours include_usage
    assert run["total_input_tokens"] == 16 * 32 and run["input_lens"] == [32] * 16
    assert run["good_requests"] == 16 and run["request_goodput"] == pytest.approx(run["request_throughput"])
    _assert_png(plot_dir / "latency_cdf.png")


def test_chat_file_dataset_poisson(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Tell me about the sea."},
        {"conversations": [{"from": "human", "value": "Count to five."}, {"from": "gpt", "value": "1 2 3"}]},
    ]) + "\n")
    result_file = tmp_path / "result.json"
    done = _bench("--base-url", server.url, "--endpoint-type", "chat", "--dataset-name", "file",
                  "--dataset-path", str(data), "--output-len", "8", "--num-prompts", "8", "--request-rate", "40",
                  "--seed", "1", "--no-progress", "--result-file", str(result_file))
    assert done.returncode == 0, done.stderr
    run = json.loads(result_file.read_text())
    _assert_consistent(run, 8)
    assert run["request_rate"] == 40 and run["max_concurrency"] is None
    assert all(1 <= n <= 8 for n in run["output_lens"]) and run["output_tokens_from_usage"] == 8
    assert all(n > 0 for n in run["input_lens"])                  # from the server's usage (no tokenizer)


def test_sweep_writes_throughput_plot(server, tiny_model, tmp_path):
    result_file, plot_dir = tmp_path / "sweep.json", tmp_path / "plots"
    done = _bench("--base-url", server.url, "--model", "tiny-llm", "--tokenizer", tiny_model,
                  "--random-input-len", "16", "--output-len", "8", "--num-prompts", "8", "--ignore-eos",
                  "--sweep-concurrency", "1,2,4", "--result-file", str(result_file), "--plot-dir", str(plot_dir))
    assert done.returncode == 0, done.stderr
    result = json.loads(result_file.read_text())
    assert [run["max_concurrency"] for run in result["runs"]] == [1, 2, 4]
    for run in result["runs"]:
        _assert_consistent(run, 8)
        assert run["total_output_tokens"] == 64
    _assert_png(plot_dir / "latency_cdf.png")
    _assert_png(plot_dir / "throughput_vs_concurrency.png")


def test_failed_requests_are_counted_and_summarised(server, tmp_path):
    result_file = tmp_path / "result.json"
    done = _bench("--base-url", server.url, "--model", "no-such-model", "--num-prompts", "4", "--output-len", "4",
                  "--random-input-len", "8", "--max-concurrency", "2", "--result-file", str(result_file))
    assert done.returncode == 1
    run = json.loads(result_file.read_text())
    assert (run["completed"], run["failed"]) == (0, 4)
    assert len(run["errors"]) == 1 and run["errors"][0]["count"] == 4
    assert run["errors"][0]["error"].startswith("HTTP 404:") and "no-such-model" in run["errors"][0]["error"]
    assert "Errors" in done.stdout
    bad = _bench("--base-url", server.url, "--goodput", "latency:5")
    assert bad.returncode == 2 and "goodput" in bad.stderr


def test_spoken_answers_are_timed_as_audio_ttfp_and_audio_rtf():
    """A chat stream's ``delta.audio`` (transcript first, then a WAV streamed header + PCM) and the
    speech endpoint's ``speech.audio.delta`` events: first audio, and time over seconds of audio."""
    import base64

    from omnirelay.bench.client import StreamAccount
    from omnirelay.bench.metrics import summarize

    second = b"\0" * 48000   # one second of 24 kHz 16-bit mono
    chat = StreamAccount(0.0, chat=True)
    chat.on_event(json.dumps({"choices": [{"delta": {"audio": {"id": "a", "transcript": "hi"}}}]}), 0.1)
    chat.on_event(json.dumps({"choices": [{"delta": {"audio": {"id": "a", "data": base64.b64encode(
        b"RIFF" + b"\0" * 40 + second).decode()}}}]}), 0.4)
    chat.on_event(json.dumps({"choices": [{"delta": {"audio": {"id": "a", "data": base64.b64encode(second).decode()}}}]}),
                  1.0)
    chat.on_event("[DONE]", 1.1)
    spoken = chat.result(1.2, 5)
    assert spoken.ttft == pytest.approx(0.1) and spoken.audio_ttfp == pytest.approx(0.4)
    assert spoken.audio_rtf == pytest.approx(1.0 / 2.0)
    speech = StreamAccount(0.0, chat=False, speech=True)
    speech.on_event(json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(second).decode()}), 0.25)
    speech.on_event(json.dumps({"type": "speech.audio.done", "usage": {"input_tokens": 7, "output_tokens": 12}}),
                    0.5)
    said = speech.result(0.6, None)
    assert said.audio_ttfp == pytest.approx(0.25) and said.ttft == pytest.approx(0.25)
    assert said.output_tokens == 12 and said.prompt_len == 7 and said.audio_rtf == pytest.approx(0.25)
    summary = summarize([spoken, said], 1.0)
    assert summary["median_audio_ttfp_ms"] == pytest.approx(325.0) and summary["audio_rtfs"] == [0.5, 0.25]
    text_only = StreamAccount(0.0, chat=True)
    text_only.on_event(json.dumps({"choices": [{"delta": {"content": "x"}}]}), 0.1)
    assert text_only.result(0.2, 1).audio_ttfp is None
    assert summarize([text_only.result(0.2, 1)], 1.0)["median_audio_ttfp_ms"] is None
