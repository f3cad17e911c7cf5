"""``omni-gateway``: the OpenAI-compatible HTTP server in front of the broker."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

from aiohttp import web

from omnirelay import lora_modules
from omnirelay.pipeline import default_llm_pipeline, load_pipeline
from omnirelay.scheduling import POLICIES
from omnirelay.lifecycle import add_logging_arguments, setup_logging
from omnirelay.security import CurveKeys, add_curve_arguments, keys_from_args, require_curve_off_loopback
from omnirelay.tracing import Tracing, add_tracing_arguments, tracing_from_args

from .app import create_app
from .lora import check_modules as check_lora_modules
from .app_keys import TRACING
from .config import GatewayConfig, ServedModel
from .tool_call_formats import DEFAULT_TOOL_CALL_PARSER


async def serve(config: GatewayConfig, ready_file: str | None = None, keys: CurveKeys | None = None,
                tracing: Tracing | None = None) -> None:
    app = create_app(config, keys)
    app[TRACING] = tracing
    # aiohttp closes a connection that has no complete request head when its keep-alive clock runs
    # out; that clock starts when the connection opens, so it is the header timeout too.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=config.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = runner.addresses[0][1]
    url = f"http://{config.host}:{port}"
    print(f"omni-gateway listening on {url}", flush=True)
    if ready_file:
        # Written atomically so a launcher polling the file never reads half a URL.
        with open(ready_file + ".tmp", "w") as handle:
            handle.write(url)
        os.replace(ready_file + ".tmp", ready_file)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _per_model(values: list[str] | None, count: int, flag: str) -> list[str | None]:
    """A repeatable flag given once for all models or once per ``--model``, in order."""
    values = values or []
    if len(values) not in (0, 1, count):
        raise ValueError(f"give one {flag} for all models or one per --model")
    return values * count if len(values) == 1 else (values or [None] * count)


def _template_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return value


def _served_models(paths: list[str], names: list[str] | None, pipelines: list[str] | None,
                   max_model_len: int, allowed_local_media_path: str | None = None,
                   reasoning_parsers: list[str] | None = None,
                   template_kwargs: list[str] | None = None,
                   structured_in_reasoning: bool = False,
                   scheduling_policy: str = "fcfs",
                   tool_call_parsers: list[str] | None = None) -> tuple[ServedModel, ...]:
    """``reasoning_parsers`` (``--reasoning-parser``, an empty one: none) win over the pipeline
    file's ``reasoning_parser``; ``tool_call_parsers`` (``--tool-call-parser``, one for all models
    or one per model; default hermes)."""
    names = names or []
    if len(names) > len(paths):
        raise ValueError("more --served-model-name than --model")
    pipelines = _per_model(pipelines, len(paths), "--stage-configs-path")
    parsers = _per_model(reasoning_parsers, len(paths), "--reasoning-parser")
    kwargs = _per_model(template_kwargs, len(paths), "--default-chat-template-kwargs")
    tool_parsers = _per_model(tool_call_parsers, len(paths), "--tool-call-parser")
    models = []
    for i, path in enumerate(paths):
        pipeline = load_pipeline(pipelines[i]) if pipelines[i] else default_llm_pipeline()
        parser = pipeline.reasoning_parser if parsers[i] is None else (parsers[i] or None)
        models.append(ServedModel(name=names[i] if i < len(names) else path, path=os.path.abspath(path),
                                  stages=pipeline.roles, max_model_len=max_model_len,
                                  allowed_local_media_path=allowed_local_media_path, reasoning_parser=parser,
                                  default_chat_template_kwargs=_template_kwargs(kwargs[i]),
                                  structured_outputs_in_reasoning=structured_in_reasoning,
                                  scheduling_policy=scheduling_policy,
                                  tool_call_parser=tool_parsers[i] or DEFAULT_TOOL_CALL_PARSER))
    return tuple(models)


def _pipeline_lora(models: tuple[ServedModel, ...], pipelines: list[str] | None) -> lora_modules.LoraOptions | None:
    """Without ``--enable-lora``: the LoRA keys of the models' pipeline files, each model's adapters
    served under it (None when no stage enables LoRA)."""
    files = _per_model(pipelines, len(models), "--stage-configs-path")
    found = [options for options in (load_pipeline(f).lora_options(m.name) for m, f in zip(models, files) if f)
             if options is not None]
    if not found:
        return None
    modules = tuple(m for options in found for m in options.modules)
    if len({m.name for m in modules}) != len(modules):
        raise ValueError(f"--stage-configs-path: a LoRA adapter name is given twice: {[m.name for m in modules]}")
    return lora_modules.LoraOptions(modules=modules, max_loras=max(o.max_loras for o in found),
                                    max_lora_rank=max(o.max_lora_rank for o in found))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-gateway", description="omnirelay OpenAI-compatible gateway")
    parser.add_argument("--model", required=True, action="append",
                        help="local model directory; repeat to serve several models behind one gateway")
    parser.add_argument("--served-model-name", action="append", default=None,
                        help="model id clients use, one per --model in the same order (default: the --model path)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--broker", default="tcp://127.0.0.1:5555")
    parser.add_argument("--reply-host", default="127.0.0.1", help="address workers use to reach this gateway")
    parser.add_argument("--reply-port", type=int, default=0, help="port of the token socket (default: any free)")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--video-timeout", type=float, default=GatewayConfig.video_timeout_s,
                        help="seconds a video job may run in all (default 4 h), as long as it makes progress")
    parser.add_argument("--video-stall-timeout", type=float, default=GatewayConfig.video_stall_timeout_s,
                        help="a started video job that reports no progress for this long fails (default 30 min)")
    parser.add_argument("--api-key", default=os.environ.get("OMNIRELAY_API_KEY"),
                        help="require this bearer token on /v1 routes (default: $OMNIRELAY_API_KEY)")
    parser.add_argument("--protect-probes", action="store_true", help="with --api-key, also protect /health, "
                        "/metrics and /cluster")
    parser.add_argument("--disable-log-requests", action="store_true")
    parser.add_argument("--max-streams-per-client", type=int, default=GatewayConfig.max_streams_per_client)
    parser.add_argument("--stream-write-timeout", type=float, default=GatewayConfig.stream_write_timeout_s)
    parser.add_argument("--max-body-bytes", type=int, default=GatewayConfig.max_body_bytes)
    parser.add_argument("--header-timeout", type=float, default=GatewayConfig.header_timeout_s,
                        help="seconds a connection may take to send a complete request head (and may stay idle "
                             "between requests) before it is closed")
    parser.add_argument("--read-timeout", type=float, default=GatewayConfig.read_timeout_s,
                        help="seconds a request body may take to arrive after its head (408 beyond)")
    parser.add_argument("--max-websocket-sessions", type=int, default=GatewayConfig.max_websocket_sessions,
                        help="WebSocket sessions (/v1/realtime, /v1/audio/speech/stream) held at once; 503 beyond")
    parser.add_argument("--websocket-idle-timeout", type=float, default=GatewayConfig.websocket_idle_timeout_s,
                        help="close a WebSocket session that sends no event for this long with nothing in flight")
    parser.add_argument("--max-image-pixels", type=int, default=GatewayConfig.max_image_pixels,
                        help="width x height a chat image may declare (400 beyond, checked before decoding)")
    parser.add_argument("--min-audio-sample-rate", type=int, default=GatewayConfig.min_audio_sample_rate,
                        help="lowest sample rate (Hz) a chat WAV clip may declare (400 below, before resampling)")
    parser.add_argument("--max-audio-sample-rate", type=int, default=GatewayConfig.max_audio_sample_rate,
                        help="highest sample rate (Hz) a chat WAV clip may declare")
    parser.add_argument("--allow-special-tokens-in-content", action="store_true",
                        help="tokenize special-token text in chat messages (e.g. <|im_end|>) as control tokens; "
                             "by default message content is plain text")
    parser.add_argument("--stage-configs-path", action="append", default=None,
                        help="stage-pipeline YAML, one per --model or one for all (default: prefill → decode)")
    parser.add_argument("--ready-file", default=None, help="write the listening URL here once serving")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="directory whose files image_url/audio_url parts may name (default: data: URLs only)")
    parser.add_argument("--reasoning-parser", action="append", default=None,
                        help="split a thinking model's <think> reasoning from its answer (qwen3 | deepseek_r1; "
                             "'' for none): one for all models or one per --model; wins over the pipeline "
                             "file's reasoning_parser")
    parser.add_argument("--tool-call-parser", action="append", default=None,
                        help="the markup a model writes its tool calls in (hermes, the default | qwen3_coder): "
                             "one for all models or one per --model")
    parser.add_argument("--default-chat-template-kwargs", action="append", default=None,
                        help="JSON object of chat-template variables for every request, e.g. "
                             "'{\"enable_thinking\": false}': one for all models or one per --model")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (otherwise 422)")
    parser.add_argument("--structured-outputs-in-reasoning", action="store_true",
                        help="a thinking model's grammar (structured outputs, forced tool calls) applies from its "
                             "first token, reasoning included (vLLM's enable_in_reasoning); default: after </think>")
    parser.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                        help="the broker's: with priority, a request's 'priority' is served (lower first); with "
                             "fcfs (default) a non-zero one is a 400")
    lora_modules.add_arguments(parser, gateway=True)
    add_logging_arguments(parser)
    add_curve_arguments(parser, server=True, client=True)
    add_tracing_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging("omni-gateway", args.log_level, args.log_format)
    try:
        models = _served_models(args.model, args.served_model_name, args.stage_configs_path, args.max_model_len,
                                os.path.abspath(args.allowed_local_media_path) if args.allowed_local_media_path else None,
                                args.reasoning_parser, args.default_chat_template_kwargs,
                                args.structured_outputs_in_reasoning, args.scheduling_policy,
                                args.tool_call_parser)
        config = GatewayConfig(
            models=models,
            trust_request_chat_template=args.trust_request_chat_template,
            host=args.host, port=args.port, broker=args.broker, reply_host=args.reply_host, reply_port=args.reply_port,
            request_timeout_s=args.request_timeout, video_timeout_s=args.video_timeout,
            video_stall_timeout_s=args.video_stall_timeout,
            api_key=args.api_key or None,
            protect_probes=args.protect_probes, disable_log_requests=args.disable_log_requests,
            max_streams_per_client=args.max_streams_per_client, stream_write_timeout_s=args.stream_write_timeout,
            max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout, read_timeout_s=args.read_timeout,
            max_websocket_sessions=args.max_websocket_sessions, websocket_idle_timeout_s=args.websocket_idle_timeout,
            max_image_pixels=args.max_image_pixels, min_audio_sample_rate=args.min_audio_sample_rate,
            max_audio_sample_rate=args.max_audio_sample_rate,
            allow_special_tokens_in_content=args.allow_special_tokens_in_content,
            lora=lora_modules.options_from_args(args) or _pipeline_lora(models, args.stage_configs_path))
        check_lora_modules(config.lora)
        keys = keys_from_args(args)
        require_curve_off_loopback(keys, config.broker, f"tcp://{config.reply_host}:0")
        tracing = tracing_from_args("omni-gateway", args)
    except ValueError as exc:   # PipelineError and SecurityError included
        parser.error(str(exc))
    try:
        asyncio.run(serve(config, args.ready_file, keys, tracing))
    finally:
        if tracing is not None:
            tracing.shutdown()   # exports the spans of the requests that ended last
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
