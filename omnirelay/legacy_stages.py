"""vLLM-Omni's legacy stage config (``stage_args``) → the omnirelay pipeline schema.

The legacy document, as vLLM-Omni's ``stage_configs/*.yaml`` write it::

    stage_args:
      - stage_id: 0                     # unique integer
        stage_type: llm                 # llm (default) | diffusion
        is_prefill_only: true           # optional: the prefill half of a PD-split llm stage
        is_decode_only: false           #           the decode half
        runtime: {devices: "0", max_batch_size: 8, process: true}
        engine_args: {model_stage: thinker, tensor_parallel_size: 1, gpu_memory_utilization: 0.8, …}
        engine_input_source: [0]        # upstream stage ids
        input_connectors: {from_stage_0: conn_a}
        output_connectors: {to_stage_2: conn_a}
        final_output: true              # vLLM-internal keys (sampling defaults, processors, …): dropped
    runtime:
      connectors:
        conn_a: {name: MooncakeStoreConnector, extra: {master: "10.0.0.1:50051", …}}
      edges:
        - {from: 0, to: 1, window_size: -1}

How it translates (:func:`translate_legacy`):

* **Roles.** ``stage_type: diffusion`` → ``generate``. An ``llm`` stage is ``prefill`` with
  ``is_prefill_only``, ``decode`` with ``is_decode_only``, ``generate`` when it produces media or
  codec codes (``model_stage`` talker/code2wav/token2wav/dit/vae, ``worker_type: generation`` or an
  ``engine_output_type`` of audio/image/video), ``encode`` for an encoder ``model_stage``; any other
  ``llm`` stage (a thinker, a plain LM) runs whole in vLLM and becomes our ``prefill`` → ``decode``
  pair ``NAME-prefill`` → ``NAME-decode`` joined by a shared-memory connector.
* **Generate chains.** Consecutive generate stages (talker → code2wav) become one ``generate``
  stage, since our generate worker runs talker and vocoder together; ``engine_args.components``
  lists the merged ``model_stage`` names.
* **Names.** ``MODEL_STAGE-ID`` (``thinker-0``), or ``stage-ID`` without a ``model_stage``.
* **Edges.** ``runtime.edges`` plus every ``engine_input_source`` entry; stages are ordered
  topologically (ties by ``stage_id``).
* **Connectors.** An edge A → B uses ``output_connectors.to_stage_B`` of A or
  ``input_connectors.from_stage_A`` of B (both given: they must agree), else shared memory (vLLM-Omni's
  default too). Backend class names map to ours: SharedMemoryConnector → ``shared_memory``,
  MooncakeConnector/MooncakeStoreConnector → ``mooncake_store``, MooncakeTransferEngineConnector →
  ``mooncake_transfer_engine``, RedisConnector → ``redis``, YuanrongConnector → ``yuanrong``; our own
  type names are accepted as they are. ``extra`` becomes ``options``, with Mooncake's keys renamed
  (``host`` → ``local_hostname``, ``proto`` → ``protocol``, ``segment``/``localbuf`` bytes →
  ``segment_mb``/``local_buffer_mb``) and Yuanrong's ``host`` and ``port`` joined as ``address``.
* **Engine args kept:** dtype, tensor/pipeline parallel size, gpu_memory_utilization,
  max_model_len; ``max_num_seqs`` becomes ``runtime.max_batch_size`` where that is not set;
  ``model_stage`` becomes ``engine_args.component``. The rest is vLLM-specific and dropped, each
  drop reported in the notes :func:`translate_legacy` returns.

Every error names the legacy entry (``stage_args[1].engine_input_source[0]: unknown stage id 7``).
"""

from __future__ import annotations

import math
from typing import Any

from .pipeline import ROLES, PipelineError, _devices, _mapping, _positive_int

STAGE_TYPES = ("llm", "diffusion")
GENERATE_MODEL_STAGES = ("talker", "code2wav", "token2wav", "dit", "vae", "vocoder")
ENCODE_MODEL_STAGES = ("encoder", "encode", "vision_encoder", "audio_encoder")
MEDIA_OUTPUTS = ("audio", "image", "video")
KEPT_ENGINE_ARGS = ("dtype", "tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization",
                    "max_model_len", "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")
STAGE_KEYS = {"stage_id", "stage_type", "is_prefill_only", "is_decode_only", "runtime", "engine_args",
              "engine_input_source", "input_connectors", "output_connectors"}
