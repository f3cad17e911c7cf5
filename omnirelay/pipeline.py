"""The stage-pipeline schema: which stages a model's requests pass and how data moves between them.

A pipeline file (YAML) looks like::

    model: tiny-llm                 # optional: the served name this pipeline belongs to
    reasoning_parser: qwen3         # optional: split <think> reasoning from the answer (qwen3 | deepseek_r1)
    stages:
      - name: prefill               # unique; requests pass stages in this order
        role: prefill               # encode | prefill | decode | generate
        runtime:
          max_batch_size: 8
          devices: "0,1"            # optional: the GPU group of each worker of this stage
        engine_args:                # passed to the role's engine (dtype, …)
          tensor_parallel_size: 2   # devices, when given, must number tensor × pipeline × sequence parallel size
          pipeline_parallel_size: 1
          # sequence_parallel_size: 2 (generate stages of a diffusion transformer: ranks splitting image tokens)
          # enable_expert_parallel: true (prefill/decode of an MoE model: the tensor ranks hold whole
          #                               experts, contiguous blocks, and exchange tokens by all-to-all)
          # kv_transfer: auto  (prefill stages: layerwise streams each layer's KV while the later layers
          #                     compute; whole puts it after the forward; auto (default) streams a step
          #                     with at least 16 MiB of KV)
          # enable_lora: true   (prefill/decode: LoRA adapters, as omni-worker's --enable-lora; then
          # lora_modules: [a1=/path/a1, {name: a2, path: /path/a2}]   --lora-modules, one per entry
          # max_loras: 2, max_lora_rank: 16, max_cpu_loras: 4         and the other LoRA flags)
          # quantization: int8  (prefill/decode: as omni-worker's --quantization; workers/llm/quantization.py)
          # speculative_config: {method: ngram, num_speculative_tokens: 5}  (decode stages: as
          #                     omni-worker's --speculative-config; omnirelay/speculative.py)
      - name: decode
        role: decode
        runtime: {max_batch_size: 64}
    connectors:
      kv:                           # a named connector: backend type and its options only
        type: shared_memory         # shared_memory | redis | mooncake_transfer_engine | mooncake_store
        options: {}
    edges:
      - {from: prefill, to: decode, connector: kv}

An edge names only the connector; which side of it a worker plays (producer or consumer) follows
from the stage the worker runs, at run time. Changing the backend of the KV handoff is one line
(``type:``). ``runtime.max_batch_size`` defaults to 1 for ``generate`` stages (diffusion) and to the
role's engine default otherwise. ``runtime.stream_chunk_tokens`` (decode only, default
:data:`DEFAULT_STREAM_CHUNK_TOKENS`) streams a spoken reply's hand-off to the generate stage in
chunks of that many new tokens while the thinker still writes, so the talker starts on the first
chunk (``omnirelay.handoffs.ChunkStream``); 0 hands the reply over whole after its last token.

LoRA (:data:`LORA_KEYS` in a prefill or decode stage's ``engine_args``) means what vLLM's flags of
the same names mean (``omnirelay/lora_modules.py``; a ``lora_modules`` entry is a ``name=path``
string or a ``{name, path, base_model_name}`` map, a relative path taken from the working
directory as on the command line). The worker of the stage uses them unless its own command line
says ``--enable-lora`` (then the flags alone count); the gateway serves the adapters of every LoRA
stage as models whose parent is the pipeline's model (:meth:`Pipeline.lora_options`).

:func:`load_pipeline` validates everything and raises :class:`PipelineError` whose message names the
offending entry (``stages[1].role: …``).

vLLM-Omni's legacy format (a top-level ``stage_args`` list, ``runtime.connectors`` and
``runtime.edges``) is accepted too: :mod:`omnirelay.deploy.legacy_stages` translates it into this
schema first, and its errors name the legacy entry (``stage_args[2].engine_input_source: …``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from .lora_modules import LoraOptions, parse_module
from .speculative import SpeculativeConfig, from_mapping as speculative_from_mapping

ROLES = ("encode", "prefill", "decode", "generate")
# A spoken reply's first chunk after this many tokens: the talker's first audio needs a few rows only.
DEFAULT_STREAM_CHUNK_TOKENS = 4
# vLLM's --reasoning-parser names the gateway serves (gateway/reasoning.py reads the output by them).
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# A prefill or decode stage's engine_args that turn LoRA on: vLLM's engine arguments (and flags).
LORA_KEYS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")

log = logging.getLogger("omnirelay.pipeline")


class PipelineError(ValueError):
    """The pipeline file is invalid; the message points at the offending entry."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """``devices``: the device ids of one worker's GPU group (empty: the launcher decides);
    when given there are exactly ``group_size`` of them."""

    name: str
    role: str
    max_batch_size: int
    engine_args: dict[str, Any]
    devices: tuple[str, ...] = ()
    # decode: a spoken reply's states go to the generate stage in chunks of this many new tokens
    # while the thinker still writes (0: whole, after its last token); see omnirelay/handoffs.py.
    stream_chunk_tokens: int = 0
    lora: LoraOptions | None = None   # engine_args' LoRA keys (None: no enable_lora: true)
    # decode: engine_args.speculative_config (omnirelay/speculative.py; None: no speculation)
    speculative: SpeculativeConfig | None = None

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine_args.get("tensor_parallel_size", 1))

    @property
    def pipeline_parallel_size(self) -> int:
        return int(self.engine_args.get("pipeline_parallel_size", 1))

    @property
    def sequence_parallel_size(self) -> int:
        return int(self.engine_args.get("sequence_parallel_size", 1))

    @property
    def enable_expert_parallel(self) -> bool:
        """Prefill/decode of a mixture-of-experts model: whole experts per tensor rank, tokens by all-to-all."""
        return bool(self.engine_args.get("enable_expert_parallel", False))

    @property
    def quantization(self) -> str | None:
        """Prefill/decode: ``--quantization`` (int8 quantizes at load; None: as the checkpoint stores it)."""
        value = self.engine_args.get("quantization")
        return None if value is None else str(value)

    @property
    def kv_transfer(self) -> str:
        """Prefill: how the KV leaves, ``auto`` (default), ``layerwise`` or ``whole``."""
        return str(self.engine_args.get("kv_transfer", "auto"))

    @property
    def group_size(self) -> int:
        """Processes (and GPUs, on GPU hosts) one worker of this stage needs."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.sequence_parallel_size


