"""LoRA adapters at the gateway (``--enable-lora``): each adapter is served as a model of its own name.

An adapter's entry in the app's model table is an :class:`AdapterModel`: its base's
:class:`~omnirelay.gateway.models.ModelRuntime` (tokenizer, template, context, stages) under the
adapter's name, with ``lora``/``lora_path`` set. A request naming it runs on the base's workers
(``Submit.model`` is ``base_name``) with the adapter in ``TextParams.lora`` and ``lora_path``
(a worker registers an adapter it has not seen yet, checking it as at start);
responses echo the adapter's name, as vLLM's do. ``GET /v1/models`` lists it with ``parent`` = its
base. A request for an unknown or unloaded adapter is the table's 404 naming it.

``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
``{"lora_name"}`` (vLLM's bodies) exist only with ``--allow-runtime-lora-updating``. A load checks
the directory's ``adapter_config.json`` (present, a LORA adapter, rank within ``--max-lora-rank``)
before the name is served; the workers read the weights when its first request arrives and fail
that request naming the adapter if they do not fit the base.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from aiohttp import web

from omnirelay.errors import BadRequest, NotFound
from omnirelay.lora_modules import LoraOptions

from .app_keys import MODELS
from .models import ModelRuntime

LORA_OPTIONS: web.AppKey[LoraOptions] = web.AppKey("lora_options")


class AdapterModel(ModelRuntime):
    """The base's runtime under an adapter's name (everything not set here is the base's)."""

    def __init__(self, base: ModelRuntime, name: str, path: str):   # noqa: the base's __init__ already ran
        self.base = base
        self.name = name
        self.lora = name
        self.lora_path = path

    def __getattr__(self, attr: str):
        if attr == "base":   # not set yet (copy/pickle probing): no recursion
            raise AttributeError(attr)
        return getattr(self.base, attr)

    @property
    def base_name(self) -> str:
        return self.base.name

    def card(self) -> dict:
        return {**self.base.card(), "id": self.name, "root": self.lora_path, "parent": self.base.name}


def check_adapter_dir(name: str, path: str, max_rank: int) -> None:
    """The cheap checks of an adapter directory (no torch): BadRequest naming what is wrong."""
    config = Path(path) / "adapter_config.json"
    if not (Path(path) / "adapter_model.safetensors").is_file() or not config.is_file():
        raise BadRequest(f"LoRA adapter {name!r}: {path} holds no adapter_config.json and "
                         "adapter_model.safetensors", param="lora_path")
    try:
        raw = json.loads(config.read_text())
    except ValueError:
        raise BadRequest(f"LoRA adapter {name!r}: {config} is not JSON", param="lora_path") from None
    if raw.get("peft_type", "LORA") != "LORA" or not isinstance(raw.get("r"), int):
        raise BadRequest(f"LoRA adapter {name!r}: {config} is not a LoRA adapter", param="lora_path")
    if raw["r"] > max_rank:
        raise BadRequest(f"LoRA adapter {name!r}: rank {raw['r']} is above --max-lora-rank {max_rank}",
                         param="lora_path")


def check_modules(options: LoraOptions | None) -> None:
    """At start: ValueError naming the first ``--lora-modules`` directory that is not an adapter."""
    for module in options.modules if options is not None else ():
        try:
            check_adapter_dir(module.name, module.path, options.max_lora_rank)
        except BadRequest as exc:
            raise ValueError(f"--lora-modules: {exc}") from None


def install(app: web.Application, options: LoraOptions | None) -> None:
    """Serve ``options``' adapters beside their base models; the runtime routes when allowed."""
    if options is None:
        return
    check_modules(options)
    app[LORA_OPTIONS] = options
    models = app[MODELS]
    text = [m for m in models.values() if isinstance(m, ModelRuntime)]
    for module in options.modules:
        base = models.get(module.base_model_name) if module.base_model_name else (text[0] if text else None)
        if not isinstance(base, ModelRuntime) or isinstance(base, AdapterModel):
            raise ValueError(f"--lora-modules {module.name}: base model {module.base_model_name or '(first)'!r} "
                             "is not a served text model")
        if module.name in models:
            raise ValueError(f"--lora-modules: {module.name!r} is already a served model's name")
        models[module.name] = AdapterModel(base, module.name, module.path)
    if options.allow_runtime_updating:
        app.router.add_post("/v1/load_lora_adapter", load_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_adapter)


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def load_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    unknown = sorted(set(body) - {"lora_name", "lora_path", "load_inplace"})
    if unknown:
        raise BadRequest(f"unknown fields {unknown}", param=unknown[0])
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise BadRequest("lora_name must be a non-empty string", param="lora_name")
    if not isinstance(path, str) or not path:
        raise BadRequest("lora_path must be a non-empty string", param="lora_path")
    models = request.app[MODELS]
    existing = models.get(name)
    if existing is not None and not (isinstance(existing, AdapterModel) and body.get("load_inplace")):
        raise BadRequest(f"a model named {name!r} is already served (load_inplace replaces an adapter)",
                         param="lora_name")
    path = os.path.abspath(path)
    check_adapter_dir(name, path, request.app[LORA_OPTIONS].max_lora_rank)
    base = next(m for m in models.values() if isinstance(m, ModelRuntime) and not isinstance(m, AdapterModel))
    models[name] = AdapterModel(base, name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    unknown = sorted(set(body) - {"lora_name", "lora_int_id"})
    if unknown:
        raise BadRequest(f"unknown fields {unknown}", param=unknown[0])
    name = body.get("lora_name")
    if not isinstance(name, str) or not isinstance(request.app[MODELS].get(name), AdapterModel):
        raise NotFound(f"LoRA adapter {name!r} is not loaded", param="lora_name")
    del request.app[MODELS][name]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