# Keys vLLM-Omni reads and omnirelay has no use for (its roles know their own handoff and sampling).
VLLM_ONLY_STAGE_KEYS = {"final_output", "final_output_type", "is_comprehension", "default_sampling_params",
                        "custom_process_input_func", "custom_process_next_stage_input_func",
                        "async_chunk_process_next_stage_input_func", "requires_multimodal_data",
                        "tts_args", "model", "numa_bind", "numa_bind_nodes", "numa_bind_cpus"}
CONNECTOR_CLASSES = {
    "SharedMemoryConnector": "shared_memory",
    "MooncakeConnector": "mooncake_store",
    "MooncakeStoreConnector": "mooncake_store",
    "MooncakeTransferEngineConnector": "mooncake_transfer_engine",
    "RedisConnector": "redis",
    "YuanrongConnector": "yuanrong",
}
OWN_CONNECTOR_TYPES = ("shared_memory", "redis", "mooncake_store", "mooncake_transfer_engine", "yuanrong")
DEFAULT_CONNECTOR = "default_shared_memory"   # the implicit connector of edges that name none


def translate_legacy(raw: dict) -> tuple[dict, list[str]]:
    """Translate a legacy document into the native schema's raw form; returns it and notes on
    what was dropped or merged. Raises :class:`PipelineError` naming the legacy entry."""
    notes: list[str] = []
    for key in sorted(set(raw) - {"stage_args", "runtime", "model"}):
        notes.append(f"{key}: vLLM-Omni pipeline setting, ignored")
    stages_raw = raw.get("stage_args")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise PipelineError("stage_args: expected a non-empty list")
    runtime = _mapping(raw.get("runtime") or {}, "runtime")
    connectors = _connectors(runtime.get("connectors") or {}, notes)
    stages = {}
    for i, entry in enumerate(stages_raw):
        stage = _LegacyStage.parse(entry, f"stage_args[{i}]", notes)
        if stage.stage_id in stages:
            raise PipelineError(f"stage_args[{i}].stage_id: duplicate stage id {stage.stage_id} "
                                f"(also {stages[stage.stage_id].where})")
        stages[stage.stage_id] = stage
    edges = _edges(runtime.get("edges"), stages)
    order = _topological(stages, edges)
    edge_connectors = {edge: _edge_connector(edge, stages, connectors) for edge in edges}
    out_stages, out_edges = _expand(order, stages, edges, edge_connectors, notes)
    used = {connector for _, _, connector in out_edges}
    if DEFAULT_CONNECTOR in used and DEFAULT_CONNECTOR not in connectors:
        connectors[DEFAULT_CONNECTOR] = {"type": "shared_memory", "options": {}}
    document = {
        "stages": out_stages,
        "connectors": {name: spec for name, spec in connectors.items() if name in used},
        "edges": [{"from": a, "to": b, "connector": c} for a, b, c in out_edges],
    }
    if "model" in raw:
        document["model"] = raw["model"]
    return document, notes


class _LegacyStage:
    def __init__(self, stage_id: int, where: str, role: str | None, name: str, runtime: dict,
                 engine_args: dict, sources: list[int], inputs: dict[int, str], outputs: dict[int, str]):
        self.stage_id, self.where, self.role, self.name = stage_id, where, role, name
        self.runtime, self.engine_args = runtime, engine_args
        self.sources, self.inputs, self.outputs = sources, inputs, outputs

    @classmethod
    def parse(cls, entry: Any, where: str, notes: list[str]) -> "_LegacyStage":
        entry = _mapping(entry, where)
        unknown = set(entry) - STAGE_KEYS - VLLM_ONLY_STAGE_KEYS
        if unknown:
            raise PipelineError(f"{where}: unknown keys {sorted(unknown)} (vLLM-Omni stage keys: "
                                f"{sorted(STAGE_KEYS)})")
        dropped = sorted(set(entry) & VLLM_ONLY_STAGE_KEYS)
        if dropped:
            notes.append(f"{where}: vLLM-specific keys dropped: {', '.join(dropped)}")
        if "stage_id" not in entry:
            raise PipelineError(f"{where}.stage_id: missing")
        stage_id = entry["stage_id"]
        if not isinstance(stage_id, int) or isinstance(stage_id, bool) or stage_id < 0:
            raise PipelineError(f"{where}.stage_id: must be a non-negative integer, got {stage_id!r}")
        engine_raw = _mapping(entry.get("engine_args") or {}, f"{where}.engine_args")
        role = _role(entry, engine_raw, where)
        component = engine_raw.get("model_stage")
        if component is not None and (not isinstance(component, str) or not component):
            raise PipelineError(f"{where}.engine_args.model_stage: must be a non-empty string")
        runtime_raw = _mapping(entry.get("runtime") or {}, f"{where}.runtime")
        runtime, engine_args = _stage_settings(runtime_raw, engine_raw, role, where, notes)
        if component:
            engine_args["component"] = component
        sources = _int_list(entry.get("engine_input_source", []), f"{where}.engine_input_source")
        inputs = _connector_refs(entry.get("input_connectors") or {}, "from_stage_", f"{where}.input_connectors")
        outputs = _connector_refs(entry.get("output_connectors") or {}, "to_stage_", f"{where}.output_connectors")
        return cls(stage_id, where, role, f"{component or 'stage'}-{stage_id}", runtime, engine_args,
                   sources, inputs, outputs)


