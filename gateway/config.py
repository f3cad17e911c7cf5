"""Configuration of the gateway (one frozen object, validated on construction)."""

from __future__ import annotations

import dataclasses
import os

from omnirelay.lora_modules import LoraOptions
from omnirelay.pipeline import REASONING_PARSERS

from .media import MediaLimits
from .tool_call_formats import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """name: the id clients send in ``model``; path: the local model directory (tokenizer,
    chat template, context length); stages: the roles a request passes, in order;
    allowed_local_media_path: a directory whose files chat ``image_url``/``audio_url`` parts may name
    (omni models; None: data URLs only); reasoning_parser: how its chat output splits into reasoning
    and answer (a name of gateway/reasoning.py's ``PARSERS``; None: no split);
    default_chat_template_kwargs: variables given to its chat template on every request (a request's
    ``chat_template_kwargs`` override them one by one); structured_outputs_in_reasoning: a grammar
    (structured outputs, forced tool calls) shapes a thinking model's reasoning too, from its first
    token (vLLM's ``enable_in_reasoning``); off, it starts after ``</think>``; scheduling_policy: the
    cluster's ``--scheduling-policy`` (``priority``: a request's ``priority`` is served, else it must
    be 0; omnirelay/scheduling.py); tool_call_parser: the markup its ``auto`` tool calls are written
    in (``--tool-call-parser``: gateway/tool_call_formats.py's ``TOOL_CALL_PARSERS``)."""

    name: str
    path: str
    stages: tuple[str, ...] = ("prefill", "decode")
    max_model_len: int = 0
    allowed_local_media_path: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    structured_outputs_in_reasoning: bool = False
    scheduling_policy: str = "fcfs"
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """
    host, port:          where the HTTP server listens (port 0: any free port).
    broker:              ZeroMQ endpoint of the broker.
    reply_host:          address workers use to reach this gateway's token socket.
    reply_port:          that socket's port (0: any free port).
    models:              the models served.
    request_timeout_s:   deadline of a request from arrival to its last token.
    video_timeout_s:     deadline of a video job (``/v1/videos`` and ``/v1/videos/sync``) from its start;
                         within it a job lives as long as it makes progress (gateway/routes/videos.py).
    video_stall_timeout_s: a started video job (one its worker reported on) that reports nothing more
                         for this long fails: its worker is alive (the broker drops a silent one) but
                         stuck. Generous: a whole-call runner or a long VAE decode reports nothing
                         for minutes.
    max_body_bytes:      largest accepted request body.
    status_timeout_s:    how long /health waits for the broker's answer.
    api_key:             when set, /v1 routes need ``Authorization: Bearer <api_key>``.
    protect_probes:      with an API key, /health, /metrics and /cluster need it too.
    disable_log_requests: no per-request log line.
    max_streams_per_client: concurrent streaming requests one client address may hold (429 beyond).
    stream_write_timeout_s: a streaming client that reads nothing for this long is dropped, so a slow
                         reader cannot hold a worker's KV cache.
    header_timeout_s:    a connection that has not sent a complete request head this long after it
                         opened (or after its previous response) is closed: a client dribbling header
                         bytes (slowloris) holds a socket, never a handler. The same clock closes idle
                         keep-alive connections, so behind a proxy keep it above the proxy's upstream
                         keep-alive (nginx: 60 s).
    read_timeout_s:      the whole request body must arrive within this long after the head; a client
                         that sends it byte by byte, or never, gets a 408 and its connection closed.
                         Nothing is submitted before the body is complete, so such a client never holds a
                         worker's KV cache or a stream slot.
    max_websocket_sessions: WebSocket sessions (``/v1/realtime``, ``/v1/audio/speech/stream``) this
                         gateway holds at once; the next upgrade request gets a 503.
    websocket_idle_timeout_s: a WebSocket session with nothing in flight that receives no event for this
                         long is closed.
    trust_request_chat_template: a request may bring its own ``chat_template`` (a Jinja template the
                         gateway renders); off, such a request is a 422 (vLLM's
                         ``--trust-request-chat-template``).
    max_image_pixels:    width × height a chat image may declare in its header (400 beyond, before it is
                         decoded; at most ``omnirelay.handoffs.MAX_IMAGE_PIXELS_CEILING``).
    min_audio_sample_rate, max_audio_sample_rate: the sample rates (Hz) a chat WAV clip may declare (400
                         beyond, before it is read or resampled: a 1 Hz header would ask for a huge resample).
    allow_special_tokens_in_content: tokenize special-token text in chat messages (``<|im_end|>`` typed by a
                         client) as the control tokens it spells, as before; off, message content is always
                         plain text and only the chat template's own markers are control tokens.
    """

    models: tuple[ServedModel, ...]
    host: str = "127.0.0.1"
    port: int = 8091
    broker: str = "tcp://127.0.0.1:5555"
    reply_host: str = "127.0.0.1"
    reply_port: int = 0
    request_timeout_s: float = 600.0
    video_timeout_s: float = 4 * 3600.0
    video_stall_timeout_s: float = 1800.0
    max_body_bytes: int = 8 * 1024 * 1024
    status_timeout_s: float = 2.0
    api_key: str | None = None
    protect_probes: bool = False
    disable_log_requests: bool = False
    max_streams_per_client: int = 64
    stream_write_timeout_s: float = 30.0
    header_timeout_s: float = 75.0
    read_timeout_s: float = 60.0
    max_websocket_sessions: int = 256
    websocket_idle_timeout_s: float = 300.0
    trust_request_chat_template: bool = False
    max_image_pixels: int = 25_000_000
    min_audio_sample_rate: int = 8000
    max_audio_sample_rate: int = 192_000
    allow_special_tokens_in_content: bool = False
    lora: LoraOptions | None = None     # --enable-lora: adapters served by name (gateway/lora.py); None: off

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the gateway needs at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate served model names: {names}")
        for model in self.models:
            if not os.path.isdir(model.path):
                raise ValueError(f"model directory {model.path!r} does not exist")
            if model.reasoning_parser is not None and model.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"model {model.name!r}: reasoning parser {model.reasoning_parser!r} is not one of "
                                 f"{', '.join(REASONING_PARSERS)}")
            if model.tool_call_parser not in TOOL_CALL_PARSERS:
                raise ValueError(f"model {model.name!r}: tool-call parser {model.tool_call_parser!r} is not one of "
                                 f"{', '.join(TOOL_CALL_PARSERS)}")
            if not isinstance(model.default_chat_template_kwargs, dict) \
                    or not all(isinstance(k, str) for k in model.default_chat_template_kwargs):
                raise ValueError(f"model {model.name!r}: default chat template kwargs must be a JSON object")
        if not 0 <= self.port < 65536 or not 0 <= self.reply_port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.request_timeout_s <= 0 or self.max_body_bytes <= 0 or self.video_timeout_s <= 0 \
                or self.video_stall_timeout_s <= 0:
            raise ValueError("request_timeout_s, video_timeout_s, video_stall_timeout_s and max_body_bytes must be "
                             "positive")
        if self.header_timeout_s <= 0 or self.read_timeout_s <= 0 or self.stream_write_timeout_s <= 0:
            raise ValueError("header_timeout_s, read_timeout_s and stream_write_timeout_s must be positive")
        if self.max_websocket_sessions < 0 or self.websocket_idle_timeout_s <= 0:
            raise ValueError("max_websocket_sessions must be >= 0 and websocket_idle_timeout_s positive")
        self.media_limits(None)   # the media bounds' own checks

    def media_limits(self, allowed_local_dir: str | None) -> MediaLimits:
        """The media bounds of a served model (its own local media directory, the gateway's limits)."""
        return MediaLimits(allowed_local_dir=allowed_local_dir, max_image_pixels=self.max_image_pixels,
                           min_audio_sample_rate=self.min_audio_sample_rate,
                           max_audio_sample_rate=self.max_audio_sample_rate)
