"""One streaming request to an OpenAI-compatible endpoint, timed chunk by chunk.

The life of a request: the clock starts just before the POST; a non-200 answer fails it with a
summary of its body; otherwise the body is fed, as the bytes arrive, to :class:`~.sse.SSEParser`
and each event to :class:`StreamAccount`, which keeps the timings:

* TTFT: from the POST to the first chunk that carries generated text (a chat ``role``-only chunk
  does not count);
* ITL: the gap between consecutive text-carrying chunks (per chunk, as ``vllm bench serve``);
* E2E: from the POST to the last event of the stream (``[DONE]`` or the usage chunk);
* TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, computed in :mod:`.metrics`;
* audio, for a spoken answer (chat ``delta.audio.data``; ``/v1/audio/speech`` with ``stream_format:
  "sse"``, endpoint type ``speech``): ``audio_ttfp``, from the POST to the first audio chunk, and
  ``audio_rtf``, the time to the last audio chunk over the seconds of audio received (16-bit mono
  PCM at ``audio_sample_rate``; a streamed WAV's 44-byte header is not audio) — vLLM-Omni's names.
  A chat answer's text may come as ``delta.audio.transcript``: it counts as text.

Output tokens come from the final ``usage`` chunk when the server honours
``stream_options.include_usage``, else they are the number of text-carrying chunks. An ``error``
object inside the stream, a malformed event, a stream without any text, a network error or the
``timeout`` fail the request; the error text is kept (shortened) for the summary.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time

import aiohttp

from .datasets import Prompt
from .sse import SSEError, SSEParser

ERROR_TEXT_LIMIT = 300
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "speech": "/v1/audio/speech"}
WAV_HEADER_BYTES = 44


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how to send: the full endpoint URL, the model id, the request shape."""

    url: str
    model: str
    endpoint_type: str                  # "completions" | "chat"
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict = dataclasses.field(default_factory=dict, hash=False)   # merged into every request body
    audio_sample_rate: int = 24000      # of a spoken answer's PCM, for audio_rtf
    voice: str = ""                     # speech: the voice (chat: put "audio" in extra_body)

    def __post_init__(self):
        if self.endpoint_type not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint_type must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint_type!r}")

    def payload(self, prompt: Prompt) -> dict:
        body: dict = {"model": self.model, "max_tokens": prompt.output_len, "temperature": self.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint_type == "speech":
            body = {"model": self.model, "input": prompt.text, "stream_format": "sse", "response_format": "pcm",
                    **({"voice": self.voice} if self.voice else {})}
            return {**body, **self.extra_body}
        if self.endpoint_type == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        if self.ignore_eos:
            body["ignore_eos"] = True       # vLLM's extension; only sent when asked for
        return {**body, **self.extra_body}

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclasses.dataclass
class RequestResult:
    success: bool
    prompt_len: int | None = None       # the dataset's count, else the server's usage.prompt_tokens
    output_tokens: int = 0
    usage_reported: bool = False        # output_tokens came from the server's usage
    ttft: float = 0.0                   # seconds
    latency: float = 0.0                # E2E seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""
    audio_ttfp: float | None = None     # seconds to the first audio chunk (a spoken answer)
    audio_rtf: float | None = None      # seconds to the last audio chunk / seconds of audio


class StreamError(Exception):
    """The stream reported an error or broke the format."""


class StreamAccount:
    """Timings and counts of one stream, fed one event's data at a time with its arrival time."""

    def __init__(self, start: float, chat: bool, speech: bool = False, sample_rate: int = 24000):
        self.start = start
        self.chat = chat
        self.speech = speech
        self.sample_rate = sample_rate
        self.audio_first: float | None = None
        self.audio_last: float | None = None
        self.audio_bytes = 0
        self.audio_header = 0
        self.first: float | None = None   # arrival of the first text-carrying chunk
        self.last: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.usage_output: int | None = None
        self.usage_prompt: int | None = None
        self.done = False                 # [DONE] seen
        self.end: float | None = None     # arrival of the last event up to [DONE]

    def on_event(self, data: str, now: float) -> None:
        if self.done:
            return
        self.end = now
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"malformed event: {_shorten(data)}") from None
        if not isinstance(obj, dict):
            raise StreamError(f"malformed event: {_shorten(data)}")
        if obj.get("error"):
            raise StreamError(f"error in stream: {_error_text(obj)}")
        if self.speech:
            self._on_speech_event(obj, now)
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.usage_output = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.usage_prompt = usage["prompt_tokens"]
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if self.chat:
            delta = choice.get("delta")
            text = None
            if isinstance(delta, dict):
                audio = delta.get("audio")
                if isinstance(audio, dict):
                    self._on_audio(audio.get("data"), now)
                text = delta.get("content") or delta.get("reasoning_content") or (
                    audio.get("transcript") if isinstance(audio, dict) else None)
        else:
            text = choice.get("text")
        if not text:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def _on_speech_event(self, obj: dict, now: float) -> None:
        """``/v1/audio/speech`` SSE: ``speech.audio.delta`` carries audio (the first one counts as
        the first output too), ``speech.audio.done`` the usage."""
        if obj.get("type") == "speech.audio.delta":
            self._on_audio(obj.get("audio"), now)
            if self.first is None:
                self.first = now
                self.chunks = 1
            self.last = now
        usage = obj.get("usage")
        if obj.get("type") == "speech.audio.done" and isinstance(usage, dict):
            if isinstance(usage.get("output_tokens"), int):
                self.usage_output = usage["output_tokens"]
            if isinstance(usage.get("input_tokens"), int):
                self.usage_prompt = usage["input_tokens"]

    def _on_audio(self, data, now: float) -> None:
        if not isinstance(data, str) or not data:
            return
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise StreamError("audio chunk is not base64") from None
        if self.audio_first is None:
            self.audio_first = now
            if raw[:4] == b"RIFF":   # a streamed WAV: its header first
                self.audio_header = min(WAV_HEADER_BYTES, len(raw))
        self.audio_last = now
        self.audio_bytes += len(raw)

    def result(self, eof: float, prompt_len: int | None) -> RequestResult:
        """``eof``: when the body ended; E2E stops at the last event (up to ``[DONE]``) if there was one."""
        end = self.end if self.end is not None else eof
        if self.first is None:
            return RequestResult(False, prompt_len, latency=end - self.start,
                                 error="stream ended without generated text")
        reported = self.usage_output is not None
        audio_s = max(0, self.audio_bytes - self.audio_header) / 2 / self.sample_rate
        return RequestResult(
            True, prompt_len if prompt_len is not None else self.usage_prompt,
            output_tokens=self.usage_output if reported else self.chunks, usage_reported=reported,
            ttft=self.first - self.start, latency=end - self.start, itl=self.itl,
            audio_ttfp=self.audio_first - self.start if self.audio_first is not None else None,
            audio_rtf=(self.audio_last - self.start) / audio_s if audio_s > 0 else None)