def _role(entry: dict, engine_args: dict, where: str) -> str | None:
    """Our role for a legacy stage; ``None`` for a whole llm stage (it becomes prefill → decode)."""
    stage_type = entry.get("stage_type", "llm")
    if stage_type not in STAGE_TYPES:
        raise PipelineError(f"{where}.stage_type: must be one of {', '.join(STAGE_TYPES)}, got {stage_type!r}")
    prefill_only, decode_only = bool(entry.get("is_prefill_only")), bool(entry.get("is_decode_only"))
    if stage_type == "diffusion":
        if prefill_only or decode_only:
            raise PipelineError(f"{where}: a diffusion stage cannot be is_prefill_only/is_decode_only")
        return "generate"
    if prefill_only and decode_only:
        raise PipelineError(f"{where}: is_prefill_only and is_decode_only are both set")
    if prefill_only:
        return "prefill"
    if decode_only:
        return "decode"
    component = str(engine_args.get("model_stage", "")).lower()
    output_types = str(engine_args.get("engine_output_type", "")).lower().replace(",", "+").split("+")
    if (component in GENERATE_MODEL_STAGES or engine_args.get("worker_type") == "generation"
            or any(kind in MEDIA_OUTPUTS for kind in output_types)):
        return "generate"
    if component in ENCODE_MODEL_STAGES:
        return "encode"
    return None


def _stage_settings(runtime_raw: dict, engine_raw: dict, role: str | None, where: str,
                    notes: list[str]) -> tuple[dict, dict]:
    runtime: dict = {}
    for key, value in runtime_raw.items():
        if key == "max_batch_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PipelineError(f"{where}.runtime.max_batch_size: must be a non-negative integer")
            runtime[key] = value
        elif key == "devices":
            runtime[key] = ",".join(_devices(value, f"{where}.runtime.devices"))
        else:
            notes.append(f"{where}.runtime.{key}: vLLM-specific, dropped")
    engine_args = {key: engine_raw[key] for key in KEPT_ENGINE_ARGS if key in engine_raw}
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if key in engine_args:
            _positive_int(engine_args[key], f"{where}.engine_args.{key}")
    if "max_num_seqs" in engine_raw and "max_batch_size" not in runtime:
        runtime["max_batch_size"] = _positive_int(engine_raw["max_num_seqs"], f"{where}.engine_args.max_num_seqs")
    dropped = sorted(set(engine_raw) - set(KEPT_ENGINE_ARGS) - {"model_stage", "max_num_seqs"})
    if dropped:
        notes.append(f"{where}.engine_args: vLLM-specific keys dropped: {', '.join(dropped)}")
    if "devices" in runtime:
        devices = runtime["devices"].split(",")
        group = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
        if len(devices) != group:
            raise PipelineError(
                f"{where}.runtime.devices: {len(devices)} device(s) {runtime['devices']} but "
                f"tensor_parallel_size {engine_args.get('tensor_parallel_size', 1)} × pipeline_parallel_size "
                f"{engine_args.get('pipeline_parallel_size', 1)} = {group}")
    if role == "generate":
        runtime.setdefault("max_batch_size", 1)
    return runtime, engine_args


