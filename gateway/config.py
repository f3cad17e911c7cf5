"""Configuration of the gateway: one frozen object, validated on construction, whose fields (and
those of each :class:`ServedModel` in it) also declare ``omni-gateway``'s flags
(:mod:`omnirelay.config_flags`)."""

from __future__ import annotations

import dataclasses
import json
import os

from omnirelay import lora_modules
from omnirelay.config_flags import flag, flag_group, no_flag
from omnirelay.lora_modules import LoraOptions
from omnirelay.pipeline import REASONING_PARSERS
from omnirelay.scheduling import POLICIES

from .media import MediaLimits
from .tool_call_formats import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS


def _unset_if_empty(value):
    """"" on the command line means "not given": the field's default."""
    return value or None


def _abspath_or_none(path: str) -> str | None:
    return os.path.abspath(path) if path else None


def template_kwargs(text: str) -> dict:
    """``--default-chat-template-kwargs``: a JSON object ("" for none); ``ValueError`` naming the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return value


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model the gateway serves. Each field's flag and help text are in its metadata
    (:mod:`omnirelay.config_flags`); omni-gateway builds one ServedModel per ``--model``
    (gateway/daemon.py's ``served_models``): a repeatable flag is given once for all models or once
    per ``--model`` in order, any other flag sets every model."""

    name: str = flag("--served-model-name", "model id clients use, one per --model in the same order (default: "
                     "the --model path)", action="append")
    path: str = flag("--model", "local model directory (tokenizer, chat template, context length); repeat to serve "
                     "several models behind one gateway", required=True, action="append", parse=os.path.abspath)
    stages: tuple[str, ...] = no_flag("the roles a request passes, in order",
                                      "the model's stage-pipeline YAML (omni-gateway's --stage-configs-path), "
                                      "else prefill → decode", default=("prefill", "decode"))
    max_model_len: int = flag("--max-model-len", "longest sequence, prompt + output (0: the model's max positions)",
                              default=0, type=int)
    allowed_local_media_path: str | None = flag(
        "--allowed-local-media-path", "directory whose files chat image_url/audio_url parts may name (omni models; "
        "default: data: URLs only)", default=None, parse=_abspath_or_none)
    reasoning_parser: str | None = flag(
        "--reasoning-parser", "split a thinking model's <think> reasoning from its answer (qwen3 | deepseek_r1; "
        "'' for none; gateway/reasoning.py): one for all models or one per model, in order; wins over the "
        "pipeline file's reasoning_parser", default=None, action="append", cli_default=None)
    default_chat_template_kwargs: dict = flag(
        "--default-chat-template-kwargs", "JSON object of chat-template variables for every request, e.g. "
        "'{\"enable_thinking\": false}' (a request's chat_template_kwargs override them one by one): one for all "
        "models or one per model, in order", default_factory=dict, action="append", cli_default=None,
        parse=template_kwargs)
    structured_outputs_in_reasoning: bool = flag(
        "--structured-outputs-in-reasoning", "a thinking model's grammar (structured outputs, forced tool calls) "
        "applies from its first token, reasoning included (vLLM's enable_in_reasoning); default: after </think>",
        default=False, action="store_true")
    scheduling_policy: str = flag(
        "--scheduling-policy", "the broker's scheduling policy (omnirelay/scheduling.py): with fcfs (default), "
        "arrival order, and a request's non-zero 'priority' is a 400; with priority, lower 'priority' first in the "
        "broker's and engines' queues, aged so none starves", default="fcfs", choices=POLICIES)
    pooler_config: str = flag(
        "--pooler-config", "vLLM's pooler config, a JSON object ('{\"pooling_type\": \"MEAN\", \"normalize\": true}'): "
        "how /v1/embeddings pools this model, over its sentence-transformers modules.json and the default (last "
        "token, normalised; omnirelay/pooling_params.py): one for all models or one per model, in order",
        default="", action="append", cli_default=None, parse=_unset_if_empty)
    tool_call_parser: str = flag(
        "--tool-call-parser", "the markup a model writes its tool calls in (hermes, the default | qwen3_coder; "
        "gateway/tool_call_formats.py): one for all models or one per model, in order",
        default=DEFAULT_TOOL_CALL_PARSER, action="append", cli_default=None, parse=_unset_if_empty)


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """What the gateway serves and how. Each field's flag and help text are in its metadata
    (:mod:`omnirelay.config_flags`): ``omni-gateway``'s flags are generated from these fields and
    :class:`ServedModel`'s."""

    models: tuple[ServedModel, ...] = no_flag("the models served",
                                              "one ServedModel per --model, from ServedModel's flags")
    host: str = flag("--host", "address the HTTP server listens on", default="127.0.0.1")
    port: int = flag("--port", "port the HTTP server listens on (0: any free port)", default=8091, type=int)
    broker: str = flag("--broker", "ZeroMQ endpoint of the broker", default="tcp://127.0.0.1:5555")
    reply_host: str = flag("--reply-host", "address workers use to reach this gateway's token socket",
                           default="127.0.0.1")
    reply_port: int = flag("--reply-port", "port of the token socket (default: any free)", default=0, type=int)
    request_timeout_s: float = flag("--request-timeout", "seconds from a request's arrival to its last token",
                                    default=600.0, type=float)
    worker_wait_s: float = flag(
        "--worker-wait", "seconds a request waits for a role with no live worker the broker knows of (503 "
        "unavailable after, or at its --request-timeout if sooner), counted from the first such answer. The "
        "default, 30 s, covers a supervised restart with room for a loaded host's pauses: omni-serve's tiny-model "
        "worker registers again 2.5-3.2 s after a kill -9, and starts cold in 13 s, on a busy 2-core host; a "
        "large model adds its load time (docs/DESIGN.md, \"Failure handling\"). A worker the broker dropped for "
        "silence is waited for by the broker itself (omni-broker --expect-back)", default=30.0, type=float)
    video_timeout_s: float = flag(
        "--video-timeout", "seconds a video job (/v1/videos and /v1/videos/sync) may run in all (default 4 h), as "
        "long as it makes progress (gateway/routes/videos.py)", default=4 * 3600.0, type=float)
    video_stall_timeout_s: float = flag(
        "--video-stall-timeout", "a started video job (one its worker reported on) that reports no progress for "
        "this long fails (default 30 min): its worker is alive (the broker drops a silent one) but stuck; "
        "generous, as a whole-call runner or a long VAE decode reports nothing for minutes",
        default=1800.0, type=float)
    max_body_bytes: int = flag("--max-body-bytes", "largest accepted request body, in bytes",
                               default=8 * 1024 * 1024, type=int)
    status_timeout_s: float = no_flag("seconds /health waits for the broker's answer", "its default", default=2.0)
    api_key: str | None = flag("--api-key", "require this bearer token on /v1 routes (Authorization: Bearer KEY; "
                               "default: $OMNIRELAY_API_KEY)", default=None, parse=_unset_if_empty)
    protect_probes: bool = flag("--protect-probes", "with --api-key, also protect /health, /metrics and /cluster",
                                default=False, action="store_true")
    disable_log_requests: bool = flag("--disable-log-requests", "no per-request log line", default=False,
                                      action="store_true")
    max_streams_per_client: int = flag("--max-streams-per-client", "concurrent streaming requests one client "
                                       "address may hold (429 beyond)", default=64, type=int)
    stream_write_timeout_s: float = flag(
        "--stream-write-timeout", "seconds a streaming client may read nothing before it is dropped, so a slow "
        "reader cannot hold a worker's KV cache", default=30.0, type=float)
    header_timeout_s: float = flag(
        "--header-timeout", "seconds a connection may take to send a complete request head (and may stay idle "
        "between requests) before it is closed: a client dribbling header bytes (slowloris) holds a socket, "
        "never a handler; behind a proxy keep it above the proxy's upstream keep-alive (nginx: 60 s)",
        default=75.0, type=float)
    read_timeout_s: float = flag(
        "--read-timeout", "seconds a request body may take to arrive after its head (408 beyond, and the "
        "connection closed); nothing is submitted before the body is complete", default=60.0, type=float)
    max_websocket_sessions: int = flag(
        "--max-websocket-sessions", "WebSocket sessions (/v1/realtime, /v1/audio/speech/stream) held at once; 503 "
        "beyond", default=256, type=int)
    websocket_idle_timeout_s: float = flag(
        "--websocket-idle-timeout", "close a WebSocket session that sends no event for this long with nothing in "
        "flight", default=300.0, type=float)
    trust_request_chat_template: bool = flag(
        "--trust-request-chat-template", "let requests bring their own chat_template, a Jinja template the gateway "
        "renders (otherwise 422)", default=False, action="store_true")
    max_image_pixels: int = flag(
        "--max-image-pixels", "width x height a chat image may declare (400 beyond, checked before decoding; at "
        "most omnirelay.handoffs.MAX_IMAGE_PIXELS_CEILING)", default=25_000_000, type=int)
    min_audio_sample_rate: int = flag(
        "--min-audio-sample-rate", "lowest sample rate (Hz) a chat WAV clip may declare (400 below, before "
        "resampling: a 1 Hz header would ask for a huge resample)", default=8000, type=int)
    max_audio_sample_rate: int = flag("--max-audio-sample-rate", "highest sample rate (Hz) a chat WAV clip may "
                                      "declare", default=192_000, type=int)
    allow_special_tokens_in_content: bool = flag(
        "--allow-special-tokens-in-content", "tokenize special-token text in chat messages (e.g. <|im_end|>) as "
        "control tokens; by default message content is plain text and only the chat template's own markers are "
        "control tokens", default=False, action="store_true")
    enable_force_include_usage: bool = flag(
        "--enable-force-include-usage", "every streamed chat or completion sends usage, asked or not: on each "
        "chunk and in a last chunk (vLLM's flag; gateway/usage.py)", default=False, action="store_true")
    enable_prompt_tokens_details: bool = flag(
        "--enable-prompt-tokens-details", "chat and completion usage carries prompt_tokens_details.cached_tokens, "
        "the prompt tokens prefill took from its prefix cache (vLLM's flag; without it: null)", default=False,
        action="store_true")
    enable_server_load_tracking: bool = flag(
        "--enable-server-load-tracking", "GET /load counts the generation requests in flight (vLLM's flag; "
        "without it /load answers 0; gateway/server_load.py)", default=False, action="store_true")
    lora: LoraOptions | None = flag_group(   # None: off
        ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
         "--allow-runtime-lora-updating"),
        "serve LoRA adapters by name (gateway/lora.py, omnirelay/lora_modules.py; default: those of the "
        "stage-pipeline YAMLs' LoRA keys)", add=lambda parser: lora_modules.add_arguments(parser, gateway=True),
        read=lora_modules.options_from_args, default=None)

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
        if not 0 <= self.worker_wait_s < float("inf"):
            raise ValueError("worker_wait_s must be finite and >= 0")
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
