"""``omni-gateway``: the OpenAI-compatible HTTP server in front of the broker.

Its flags are generated from :class:`GatewayConfig`'s and :class:`ServedModel`'s fields (see
:mod:`omnirelay.config_flags`); a bad value exits with status 2, naming the flag."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from aiohttp import web

from omnirelay import config_flags, lora_modules
from omnirelay.pipeline import default_llm_pipeline, load_pipeline
from omnirelay.lifecycle import add_logging_arguments, setup_logging
from omnirelay.security import CurveKeys, add_curve_arguments, keys_from_args, require_curve_off_loopback
from omnirelay.tracing import Tracing, add_tracing_arguments, tracing_from_args

from .app import create_app
from .lora import check_modules as check_lora_modules
from .app_keys import TRACING
from .config import GatewayConfig, ServedModel


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


def served_models(args: argparse.Namespace) -> tuple[ServedModel, ...]:
    """One :class:`ServedModel` per ``--model`` from ``args`` (parsed by :func:`build_parser`), by
    ServedModel's own flags: a repeatable one (``--reasoning-parser``) given once sets every model,
    else once per ``--model`` in order; ``--served-model-name`` names the first models (the rest: their
    path as given); any other flag sets every model. A model's stages come from its pipeline file
    (``--stage-configs-path``, one for all or one per model; default prefill → decode), and so does its
    reasoning parser unless ``--reasoning-parser`` is given ('': none). ``ValueError`` (a
    ``PipelineError`` included) naming the flag for bad values."""
    paths, names = args.model, args.served_model_name or []
    if len(names) > len(paths):
        raise ValueError("more --served-model-name than --model")
    pipelines = _per_model(args.stage_configs_path, len(paths), "--stage-configs-path")
    per_model = {spec.dest: _per_model(getattr(args, spec.dest), len(paths), spec.name)
                 for name, spec in config_flags.flags(ServedModel).items()
                 if spec.options.get("action") == "append" and name not in ("name", "path")}
    models = []
    for i, path in enumerate(paths):
        pipeline = load_pipeline(pipelines[i]) if pipelines[i] else default_llm_pipeline()
        given = argparse.Namespace(**{**vars(args), **{dest: values[i] for dest, values in per_model.items()},
                                      "model": path, "served_model_name": names[i] if i < len(names) else None})
        overrides = {"stages": pipeline.roles}
        if given.reasoning_parser == "":   # none, whatever the pipeline file says
            overrides["reasoning_parser"] = None
        models.append(config_flags.from_args(ServedModel, given, fallbacks={
            "name": path, "reasoning_parser": pipeline.reasoning_parser}, **overrides))
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


def build_parser() -> argparse.ArgumentParser:
    """omni-gateway's flags: those of :class:`GatewayConfig`'s and :class:`ServedModel`'s fields,
    generated from them (:mod:`omnirelay.config_flags`), and those that set no field (the pipeline
    files, the ready file, logging, CURVE keys, tracing)."""
    parser = argparse.ArgumentParser(prog="omni-gateway", description="omnirelay OpenAI-compatible gateway")
    config_flags.add_flags(parser, ServedModel)
    config_flags.add_flags(parser, GatewayConfig)
    # Read when the parser is built, not when the config module is imported.
    parser.set_defaults(api_key=os.environ.get("OMNIRELAY_API_KEY"))
    parser.add_argument("--stage-configs-path", action="append", default=None,
                        help="stage-pipeline YAML, one per --model or one for all (default: prefill → decode)")
    parser.add_argument("--ready-file", default=None, help="write the listening URL here once serving")
    add_logging_arguments(parser)
    add_curve_arguments(parser, server=True, client=True)
    add_tracing_arguments(parser)
    return parser


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The config from ``args`` (parsed by :func:`build_parser`): the models (:func:`served_models`),
    the flags given, else the fields' defaults; without ``--enable-lora``, the LoRA adapters of the
    models' pipeline files. ``ValueError`` (a ``PipelineError`` included) for bad flags or files."""
    models = served_models(args)
    fallbacks = ({"lora": _pipeline_lora(models, args.stage_configs_path)}
                 if lora_modules.options_from_args(args) is None else {})
    return config_flags.from_args(GatewayConfig, args, fallbacks=fallbacks, models=models)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("omni-gateway", args.log_level, args.log_format)
    try:
        config = gateway_config(args)
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