def _int_list(value: Any, where: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise PipelineError(f"{where}: expected a list of stage ids, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, int) or isinstance(item, bool):
            raise PipelineError(f"{where}[{i}]: expected a stage id (integer), got {item!r}")
    return list(value)


def _connector_refs(value: Any, prefix: str, where: str) -> dict[int, str]:
    refs: dict[int, str] = {}
    for key, name in _mapping(value, where).items():
        suffix = str(key)[len(prefix):] if str(key).startswith(prefix) else ""
        if not suffix.isdigit():
            raise PipelineError(f"{where}.{key}: keys are {prefix}N with N a stage id")
        if not isinstance(name, str) or not name:
            raise PipelineError(f"{where}.{key}: must name a connector of runtime.connectors")
        refs[int(suffix)] = name
    return refs


def _connectors(raw: Any, notes: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for key, entry in _mapping(raw, "runtime.connectors").items():
        where = f"runtime.connectors.{key}"
        entry = _mapping(entry, where)
        unknown = set(entry) - {"name", "extra"}
        if unknown:
            raise PipelineError(f"{where}: unknown keys {sorted(unknown)} (allowed: ['extra', 'name'])")
        cls = entry.get("name")
        kind = CONNECTOR_CLASSES.get(cls, cls if cls in OWN_CONNECTOR_TYPES else None)
        if kind is None:
            raise PipelineError(f"{where}.name: unsupported connector {cls!r} (supported: "
                                f"{', '.join(sorted(CONNECTOR_CLASSES) + list(OWN_CONNECTOR_TYPES))})")
        options = dict(_mapping(entry.get("extra") or {}, f"{where}.extra"))
        out[str(key)] = {"type": kind, "options": _options(kind, options, where, notes)}
    return out


def _options(kind: str, options: dict, where: str, notes: list[str]) -> dict:
    if kind == "shared_memory" and "shm_threshold_bytes" in options:
        options.pop("shm_threshold_bytes")
        notes.append(f"{where}.extra.shm_threshold_bytes: dropped (every payload goes through shared memory)")
    if kind == "yuanrong" and "host" in options and "port" in options:
        options["address"] = f"{options.pop('host')}:{options.pop('port')}"
    if kind.startswith("mooncake"):
        for old, new in (("host", "local_hostname"), ("proto", "protocol")):
            if old in options:
                options[new] = options.pop(old)
        for old, new in (("segment", "segment_mb"), ("localbuf", "local_buffer_mb")):
            if old in options:
                size = options.pop(old)
                if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                    raise PipelineError(f"{where}.extra.{old}: must be a positive number of bytes")
                if kind == "mooncake_store":
                    options[new] = math.ceil(size / (1 << 20))
                else:
                    notes.append(f"{where}.extra.{old}: not used by mooncake_transfer_engine, dropped")
    return options


def _edges(raw: Any, stages: dict[int, _LegacyStage]) -> list[tuple[int, int]]:
    edges: list[tuple[int, int]] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise PipelineError("runtime.edges: expected a list")
        for i, entry in enumerate(raw):
            where = f"runtime.edges[{i}]"
            entry = _mapping(entry, where)
            for key in ("from", "to"):
                if entry.get(key) not in stages:
                    raise PipelineError(f"{where}.{key}: unknown stage id {entry.get(key)!r} "
                                        f"(stage ids: {sorted(stages)})")
            edges.append((entry["from"], entry["to"]))
    for stage in stages.values():
        for i, source in enumerate(stage.sources):
            if source not in stages:
                raise PipelineError(f"{stage.where}.engine_input_source[{i}]: unknown stage id {source} "
                                    f"(stage ids: {sorted(stages)})")
            if (source, stage.stage_id) not in edges:
                edges.append((source, stage.stage_id))
    for a, b in edges:
        if a == b:
            raise PipelineError(f"{stages[a].where}: stage {a} feeds itself")
    return edges


def _topological(stages: dict[int, _LegacyStage], edges: list[tuple[int, int]]) -> list[int]:
    indegree = {sid: 0 for sid in stages}
    for _, b in edges:
        indegree[b] += 1
    order, ready = [], sorted(sid for sid, n in indegree.items() if n == 0)
    while ready:
        sid = ready.pop(0)
        order.append(sid)
        for a, b in edges:
            if a == sid:
                indegree[b] -= 1
                if indegree[b] == 0:
                    ready = sorted(ready + [b])
    if len(order) != len(stages):
        cycle = sorted(sid for sid in stages if sid not in order)
        raise PipelineError(f"runtime.edges: the stages {cycle} form a cycle")
    return order


def _edge_connector(edge: tuple[int, int], stages: dict[int, _LegacyStage], connectors: dict) -> str:
    a, b = edge
    out_name, in_name = stages[a].outputs.get(b), stages[b].inputs.get(a)
    if out_name and in_name and out_name != in_name:
        raise PipelineError(f"{stages[a].where}.output_connectors.to_stage_{b} is {out_name!r} but "
                            f"{stages[b].where}.input_connectors.from_stage_{a} is {in_name!r}")
    name = out_name or in_name
    if name is None:
        return DEFAULT_CONNECTOR
    if name not in connectors:
        where = (f"{stages[a].where}.output_connectors.to_stage_{b}" if out_name
                 else f"{stages[b].where}.input_connectors.from_stage_{a}")
        raise PipelineError(f"{where}: unknown connector {name!r} (runtime.connectors: {sorted(connectors)})")
    return name


def _check_refs(stages: dict[int, _LegacyStage], edges: list[tuple[int, int]]) -> None:
    for stage in stages.values():
        for target in stage.outputs:
            if (stage.stage_id, target) not in edges:
                raise PipelineError(f"{stage.where}.output_connectors.to_stage_{target}: no edge from stage "
                                    f"{stage.stage_id} to stage {target}")
        for source in stage.inputs:
            if (source, stage.stage_id) not in edges:
                raise PipelineError(f"{stage.where}.input_connectors.from_stage_{source}: no edge from stage "
                                    f"{source} to stage {stage.stage_id}")


def _expand(order: list[int], stages: dict[int, _LegacyStage], edges: list[tuple[int, int]],
            edge_connectors: dict, notes: list[str]):
    """Our stages and edges: whole llm stages split in two, generate chains merged."""
    _check_refs(stages, edges)
    out_stages: list[dict] = []
    first_of: dict[int, str] = {}   # legacy id → our stage that receives its inputs
    last_of: dict[int, str] = {}    # legacy id → our stage that sends its outputs
    internal: list[tuple[str, str, str]] = []
    by_name: dict[str, dict] = {}
    for sid in order:
        stage = stages[sid]
        upstream = [a for a, b in edges if b == sid]
        if stage.role == "generate" and len(upstream) == 1:
            prev = stages[upstream[0]]
            downstream_of_prev = [b for a, b in edges if a == prev.stage_id]
            if prev.role == "generate" and downstream_of_prev == [sid]:
                merged = by_name[last_of[prev.stage_id]]
                merged["engine_args"].setdefault("components", [merged["engine_args"].get("component", prev.name)])
                merged["engine_args"]["components"].append(stage.engine_args.get("component", stage.name))
                merged["engine_args"].pop("component", None)
                merged["runtime"]["max_batch_size"] = min(merged["runtime"].get("max_batch_size", 1),
                                                          stage.runtime.get("max_batch_size", 1))
                notes.append(f"{stage.where}: merged into generate stage {merged['name']!r} "
                             "(talker and vocoder run in one generate worker)")
                first_of[sid] = last_of[sid] = merged["name"]
                continue
        if stage.role is None:
            names = (f"{stage.name}-prefill", f"{stage.name}-decode")
            for name, role in zip(names, ("prefill", "decode")):
                entry = {"name": name, "role": role, "runtime": dict(stage.runtime),
                         "engine_args": dict(stage.engine_args)}
                out_stages.append(entry)
                by_name[name] = entry
            internal.append((names[0], names[1], DEFAULT_CONNECTOR))
            first_of[sid], last_of[sid] = names
            notes.append(f"{stage.where}: whole llm stage split into {names[0]!r} → {names[1]!r}")
        else:
            assert stage.role in ROLES
            entry = {"name": stage.name, "role": stage.role, "runtime": dict(stage.runtime),
                     "engine_args": dict(stage.engine_args)}
            out_stages.append(entry)
            by_name[stage.name] = entry
            first_of[sid] = last_of[sid] = stage.name
    out_edges = list(internal)
    for a, b in edges:
        source, target = last_of[a], first_of[b]
        if source != target:
            out_edges.append((source, target, edge_connectors[(a, b)]))
    return out_stages, out_edges
