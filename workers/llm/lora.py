"""LoRA adapters for the compact engine: PEFT's files read and checked, and the slots that hold them.

An adapter is a local directory as PEFT writes it: ``adapter_config.json`` (``peft_type`` LORA,
``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`` (A ``[r, in]``,
B ``[out, r]``; ``model.language_model.layers`` for an omni thinker's adapter, as peft names them
on transformers' thinker class). Targets are the q/k/v/o attention and gate/up/down MLP
projections. The scale is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
:func:`load_adapter` checks
everything against the base model's shapes and the rank limit when the adapter is registered, so a
bad adapter is an error at load (:class:`LoraError`, naming the file and what is wrong), never at
the first request. Options that change the math in ways not served here (DoRA, per-module rank or
alpha patterns, biases, modules_to_save, fan_in_fan_out) are refused by name.

:class:`LoraSlots` holds ``max_loras`` adapters resident at once, stacked per fused linear of each
layer (``qkv``, ``o``, ``gate_up``, ``down``): A ``[slots, parts * max_rank, in]`` and B
``[slots, out, parts * max_rank]``, zero padded, the scale folded into B. A q/k/v (or gate/up)
adapter occupies its own rank rows of A and its own output rows of B, so one pair of matmuls per
adapter serves the fused matmul's whole output. Adapters are loaded into a slot on demand and the
least recently used one not needed by the current step is evicted; a CPU cache keeps the last
``max_cpu_loras`` adapters read, so a re-load does not read the disk.

How a step uses it: the engine gives each sequence's adapter name (``""``: the base) to
:meth:`LoraSlots.token_slots`, which returns the per-token slot index ``[T]`` (``-1``: base) the
batch carries (``ForwardBatch.lora_slots``). The model then adds, beside each base matmul, the
LoRA term of every adapter segment: tokens grouped by slot once per step (:meth:`LoraSlots.groups`),
one ``(x @ A.T) @ B.T`` per adapter present in the step (a loop over adapters, never over tokens),
added back with ``index_add_``. A batch without adapters carries no slots and runs the base path
unchanged.

Tensor parallelism: each rank's stacks hold its shard of every adapter, cut as the base weights
are (:func:`write_slot`). The column-parallel projections (q/k/v, gate/up) keep all of A and their
rows of B (the output rows the rank computes); the row-parallel ones (o, down) keep their columns
of A (the input the rank holds) and all of B, so their LoRA term is a partial sum that the layer's
all-reduce adds up with the base's. Rank 0's :class:`LoraSlots` decides which adapter goes in which
slot and tells the other ranks (``peers``: the group runner's LOAD_LORA), whose :class:`RankSlots`
read the same adapter and write their shard into the same slot; the batch's ``lora_slots`` travel
to them with the step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

# PEFT's target module → (the compact model's fused linear, which part of it).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
_KEY = re.compile(r"^base_model\.model\.model\.(?:language_model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json options that would change the math; refused unless at their neutral value.
_NEUTRAL = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
            "fan_in_fan_out": False, "layers_to_transform": None, "target_parameters": None}


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and what is wrong."""


@dataclasses.dataclass
class LoraAdapter:
    """One adapter's weights on the CPU: ``weights[(layer, target)] = (A [r, in], B [out, r] * scale)``."""

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each target in an unsharded layer of ``config`` (a LlamaConfig)."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def load_adapter(name: str, path: str | Path, config, *, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at ``path`` for a base of ``config``; :class:`LoraError` if bad."""
    path = Path(path)
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise LoraError(f"LoRA adapter {name!r}: {f} is missing")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise LoraError(f"LoRA adapter {name!r}: {cfg_file} is not JSON: {exc}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key, neutral in _NEUTRAL.items():
        if raw.get(key, neutral) not in (neutral, None, {}, []):
            raise LoraError(f"LoRA adapter {name!r}: {key}={raw[key]!r} is not supported")
    if raw.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {name!r}: bias={raw['bias']!r} is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"LoRA adapter {name!r}: r and lora_alpha must be numbers (r >= 1), got {rank!r}, {alpha!r}")
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(set(targets) - set(TARGETS))
    if unsupported:
        raise LoraError(f"LoRA adapter {name!r}: target modules {unsupported} are not supported "
                        f"(supported: {', '.join(TARGETS)})")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    shapes = _shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = collections.defaultdict(dict)
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None or m.group(2) not in TARGETS:
                raise LoraError(f"LoRA adapter {name!r}: tensor {key} is not a supported LoRA weight")
            layer, target, half = int(m.group(1)), m.group(2), m.group(3)
            if layer >= config.num_layers:
                raise LoraError(f"LoRA adapter {name!r}: {key} names layer {layer}; the base has {config.num_layers}")
            if target in ("gate_proj", "up_proj", "down_proj") and config.moe is not None and config.moe.is_sparse(layer):
                raise LoraError(f"LoRA adapter {name!r}: {key}: LoRA on MoE experts is not supported")
            halves[(layer, target)][half] = f.get_tensor(key).to(torch.float32)
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        n_in, n_out = shapes[target]
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {target}: A {tuple(a.shape)} / B {tuple(b.shape)} "
                            f"do not fit the base (expected A ({rank}, {n_in}), B ({n_out}, {rank}))")
        weights[(layer, target)] = (a, b * scaling)
    if not weights:
        raise LoraError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoraAdapter(name, path, rank, scaling, weights)


