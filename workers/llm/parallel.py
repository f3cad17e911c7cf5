"""Tensor and pipeline parallelism inside one worker's GPU group, over torch.distributed.

Ranks are real processes: rank 0 is the worker daemon itself (the only one that talks to the
broker and the connectors); it starts ranks 1..N-1 as child processes (``python -m
omnirelay.workers.llm.parallel ...``, settings on the command line, no pickle) and owns them: it stops
them on :meth:`GroupRunner.close` and the kernel kills them if rank 0 dies (PR_SET_PDEATHSIG).

Layout: ``world = tp * pp``; rank ``r`` is pipeline stage ``r // tp`` and tensor rank ``r % tp``.
A stage holds a contiguous layer range (:func:`layer_ranges`); a tensor rank holds its slice of the
query/KV heads and MLP columns, and its KV pool holds only those heads of its stage's layers. All
ranks use the same block ids: the allocator lives with the engine on rank 0.

Life of one engine call through the group (rank 0's :class:`GroupRunner`, the others'
:func:`serve_rank` loop)::

    rank 0: broadcast header [command, sizes] ──▶ broadcast payload (one flat int64 tensor)
    FORWARD:  every rank runs its shard; TP ranks all-reduce after o_proj and down_proj; stage s
              sends its hidden states to stage s + 1 (same tensor rank); the last stage's tensor
              rank 0 sends the logits to rank 0
    LOAD_LORA: rank 0's LoraSlots put an adapter in a slot; every rank reads it (``name``, ``path``)
              and writes its shard into the same slot (workers/llm/lora.py); a FORWARD then
              carries the batch's per-token slots after its other fields
    READ_KV:  each rank reads its layers × heads of the blocks and sends them to rank 0, which
              assembles the full-head KV (the connector payload is independent of sharding)
    WRITE_KV: rank 0 sends each rank its layers × heads of a full-head KV; each writes its pool
    STOP:     ranks leave the loop, destroy the process group and exit

Devices: rank ``r`` runs on ``GroupConfig.devices[r]`` (the CPU, or ``cuda:<id>`` from
``--devices``; :mod:`omnirelay.workers.runtime.devices`). On the CPU the group is one gloo process group. On
CUDA it is ``cpu:gloo,cuda:nccl``: torch.distributed picks the backend by the tensor's device, so
everything that carries model data (TP all-reduce, hidden states between stages, logits, KV shards)
goes over NCCL between the GPUs, while the command header and the step's integer payload stay CPU
tensors over gloo. Why keep those on gloo: idle ranks block in the header broadcast for as long as
the worker has no work, which NCCL would turn into a spinning kernel and a watchdog timeout; and the
payload arrives where the prefill planning reads it (host lists) without a device sync. Each rank
moves the payload to its device once per step.

Expert parallelism (``expert_parallel``, vLLM's ``--enable-expert-parallel``): a Qwen3-MoE stage's
tensor ranks also form its expert-parallel group; attention stays tensor-parallel, and each rank
holds a contiguous block of whole experts (:mod:`omnirelay.workers.llm.expert_parallel`), reached by
all-to-all over the same process group. Experts that do not divide by ``tp_size`` fail every
rank's start-up with :class:`~omnirelay.workers.llm.expert_parallel.ExpertPlacementError`.

A rank lost mid-step (killed, crashed): the collective on rank 0 raises (gloo sees the closed
connection at once; NCCL after the group's timeout) and :meth:`GroupRunner.forward` re-raises it as
:class:`~omnirelay.workers.runtime.rank_processes.ParallelGroupLost`, which is not a per-request error: it leaves the engine, the worker
runtime fails every request it holds as ``worker_lost`` (recoverable: another worker may serve
them) and the worker exits 1 for its supervisor to restart it.

KV pool size: with ``num_blocks`` 0 every rank measures its own budget after loading its weights
(:func:`~omnirelay.workers.runtime.devices.rank_kv_budget`), and the group takes the smallest block count
(all ranks use the same block ids); too small a pool on any rank fails every rank's start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from omnirelay.workers.runtime.devices import DEFAULT_GPU_MEMORY_UTILIZATION, KVBudgetError, blocks_in_budget, rank_kv_budget
from omnirelay.workers.llm.expert_parallel import check_expert_parallel
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.llm.lora import RankSlots
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm.models.llama import LlamaConfig, LlamaModel, Shard
from omnirelay.workers.runtime.process_group import join_world, leave_world
from omnirelay.workers.runtime.rank_processes import ParallelGroupLost, die_with_parent, reap_ranks

log = logging.getLogger("omnirelay.worker")

FORWARD, READ_KV, WRITE_KV, STOP, LOAD_LORA = 1, 2, 3, 4, 5
HEADER = 6
# Start-up and collectives inside a step are bounded (a rank that died surfaces as an error) ...
_STEP_TIMEOUT = datetime.timedelta(seconds=120)
# ... but idle ranks wait for rank 0's next command in a broadcast that may last as long as the
# worker has no work.
_IDLE_TIMEOUT = datetime.timedelta(days=7)


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    """model_path / dtype: the model; tp_size, pp_size: the group's shape; block_size, num_blocks:
    every rank's KV pool geometry (same block ids everywhere; ``num_blocks`` 0: sized from
    ``kv_cache_bytes`` / ``gpu_memory_utilization`` on each rank, see the module docstring);
    devices: torch device of each rank (empty: all on the CPU); threads: torch threads per rank;
    init_method: torch.distributed rendezvous (a ``file://`` path rank 0 makes); max_loras,
    max_lora_rank: every rank's LoRA slot stacks (``--enable-lora``; 0: LoRA off); quantization: every
    rank's ``--quantization`` (each quantizes or reads its own slice of the weights)."""

    model_path: str
    tp_size: int = 1
    pp_size: int = 1
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 0
    threads: int = 1
    init_method: str = ""
    devices: tuple[str, ...] = ()
    kv_cache_bytes: int = 0
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    expert_parallel: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    quantization: str | None = None   # --quantization (workers/llm/quantization.py; None: as stored)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tensor and pipeline parallel sizes must be >= 1")
        if self.devices and len(self.devices) != self.world:
            raise ValueError(f"{len(self.devices)} device(s) {','.join(self.devices)} for tensor_parallel_size "
                             f"{self.tp_size} × pipeline_parallel_size {self.pp_size} = {self.world} ranks")

    def device(self, rank: int) -> torch.device:
        return torch.device(self.devices[rank] if self.devices else "cpu")

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    def shard(self, rank: int, num_layers: int) -> Shard:
        layers = layer_ranges(num_layers, self.pp_size)[rank // self.tp_size]
        return Shard(tp_rank=rank % self.tp_size, tp_size=self.tp_size, first_layer=layers.start,
                     last_layer=layers.stop, expert_parallel=self.expert_parallel)

    def argv(self, rank: int) -> list[str]:
        return ["--rank", str(rank), "--model", self.model_path, "--tp", str(self.tp_size), "--pp",
                str(self.pp_size), "--dtype", self.dtype, "--block-size", str(self.block_size),
                "--num-blocks", str(self.num_blocks), "--threads", str(self.threads),
                "--init-method", self.init_method, "--devices", ",".join(self.devices),
                "--kv-cache-bytes", str(self.kv_cache_bytes),
                "--gpu-memory-utilization", str(self.gpu_memory_utilization),
                *(["--enable-expert-parallel"] if self.expert_parallel else []),
                *(["--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
                  if self.max_loras else []),
                *(["--quantization", self.quantization] if self.quantization else [])]


def layer_ranges(num_layers: int, stages: int) -> list[range]:
    """Contiguous, as even as possible; earlier stages take the remainder (they also embed)."""
    if stages > num_layers:
        raise ValueError(f"pipeline parallel size {stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for stage in range(stages):
        n = base + (stage < extra)
        out.append(range(start, start + n))
        start += n
    return out


class _TPGroup:
    """The collectives a sharded model calls, over this stage's tensor-parallel ranks: the
    all-reduce, and the all-to-all of expert parallelism."""

    def __init__(self, group):
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None) -> None:
        dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group)


class _Rank:
    """What every rank holds: its model shard, its pool, its place in the group."""

    def __init__(self, config: GroupConfig, rank: int):
        self.config = config
        self.rank = rank
        self.device = config.device(rank)
        backend = "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)   # NCCL's communicator binds to the current device
            backend = "cpu:gloo,cuda:nccl"
        join_world(backend, config.init_method, rank, config.world, timeout=_STEP_TIMEOUT)
        self.commands = dist.new_group(list(range(config.world)), timeout=_IDLE_TIMEOUT, backend="gloo")
        tp = config.tp_size
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(config.pp_size)]
        self.stage, self.tp_rank = divmod(rank, tp)
        num_layers = LlamaConfig.from_dir(Path(config.model_path)).num_layers
        self.model = LlamaModel(config.model_path, getattr(torch, config.dtype), device=self.device,
                                shard=config.shard(rank, num_layers), comm=_TPGroup(groups[self.stage]),
                                quantization=config.quantization)
        if config.max_loras and rank > 0:   # rank 0's LoraSlots attaches to its model (role_builders)
            RankSlots(self.model, config.max_loras, config.max_lora_rank)
        self.cache = PagedKVCache(len(self.model.layers), self.model.num_kv_heads, self.model.config.head_dim,
                                  block_size=config.block_size, num_blocks=config.num_blocks or self._agree_on_blocks(),
                                  dtype=self.model.dtype, device=self.device)

    def _agree_on_blocks(self) -> int:
        """Every rank measures what its device can hold after loading its shard; the group takes the
        smallest count. A too-small pool anywhere fails every rank, each naming the limiting one."""
        cfg, model = self.config, self.model
        per_block = PagedKVCache.block_bytes(len(model.layers), model.num_kv_heads, model.config.head_dim,
                                             cfg.block_size, model.dtype)
        budget, where = rank_kv_budget(self.device, cfg.gpu_memory_utilization, cfg.kv_cache_bytes)
        mine = torch.tensor([budget // per_block, budget, per_block], dtype=torch.long)
        every = [torch.empty_like(mine) for _ in range(cfg.world)]
        dist.all_gather(every, mine, group=self.commands)
        smallest = min(range(cfg.world), key=lambda r: int(every[r][0]))
        if smallest == self.rank:
            return blocks_in_budget(budget, per_block, f"rank {self.rank}, {where}")
        blocks, budget, per_block = every[smallest].tolist()
        if blocks < 2:
            raise KVBudgetError(f"KV cache on rank {smallest} ({cfg.device(smallest)}): a budget of {budget} bytes "
                                f"holds {blocks} block(s) of {per_block} bytes, at least 2 are needed")
        return blocks

    # Peers along the pipeline: the same tensor rank one stage before / after.
    @property
    def prev(self) -> int:
        return self.rank - self.config.tp_size

    @property
    def next(self) -> int:
        return self.rank + self.config.tp_size

    @property
    def last_stage(self) -> bool:
        return self.stage == self.config.pp_size - 1

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        hidden = None
        if self.stage > 0:
            hidden = torch.empty(batch.num_tokens, self.model.config.hidden_size, dtype=self.model.dtype,
                                 device=self.device)
            dist.recv(hidden, src=self.prev)
        out = self.model.forward(batch.to(self.device), self.cache, hidden)
        if not self.last_stage:
            dist.send(out.contiguous(), dst=self.next)
            return None
        return out

    def kv_shard(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's layers × heads of a full-head ``[layers, 2, seq, kv_heads, D]`` tensor."""
        layers = range(self.model.layer_ids.start, self.model.layer_ids.stop)
        heads = self.model.num_kv_heads
        return kv[layers.start:layers.stop, :, :, self.tp_rank * heads:(self.tp_rank + 1) * heads].contiguous()


def _send_header(group, cmd: int, *sizes: int) -> None:
    header = torch.zeros(HEADER, dtype=torch.long)
    header[0] = cmd
    header[1:1 + len(sizes)] = torch.tensor(sizes, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)


class GroupRunner:
    """Rank 0's :class:`~omnirelay.workers.llm.model_runner.ModelRunner` for a TP × PP group."""

    in_process = False   # heads and layers live on other ranks: no media, speech capture or layer hook

    def __init__(self, config: GroupConfig, budget_bytes: int = 0):
        """``budget_bytes``: the KV byte budget when ``config.kv_cache_bytes`` is 0 (kept for callers
        that pass it here)."""
        cfg = LlamaConfig.from_dir(Path(config.model_path))
        if config.expert_parallel:   # before any rank starts: a placement error is the user's to fix
            check_expert_parallel(cfg.moe, config.tp_size)
        self._tmp = tempfile.mkdtemp(prefix="omnirelay-group-")
        config = dataclasses.replace(config, kv_cache_bytes=config.kv_cache_bytes or budget_bytes,
                                     init_method=config.init_method or f"file://{self._tmp}/rendezvous")
        self.group = config
        self._procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, config.world):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "omnirelay.workers.llm.parallel", *config.argv(rank)],
                    preexec_fn=die_with_parent, stdin=subprocess.DEVNULL))
            self._rank = _Rank(config, 0)
        except BaseException:
            if dist.is_initialized():   # a failed start must not block the next group in this process
                leave_world()
            self._kill()
            raise
        self.config = cfg
        self.block_size = config.block_size
        self.num_blocks = self._rank.cache.num_blocks
        self._last = (config.pp_size - 1) * config.tp_size
        self.model = self._rank.model   # rank 0's shard (its LoraSlots, when LoRA is on)
        self._closed = False
        self._lost = ""   # why the group cannot run again (a rank died), once it happened

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self._lost:
            raise ParallelGroupLost(self._lost)
        try:
            return self._forward(batch)
        except (RuntimeError, dist.DistBackendError) as exc:
            gone = [f"rank {r + 1} (pid {p.pid}, exit {p.poll()})" for r, p in enumerate(self._procs)
                    if p.poll() is not None]
            self._lost = f"{', '.join(gone) or 'a rank'} of the parallel group lost mid-step: {exc}"
            raise ParallelGroupLost(self._lost) from exc

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        width = batch.block_tables.shape[1]
        lora = batch.lora_slots is not None
        _send_header(self._rank.commands, FORWARD, batch.num_tokens, batch.num_seqs, width, batch.block_size,
                     int(lora))
        payload = torch.cat([*batch.tensors(), *([batch.lora_slots.cpu()] if lora else [])])
        dist.broadcast(payload, src=0)
        out = self._rank.forward(batch)
        if self.group.pp_size == 1:
            return out
        logits = torch.empty(batch.num_seqs, self.config.vocab_size, dtype=torch.float32, device=self._rank.device)
        dist.recv(logits, src=self._last)
        return logits

    def load_lora(self, slot: int, name: str, path: str) -> None:
        """Every other rank reads adapter ``name`` at ``path`` into ``slot`` (LoraSlots' ``peers``)."""
        data = torch.frombuffer(bytearray(f"{name}\0{path}".encode()), dtype=torch.uint8)
        _send_header(self._rank.commands, LOAD_LORA, slot, data.numel())
        dist.broadcast(data, src=0)

    def kv_spec(self, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        cfg = self.config
        return (cfg.num_layers, 2, num_tokens, cfg.num_kv_heads, cfg.head_dim), self._rank.model.dtype

    def read_kv(self, blocks: list[int], num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        _send_header(self._rank.commands, READ_KV, len(blocks), num_tokens)
        dist.broadcast(torch.tensor(blocks, dtype=torch.long), src=0)
        cfg, group = self.config, self.group
        device = self._rank.device
        shape, dtype = self.kv_spec(num_tokens)
        on_device = out is not None and out.device == device
        full = out if on_device else torch.empty(shape, dtype=dtype, device=device)
        ranges = layer_ranges(cfg.num_layers, group.pp_size)
        heads = cfg.num_kv_heads // group.tp_size
        for rank in range(group.world):
            layers = ranges[rank // group.tp_size]
            h0 = (rank % group.tp_size) * heads
            if rank == 0:
                part = self._rank.cache.read_sequence(blocks, num_tokens)
            else:
                part = torch.empty(len(layers), 2, num_tokens, heads, cfg.head_dim, dtype=full.dtype, device=device)
                dist.recv(part, src=rank)
            full[layers.start:layers.stop, :, :, h0:h0 + heads] = part
        if on_device:
            return full
        return full.cpu() if out is None else out.copy_(full)   # one copy to the host, for the connector

    def write_kv(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        _send_header(self._rank.commands, WRITE_KV, len(blocks), kv.shape[2], start)
        dist.broadcast(torch.tensor(blocks, dtype=torch.long), src=0)
        group, cfg = self.group, self.config
        kv = kv.to(self._rank.device)   # one copy to the device; the shards leave from there
        ranges = layer_ranges(cfg.num_layers, group.pp_size)
        heads = cfg.num_kv_heads // group.tp_size
        for rank in range(1, group.world):
            layers = ranges[rank // group.tp_size]
            h0 = (rank % group.tp_size) * heads
            dist.send(kv[layers.start:layers.stop, :, :, h0:h0 + heads].contiguous(), dst=rank)
        self._rank.cache.write_sequence(blocks, self._rank.kv_shard(kv), start)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            _send_header(self._rank.commands, STOP)
            leave_world()
        except (RuntimeError, ValueError) as exc:
            log.warning("parallel group did not stop cleanly: %s", exc)
        self._kill(timeout_s)

    def _kill(self, timeout_s: float = 5.0) -> None:
        reap_ranks(self._procs, self._tmp, timeout_s)


def serve_rank(config: GroupConfig, rank: int) -> None:
    """Ranks 1..N-1: follow rank 0's commands until STOP."""
    me = _Rank(config, rank)
    header = torch.zeros(HEADER, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0, group=me.commands)
        cmd, a, b, c, d, e = header.tolist()
        if cmd == STOP:
            break
        if cmd == FORWARD:
            t, nseq, width, block_size, lora = a, b, c, d, e
            payload = torch.empty(3 * t + 2 * nseq + nseq * width + (t if lora else 0), dtype=torch.long)
            dist.broadcast(payload, src=0)
            parts = list(torch.split(payload, [t, t, t, nseq, nseq, nseq * width, *([t] if lora else [])]))
            batch = ForwardBatch.from_tensors(parts[:6], width, block_size)
            batch.lora_slots = parts[6] if lora else None
            out = me.forward(batch)   # moved to the device there
            if out is not None and me.tp_rank == 0 and config.pp_size > 1:
                dist.send(out.contiguous(), dst=0)
        elif cmd == LOAD_LORA:
            data = torch.empty(b, dtype=torch.uint8)
            dist.broadcast(data, src=0)
            name, path = bytes(data.tolist()).decode().split("\0", 1)
            me.model.lora.load(a, name, path)
        elif cmd in (READ_KV, WRITE_KV):
            blocks = torch.empty(a, dtype=torch.long)
            dist.broadcast(blocks, src=0)
            if cmd == READ_KV:
                dist.send(me.cache.read_sequence(blocks.tolist(), b), dst=0)
            else:
                part = torch.empty(len(me.model.layers), 2, b, me.model.num_kv_heads, me.model.config.head_dim,
                                   dtype=me.model.dtype, device=me.device)
                dist.recv(part, src=0)
                me.cache.write_sequence(blocks.tolist(), part, c)
    leave_world()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnirelay.workers.llm.parallel", description="one rank of a worker's group")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--devices", default="", help="torch device of every rank, comma-separated (empty: CPU)")
    ap.add_argument("--kv-cache-bytes", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--max-loras", type=int, default=0)
    ap.add_argument("--max-lora-rank", type=int, default=0)
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # rank 0 decides when the group stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    devices = tuple(d for d in args.devices.split(",") if d)
    config = GroupConfig(args.model, args.tp, args.pp, args.dtype, args.block_size, args.num_blocks, args.threads,
                         args.init_method, devices, args.kv_cache_bytes, args.gpu_memory_utilization,
                         args.enable_expert_parallel, args.max_loras, args.max_lora_rank, args.quantization)
    try:
        serve_rank(config, args.rank)
    except (KVBudgetError, ValueError) as exc:   # rank 0 reports it to the user; no traceback from here
        print(f"omnirelay.workers.llm.parallel rank {args.rank}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