async def send_request(session: aiohttp.ClientSession, target: Target, prompt: Prompt) -> RequestResult:
    """Never raises (but for cancellation): every failure becomes a failed :class:`RequestResult`."""
    start = time.perf_counter()
    try:
        async with session.post(target.url, json=target.payload(prompt), headers=target.headers()) as response:
            if response.status != 200:
                body = await response.content.read(4096)
                return RequestResult(False, prompt.prompt_len, latency=time.perf_counter() - start,
                                     error=f"HTTP {response.status}: {_body_text(body)}")
            account = StreamAccount(start, chat=target.endpoint_type == "chat", speech=target.endpoint_type == "speech",
                                    sample_rate=target.audio_sample_rate)
            parser = SSEParser()
            # Read to the end of the body even after [DONE], so the connection can be reused.
            async for chunk in response.content.iter_any():   # bounded by the body and the timeout
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    account.on_event(event.data, now)
            return account.result(time.perf_counter(), prompt.prompt_len)
    except (StreamError, SSEError) as exc:
        return RequestResult(False, prompt.prompt_len, latency=time.perf_counter() - start, error=_shorten(str(exc)))
    except asyncio.TimeoutError:
        return RequestResult(False, prompt.prompt_len, latency=time.perf_counter() - start,
                             error="timeout (see --timeout)")
    except aiohttp.ClientError as exc:
        return RequestResult(False, prompt.prompt_len, latency=time.perf_counter() - start,
                             error=_shorten(f"{type(exc).__name__}: {exc}"))


def _body_text(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _shorten(text.strip() or "(empty body)")
    return _error_text(obj) if isinstance(obj, dict) else _shorten(text)


def _error_text(obj: dict) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``), else the JSON."""
    error = obj.get("error")
    if isinstance(error, dict) and error.get("message"):
        code = error.get("code") or error.get("type")
        return _shorten(f"{error['message']} ({code})" if code else str(error["message"]))
    if isinstance(error, str):
        return _shorten(error)
    return _shorten(json.dumps(obj))


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_TEXT_LIMIT else text[:ERROR_TEXT_LIMIT - 1] + "…"