_ROW_PARALLEL = ("o_proj", "down_proj")   # input sharded across tensor ranks; the rest shard their output


def _layout(model) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(in, out) of each target on this rank of ``model`` (its tensor shard), and each target's
    row offset inside its fused linear's output (q, k, v; gate, up)."""
    tp = model.shard.tp_size
    shapes = {target: (n_in // tp, n_out) if target in _ROW_PARALLEL else (n_in, n_out // tp)
              for target, (n_in, n_out) in _shapes(model.config).items()}
    offsets = {"q_proj": 0, "k_proj": shapes["q_proj"][1], "v_proj": shapes["q_proj"][1] + shapes["k_proj"][1],
               "o_proj": 0, "gate_proj": 0, "up_proj": shapes["gate_proj"][1], "down_proj": 0}
    return shapes, offsets


def attach_stacks(model, max_loras: int, max_rank: int) -> None:
    """Zeroed slot stacks (``layer.lora``) on every layer ``model`` holds, sized for its shard."""
    shapes, _ = _layout(model)
    fused_in = {"qkv": shapes["q_proj"][0], "o": shapes["o_proj"][0], "gate_up": shapes["gate_proj"][0],
                "down": shapes["down_proj"][0]}
    fused_out = {"qkv": shapes["q_proj"][1] + 2 * shapes["k_proj"][1], "o": shapes["o_proj"][1],
                 "gate_up": 2 * shapes["gate_proj"][1], "down": shapes["down_proj"][1]}
    for layer in model.layers:
        layer.lora = {}
        for fused, parts in _PARTS.items():
            if fused in ("gate_up", "down") and layer.gate_up is None:
                continue   # a sparse MoE layer: experts carry no LoRA
            width = parts * max_rank
            layer.lora[fused] = (torch.zeros(max_loras, width, fused_in[fused], dtype=model.dtype, device=model.device),
                                 torch.zeros(max_loras, fused_out[fused], width, dtype=model.dtype, device=model.device))


def write_slot(model, slot: int, adapter: LoraAdapter, max_rank: int) -> None:
    """This rank's shard of ``adapter`` into ``slot`` of ``model``'s stacks (the rest zeroed): B's
    rows of a column-parallel target, A's columns of a row-parallel one, cut as the base weights are."""
    shapes, offsets = _layout(model)
    rank, first = model.shard.tp_rank, model.layer_ids.start
    for index, layer in enumerate(model.layers):
        for a_stack, b_stack in layer.lora.values():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
        for (layer_id, target), (a, b) in adapter.weights.items():
            if layer_id != first + index:
                continue
            n_in, n_out = shapes[target]
            if target in _ROW_PARALLEL:
                a = a[:, rank * n_in:(rank + 1) * n_in]
            else:
                b = b[rank * n_out:(rank + 1) * n_out]
            fused, part = TARGETS[target]
            a_stack, b_stack = layer.lora[fused]
            rows = slice(part * max_rank, part * max_rank + adapter.rank)
            out = slice(offsets[target], offsets[target] + n_out)
            a_stack[slot, rows] = a.to(a_stack.device, a_stack.dtype)
            b_stack[slot, out, rows] = b.to(b_stack.device, b_stack.dtype)


def groups(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(slot, rows)`` of each adapter present in a step: its tokens' rows in the packed batch."""
    order = torch.argsort(token_slots, stable=True)
    values, counts = torch.unique_consecutive(token_slots.index_select(0, order), return_counts=True)
    out, start = [], 0
    for slot, n in zip(values.tolist(), counts.tolist()):
        if slot >= 0:
            out.append((slot, order[start:start + n]))
        start += n
    return out


class RankSlots:
    """The slot stacks of a tensor or pipeline rank other than 0: it loads what rank 0's
    :class:`LoraSlots` chose, into the same slot (:meth:`load`); attaches itself as ``model.lora``."""

    groups = staticmethod(groups)

    def __init__(self, model, max_loras: int, max_rank: int):
        self.model, self.max_rank = model, max_rank
        attach_stacks(model, max_loras, max_rank)
        model.lora = self

    def load(self, slot: int, name: str, path: str) -> None:
        write_slot(self.model, slot, load_adapter(name, path, self.model.config, max_rank=self.max_rank),
                   self.max_rank)


class LoraSlots:
    """The adapters of one model: ``modules`` (name → directory) are checked at construction;
    up to ``max_loras`` are resident in the model's slot stacks at once. Attaches itself to
    ``model`` (``model.lora``). ``peers(slot, name, path)``: for rank 0 of a parallel group, makes
    the other ranks load the adapter into the same slot (their shards; None: a single process)."""

    groups = staticmethod(groups)

    def __init__(self, model, modules: dict[str, str], *, max_loras: int = 1, max_rank: int = 16,
                 max_cpu_loras: int | None = None, peers: Callable[[int, str, str], None] | None = None):
        if max_loras < 1 or max_rank < 1:
            raise LoraError(f"--max-loras and --max-lora-rank must be at least 1, got {max_loras}, {max_rank}")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.peers = peers
        self.paths: dict[str, Path] = {}
        self._cpu: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()   # LRU first
        self._resident: collections.OrderedDict[str, int] = collections.OrderedDict()       # name → slot, LRU first
        self.stats = collections.Counter()
        attach_stacks(model, max_loras, max_rank)
        for name, path in modules.items():
            self.register(name, path)
        model.lora = self

    # ------------------------------------------------------------------ registry

    def register(self, name: str, path: str | Path) -> None:
        """Add (or replace) adapter ``name``; it is read and checked now (:class:`LoraError`)."""
        if not name:
            raise LoraError("a LoRA adapter needs a name")
        adapter = load_adapter(name, path, self.model.config, max_rank=self.max_rank)
        self.unregister(name)
        self.paths[name] = Path(path)
        self._cache(adapter)

    def ensure(self, name: str, path: str = "") -> str:
        """Make adapter ``name`` known, registering ``path`` (a request's, from a gateway that
        loaded it at run time) when it is new or differs; "" when ready, else why not."""
        if name in self.paths and (not path or Path(path) == self.paths[name]):
            return ""
        if not path:
            return f"LoRA adapter {name!r} is not loaded on this worker"
        try:
            self.register(name, path)
        except LoraError as exc:
            return str(exc)
        return ""

    def unregister(self, name: str) -> bool:
        self._cpu.pop(name, None)
        self._resident.pop(name, None)   # its slot is free again; its rows are overwritten on reuse
        return self.paths.pop(name, None) is not None

    def _cache(self, adapter: LoraAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    # ------------------------------------------------------------------ slots

    @property
    def resident(self) -> list[str]:
        """Adapters in slots now, least recently used first."""
        return list(self._resident)

    def held(self, requested: set[str]) -> list[str]:
        """What the worker reports holding (the broker's adapter affinity): the resident adapters,
        least recently used first, then those ``requested`` by the requests it holds."""
        return [*self._resident, *sorted(requested - self._resident.keys() - {""})]

    def fits(self, name: str, running: set[str]) -> bool:
        """Whether a sequence of adapter ``name`` may join sequences of adapters ``running`` (one
        step never needs more than ``max_loras`` adapters)."""
        return not name or name in running or len(running - {""}) < self.max_loras

    def slot(self, name: str, busy: set[str]) -> int:
        """The slot holding ``name``, loading it (evicting the least recently used adapter not in
        ``busy``) when it is not resident."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return self._resident[name]
        if name not in self.paths:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((n for n in self._resident if n not in busy), None)
            if victim is None:
                raise LoraError(f"all {self.max_loras} LoRA slots are in use by this step")
            slot = self._resident.pop(victim)
            self.stats["lora_evictions"] += 1
        adapter = self._cpu.get(name)
        if adapter is None:
            adapter = load_adapter(name, self.paths[name], self.model.config, max_rank=self.max_rank)
            self.stats["lora_disk_loads"] += 1
        self._cache(adapter)
        write_slot(self.model, slot, adapter, self.max_rank)
        if self.peers is not None:
            self.peers(slot, name, str(self.paths[name]))
        self._resident[name] = slot
        self.stats["lora_loads"] += 1
        return slot

    def token_slots(self, names: list[str], counts: list[int]) -> torch.Tensor | None:
        """Per-token slot index ``[sum(counts)]`` for sequences of adapters ``names`` (``""``: base,
        slot -1) with ``counts`` new tokens each; None when no sequence has an adapter."""
        if not any(names):
            return None
        busy = set(names) - {""}
        slots = [self.slot(n, busy) if n else -1 for n in names]
        return torch.repeat_interleave(torch.tensor(slots, dtype=torch.long), torch.tensor(counts, dtype=torch.long))


def apply(layer, fused: str, x: torch.Tensor, y: torch.Tensor, groups) -> torch.Tensor:
    """``y`` (the base output of ``layer``'s ``fused`` linear on ``x``) plus each adapter
    segment's LoRA term: one ``(x A^T) B^T`` per adapter in the step."""
    stacks = getattr(layer, "lora", None)
    if not groups or not stacks or fused not in stacks:
        return y
    a, b = stacks[fused]
    for slot, rows in groups:
        xs = x.index_select(0, rows)
        y.index_add_(0, rows, (xs @ a[slot].T) @ b[slot].T)
    return y