@dataclasses.dataclass(frozen=True)
class ConnectorSpec:
    name: str
    type: str
    options: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str
    connector: str


@dataclasses.dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    connectors: dict[str, ConnectorSpec]
    edges: tuple[Edge, ...]
    model: str | None = None
    reasoning_parser: str | None = None   # the gateway's reading of the model's output (REASONING_PARSERS)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(stage.role for stage in self.stages)

    def stage_for_role(self, role: str) -> Stage:
        for stage in self.stages:
            if stage.role == role:
                return stage
        raise PipelineError(f"the pipeline has no stage with role {role!r}")

    def lora_options(self, model_name: str) -> LoraOptions | None:
        """What the gateway serves of the stages' LoRA keys: every adapter of a LoRA stage, as one
        of ``model_name`` (the largest rank limit of those stages); None when no stage enables LoRA."""
        stages = [s.lora for s in self.stages if s.lora is not None]
        if not stages:
            return None
        modules = {m.name: dataclasses.replace(m, base_model_name=model_name) for s in stages for m in s.modules}
        return LoraOptions(modules=tuple(modules.values()), max_loras=max(s.max_loras for s in stages),
                           max_lora_rank=max(s.max_lora_rank for s in stages))

    def connector_for(self, role: str) -> ConnectorSpec:
        """The connector a worker of ``role`` uses: the one on the edge into or out of its stage."""
        stage = self.stage_for_role(role)
        for edge in self.edges:
            if stage.name in (edge.source, edge.target):
                return self.connectors[edge.connector]
        raise PipelineError(f"stage {stage.name!r} has no edge, so no connector")


