"""The stage-pipeline schema: which stages a model's requests pass and how data moves between them.

A pipeline file (YAML) looks like::

    model: tiny-llm                 # optional: the served name this pipeline belongs to
    stages:
      - name: prefill               # unique; requests pass stages in this order
        role: prefill               # encode | prefill | decode | generate
        runtime: {max_batch_size: 8}
        engine_args: {}             # passed to the role's engine (dtype, tensor_parallel_size, …)
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
role's engine default otherwise.

:func:`load_pipeline` validates everything and raises :class:`PipelineError` whose message names the
offending entry (``stages[1].role: …``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

ROLES = ("encode", "prefill", "decode", "generate")


class PipelineError(ValueError):
    """The pipeline file is invalid; the message points at the offending entry."""


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    role: str
    max_batch_size: int
    engine_args: dict[str, Any]


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

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(stage.role for stage in self.stages)

    def stage_for_role(self, role: str) -> Stage:
        for stage in self.stages:
            if stage.role == role:
                return stage
        raise PipelineError(f"the pipeline has no stage with role {role!r}")

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


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise PipelineError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _only(entry: dict, allowed: set[str], where: str) -> None:
    unknown = set(entry) - allowed
    if unknown:
        raise PipelineError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")


def parse_pipeline(raw: Any) -> Pipeline:
    raw = _mapping(raw, "pipeline")
    _only(raw, {"model", "stages", "connectors", "edges"}, "pipeline")
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
        _only(runtime, {"max_batch_size"}, f"{where}.runtime")
        batch = runtime.get("max_batch_size", 1 if role == "generate" else 0)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise PipelineError(f"{where}.runtime.max_batch_size: must be a non-negative integer")
        engine_args = _mapping(entry.get("engine_args", {}), f"{where}.engine_args")
        stages.append(Stage(name=name, role=role, max_batch_size=batch, engine_args=dict(engine_args)))

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
    return Pipeline(stages=tuple(stages), connectors=connectors, edges=tuple(edges), model=model)