def default_llm_pipeline(connector_type: str = "shared_memory", options: dict | None = None) -> Pipeline:
    """prefill → decode over one connector: what ``omni-serve`` runs for a causal LM."""
    return parse_pipeline({
        "stages": [{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": connector_type, "options": options or {}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}],
    })


def load_pipeline(path: str | Path) -> Pipeline:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise PipelineError(f"cannot read pipeline file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse_pipeline(raw)
    except PipelineError as exc:
        raise PipelineError(f"{path}: {exc}") from None


def parse_pipeline(raw: Any) -> Pipeline:
    """Validate a parsed pipeline document, in this schema or in vLLM-Omni's legacy one."""
    if isinstance(raw, dict) and "stage_args" in raw:
        from .legacy_stages import translate_legacy
        translated, notes = translate_legacy(raw)
        for note in notes:
            log.info("legacy stage config: %s", note)
        return _parse_native(translated)
    return _parse_native(raw)


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise PipelineError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _only(entry: dict, allowed: set[str], where: str) -> None:
    unknown = set(entry) - allowed
    if unknown:
        raise PipelineError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _devices(value: Any, where: str) -> tuple[str, ...]:
    """``"0,1"``, ``[0, 1]`` or ``0`` → ``("0", "1")``; ids must be unique non-negative integers."""
    if isinstance(value, bool):
        raise PipelineError(f"{where}: expected device ids like \"0,1\", got {value!r}")
    if isinstance(value, int):
        items = [str(value)]
    elif isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
    elif isinstance(value, list):
        items = [str(item).strip() for item in value]
    else:
        raise PipelineError(f"{where}: expected device ids like \"0,1\", got {type(value).__name__}")
    if not items or not all(item.isdigit() for item in items):
        raise PipelineError(f"{where}: expected device ids like \"0,1\", got {value!r}")
    if len(set(items)) != len(items):
        raise PipelineError(f"{where}: device ids repeat in {value!r}")
    return tuple(items)


def _lora(engine_args: dict, role: str, where: str) -> LoraOptions | None:
    """A stage's LoRA keys as omni-worker's flags would give them; None without ``enable_lora: true``."""
    given = [key for key in LORA_KEYS if key in engine_args]
    if not given:
        return None
    if role not in ("prefill", "decode"):
        raise PipelineError(f"{where}.{given[0]}: only prefill and decode stages serve LoRA adapters, not {role}")
    enable = engine_args.get("enable_lora", False)
    if not isinstance(enable, bool):
        raise PipelineError(f"{where}.enable_lora: must be true or false, got {enable!r}")
    if not enable:
        others = [key for key in given if key != "enable_lora"]
        if others:
            raise PipelineError(f"{where}.{others[0]}: needs enable_lora: true")
        return None
    entries = engine_args.get("lora_modules", [])
    if not isinstance(entries, list):
        raise PipelineError(f"{where}.lora_modules: expected a list of name=path strings or {{name, path}} maps")
    modules = []
    for j, entry in enumerate(entries):
        try:
            if isinstance(entry, dict):
                entry = json.dumps(entry)
            elif not isinstance(entry, str):
                raise ValueError(f"expected name=path or a {{name, path}} map, got {entry!r}")
            modules.append(parse_module(entry))
        except ValueError as exc:
            raise PipelineError(f"{where}.lora_modules[{j}]: {str(exc).removeprefix('--lora-modules: ')}") from None
    if len({m.name for m in modules}) != len(modules):
        raise PipelineError(f"{where}.lora_modules: a name is given twice: {[m.name for m in modules]}")
    limits = {}
    for key, default, least in (("max_loras", 1, 1), ("max_lora_rank", 16, 1), ("max_cpu_loras", 0, 0)):
        value = engine_args.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise PipelineError(f"{where}.{key}: must be an integer >= {least}, got {value!r}")
        limits[key] = value
    return LoraOptions(modules=tuple(modules), **limits)


def _speculative(engine_args: dict, role: str, where: str) -> SpeculativeConfig | None:
    """A decode stage's ``speculative_config`` as ``--speculative-config`` would give it."""
    if engine_args.get("speculative_config") is None:
        return None
    if role != "decode":
        raise PipelineError(f"{where}.speculative_config: only decode stages speculate, not {role}")
    try:
        return speculative_from_mapping(engine_args["speculative_config"])
    except ValueError as exc:
        raise PipelineError(f"{where}.{exc}") from None


def _check_lora_paths(stages: list[Stage]) -> None:
    """One adapter name, one directory, across the stages (the gateway serves it once)."""
    paths: dict[str, tuple[str, str]] = {}
    for stage in stages:
        for module in stage.lora.modules if stage.lora is not None else ():
            seen = paths.setdefault(module.name, (module.path, stage.name))
            if seen[0] != module.path:
                raise PipelineError(f"stage {stage.name!r}: LoRA adapter {module.name!r} is {module.path}, "
                                    f"but {seen[0]} in stage {seen[1]!r}")


def _parse_native(raw: Any) -> Pipeline:
    raw = _mapping(raw, "pipeline")
    _only(raw, {"model", "stages", "connectors", "edges", "reasoning_parser"}, "pipeline")
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise PipelineError("stages: expected a non-empty list")
    stages: list[Stage] = []
    for i, entry in enumerate(stages_raw):
        where = f"stages[{i}]"
        entry = _mapping(entry, where)
        _only(entry, {"name", "role", "runtime", "engine_args"}, where)
        role = entry.get("role")
        if role not in ROLES:
            raise PipelineError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        name = entry.get("name", role)
        if not isinstance(name, str) or not name:
            raise PipelineError(f"{where}.name: must be a non-empty string")
        if any(s.name == name for s in stages):
            raise PipelineError(f"{where}.name: duplicate stage name {name!r}")
        runtime = _mapping(entry.get("runtime", {}), f"{where}.runtime")
        _only(runtime, {"max_batch_size", "devices", "stream_chunk_tokens"}, f"{where}.runtime")
        chunk_tokens = runtime.get("stream_chunk_tokens", DEFAULT_STREAM_CHUNK_TOKENS if role == "decode" else 0)
        if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 0:
            raise PipelineError(f"{where}.runtime.stream_chunk_tokens: must be a non-negative integer")
        if chunk_tokens and role != "decode":
            raise PipelineError(f"{where}.runtime.stream_chunk_tokens: only decode streams its hand-off, not {role}")
        batch = runtime.get("max_batch_size", 1 if role == "generate" else 0)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise PipelineError(f"{where}.runtime.max_batch_size: must be a non-negative integer")
        engine_args = _mapping(entry.get("engine_args", {}), f"{where}.engine_args")
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "sequence_parallel_size"):
            if key in engine_args:
                _positive_int(engine_args[key], f"{where}.engine_args.{key}")
        if engine_args.get("kv_transfer", "auto") not in ("auto", "layerwise", "whole"):
            raise PipelineError(f"{where}.engine_args.kv_transfer: must be 'auto', 'layerwise' or 'whole', "
                                f"got {engine_args['kv_transfer']!r}")
        if not isinstance(engine_args.get("enable_expert_parallel", False), bool):
            raise PipelineError(f"{where}.engine_args.enable_expert_parallel: must be true or false")
        if engine_args.get("enable_expert_parallel") and role not in ("prefill", "decode"):
            raise PipelineError(f"{where}.engine_args.enable_expert_parallel: only prefill and decode stages run a "
                                f"language model's experts, not {role}")
        if engine_args.get("sequence_parallel_size", 1) != 1 and role != "generate":
            raise PipelineError(f"{where}.engine_args.sequence_parallel_size: only generate stages (diffusion "
                                f"transformers) run sequence parallelism, not {role}")
        stage = Stage(name=name, role=role, max_batch_size=batch, engine_args=dict(engine_args),
                      stream_chunk_tokens=chunk_tokens, lora=_lora(engine_args, role, f"{where}.engine_args"),
                      speculative=_speculative(engine_args, role, f"{where}.engine_args"),
                      devices=_devices(runtime["devices"], f"{where}.runtime.devices") if "devices" in runtime
                      else ())
        if stage.devices and len(stage.devices) != stage.group_size:
            raise PipelineError(
                f"{where}.runtime.devices: {len(stage.devices)} device(s) {','.join(stage.devices)} but "
                f"tensor_parallel_size {stage.tensor_parallel_size} × pipeline_parallel_size "
                f"{stage.pipeline_parallel_size}"
                + (f" × sequence_parallel_size {stage.sequence_parallel_size}" if stage.sequence_parallel_size > 1
                   else "") + f" = {stage.group_size}")
        stages.append(stage)
    _check_lora_paths(stages)

    connectors: dict[str, ConnectorSpec] = {}
    for name, entry in _mapping(raw.get("connectors", {}), "connectors").items():
        where = f"connectors.{name}"
        entry = _mapping(entry, where)
        _only(entry, {"type", "options"}, where)
        kind = entry.get("type")
        if not isinstance(kind, str) or not kind:
            raise PipelineError(f"{where}.type: must name a connector backend")
        connectors[name] = ConnectorSpec(name=name, type=kind, options=dict(_mapping(entry.get("options", {}),
                                                                                    f"{where}.options")))
    names = {s.name for s in stages}
    edges: list[Edge] = []
    edges_raw = raw.get("edges", [])
    if not isinstance(edges_raw, list):
        raise PipelineError("edges: expected a list")
    for i, entry in enumerate(edges_raw):
        where = f"edges[{i}]"
        entry = _mapping(entry, where)
        _only(entry, {"from", "to", "connector"}, where)
        for key in ("from", "to"):
            if entry.get(key) not in names:
                raise PipelineError(f"{where}.{key}: unknown stage {entry.get(key)!r} (stages: {sorted(names)})")
        if entry.get("connector") not in connectors:
            raise PipelineError(f"{where}.connector: unknown connector {entry.get('connector')!r} "
                                f"(connectors: {sorted(connectors)})")
        edges.append(Edge(source=entry["from"], target=entry["to"], connector=entry["connector"]))
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        raise PipelineError("model: must be a string")
    reasoning = raw.get("reasoning_parser")
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise PipelineError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, got {reasoning!r}")
    return Pipeline(stages=tuple(stages), connectors=connectors, edges=tuple(edges), model=model,
                    reasoning_parser=reasoning)
