"""Sequence parallelism across a generate worker's ranks: the diffusion transformer of an image or
video pipeline (SD3, Z-Image, Wan) runs with its tokens split over ``size`` processes.

Ranks are real processes, as in :mod:`omnirelay.workers.llm.parallel`: rank 0 is the worker daemon
itself (it holds the whole pipeline and is the only one that talks to the bus); it starts ranks
1..N-1 (``python -m omnirelay.workers.generate.sequence_parallel_group ...``, settings on the command line,
no pickle), which load only the pipeline's transformers from the same directory (``transformer/``,
and ``transformer_2/`` for Wan 2.2's second expert: :func:`denoiser_folders`). Rank 0 owns
them: :meth:`SequenceParallelDenoiser.close` stops and joins them, and the kernel kills them if
rank 0 dies (PR_SET_PDEATHSIG).

Start-up: rank 0 starts the ranks first, so that they load the transformer while it loads the
pipeline; then :meth:`SequenceParallelDenoiser.attach` waits until every rank has loaded, joins the
group and broadcasts SETUP (the dtype of every parameter and buffer rank 0's transformers ended up
in — a pipeline may pin some modules to float32 — which the ranks cast theirs to).
Each rank says "loaded" through a pipe of its own (one byte, ``--ready-fd``) right before it joins.
Rank 0 waits for those bytes rather than in the rendezvous, because it cannot leave a rendezvous
early: ``init_process_group`` waits the whole ``_STEP_TIMEOUT`` for a rank that will never come,
and killing the other ranks does not end that wait. Waiting on the pipes, it checks every
``_START_POLL_S`` that the ranks still run, so a rank that exits while it starts (a bad model
directory, an import error, the OOM killer) fails start-up within a fraction of a second, naming
the rank and its exit status; rank 0 kills the others and raises
:class:`SequenceParallelGroupLost` (the worker exits 1). Once every rank has loaded, the rendezvous
itself takes milliseconds; only a rank that dies inside it still costs the bounded timeout.

Life of one denoising forward (rank 0's :meth:`SequenceParallelDenoiser.forward`, installed as each
pipeline transformer's ``forward``; the other ranks' :func:`serve_rank` loop)::

    rank 0: the pipeline's own loop (or the engine's stepwise runner) calls the transformer
        ──the family's kernel packs the call (sequence_parallel_kernels.py): tensors + a few ints,
          or refuses it (before anything is sent, so the group stays in step)
        ──broadcast header [FORWARD, expert, tensor count, ints] on the command group
        ──broadcast the tensors' shapes and dtypes, then the tensors──▶ every rank holds them whole
    every rank: the kernel (sequence_parallel.py for SD3, _zimage.py, _wan.py) on the same expert:
        its 1/N of the tokens through every block, K/V all-gathered per attention,
        the output tokens all-gathered at the end
    rank 0: returns the noise prediction to the pipeline, which steps its scheduler
    STOP (close): ranks leave the loop, destroy the process group and exit

A lost group (a rank process exited, or a collective failed or timed out) cannot be resynchronised:
the ranks would disagree about which forward they are in. Rank 0 then marks the group lost for good
and says so once through ``on_lost`` — from its watcher thread, which notices a rank that exits
while the worker is idle, or from the forward whose collective failed. The forward in flight raises
:class:`SequenceParallelGroupLost` (the engine fails the requests it holds as ``worker_lost``, which
the broker retries on another worker), and the worker stops taking work and exits non-zero so its
supervisor restarts it with a fresh group; :meth:`SequenceParallelDenoiser.close` kills the ranks
that are left rather than waiting for them.

So ranks 1..N-1 follow rank 0's denoising loop call by call, whatever the pipeline's loop is
(classifier-free guidance doubles the batch; Wan 2.2 switches experts; the header carries both).
Text encoders, scheduler and VAE run on rank 0 only; the pipeline is loaded by ``from_pretrained``
as without SP — only its transformers' ``forward`` is replaced on these instances.

What must hold (:func:`check_sequence_parallel` from the directory's metadata before anything
loads, :meth:`SequenceParallelDenoiser.check_size` per request): every denoiser of the pipeline is
a transformer class with a kernel (``KERNELS``: SD3 without dual-attention layers, Z-Image, Wan) —
any other (a UNet, Flux, ...) is refused at start-up, never run unsplit. SD3's kernel needs the
number of image tokens, ``(height / vae_scale / patch) · (width / vae_scale / patch)``, to divide
by the size (each rank takes an equal slice); Z-Image's and Wan's pad the sequence, so any size
works. The heads need not divide: ranks split tokens, not heads (every rank computes all heads of
its own queries against all gathered keys).

Equality: the output equals one rank's up to float rounding (the kernel's attention sums the same
keys in the same order; only the query batch and the GEMM shapes differ), which
``tests/e2e/test_generate_sp.py`` (SD3) and ``tests/e2e/test_generate_sp_dits.py`` (Z-Image, Wan) bound on whole
images and videos.

Device: collectives use gloo and the group runs on the CPU, as the TP/PP group does; the CUDA path
(NCCL, one device per rank) waits for device lists in omni-worker.
"""

from __future__ import annotations

import argparse
import inspect
import dataclasses
import datetime
import itertools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from omnirelay.errors import BadRequest

from omnirelay.workers.runtime.rank_processes import die_with_parent, reap_ranks
from omnirelay.workers.runtime.process_group import join_world, leave_world
from omnirelay.workers.generate.sequence_parallel_kernels import KERNELS, SPConfigError

log = logging.getLogger("omnirelay.worker.generate")

SETUP, FORWARD, STOP = 1, 2, 3
HEADER = 12            # FORWARD: [cmd, expert, tensor count, int count, the kernel's ints...];
                       # SETUP: [cmd, expert count, each expert's parameter + buffer count...]
MAX_INTS = HEADER - 4
MAX_DIMS = 6
SHAPE_ROW = 2 + MAX_DIMS   # per tensor of a FORWARD: [dtype code, ndim, dims...]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.int32, torch.bool)
# Start-up and collectives inside a forward are bounded (a rank that died surfaces as an error) ...
_STEP_TIMEOUT = datetime.timedelta(seconds=120)
# ... but idle ranks wait for rank 0's next forward as long as the worker has no work.
_IDLE_TIMEOUT = datetime.timedelta(days=7)
# How often rank 0's watcher checks that ranks 1..N-1 are still running (idle ranks are never heard from).
_WATCH_INTERVAL_S = 0.5
# How often rank 0 checks, while it waits for the ranks to load, that they are still running.
_START_POLL_S = 0.1


class SequenceParallelError(ValueError):
    """A sequence-parallel size this model cannot run; the message says why and what would work."""


class SequenceParallelGroupLost(RuntimeError):
    """The group lost a rank or fell out of step; no forward can run on it again (the worker must
    restart). The message says what happened."""


def _read_json(path: str) -> dict:
    try:
        with open(path) as handle:
            value = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SequenceParallelError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise SequenceParallelError(f"{path}: expected a JSON object")
    return value


def denoiser_folders(model_path: str) -> list[tuple[str, str]]:
    """The pipeline's denoisers as ``(folder, class name)``, in order: ``transformer`` (and
    ``transformer_2``, Wan 2.2's low-noise expert) or ``unet``; from ``model_index.json``."""
    index = _read_json(os.path.join(model_path, "model_index.json"))
    return [(name, entry[1]) for name, entry in sorted(index.items())
            if (name == "unet" or name.startswith("transformer")) and isinstance(entry, list) and len(entry) == 2
            and entry[1]]


def check_sequence_parallel(model_path: str, size: int) -> None:
    """Raise :class:`SequenceParallelError` unless the diffusers directory ``model_path`` can run
    its transformers over ``size`` sequence-parallel ranks (every one has a kernel; SD3's native
    resolution splits). Reads only metadata (``model_index.json``, the denoisers' and the VAE's
    ``config.json``)."""
    if size < 1:
        raise SequenceParallelError(f"sequence-parallel size {size}: must be at least 1")
    if size == 1:
        return
    index = _read_json(os.path.join(model_path, "model_index.json"))
    folders = denoiser_folders(model_path)
    if not folders or any(name not in KERNELS for _, name in folders):
        found = ", ".join(f"a UNet ({name})" if folder == "unet" else name for folder, name in folders) or "none"
        raise SequenceParallelError(
            f"sequence-parallel size {size}: sequence parallelism splits the tokens of a diffusion transformer "
            f"that has a sequence-parallel kernel ({', '.join(KERNELS)}); {model_path} "
            f"({index.get('_class_name')}) has {found}; use sequence_parallel_size 1")
    vae_path = os.path.join(model_path, "vae", "config.json")
    vae = _read_json(vae_path) if os.path.exists(vae_path) else {}
    for folder, name in folders:
        config = _read_json(os.path.join(model_path, folder, "config.json"))
        try:
            KERNELS[name].check_config(config, size, model_path, vae)
        except SPConfigError as exc:
            raise SequenceParallelError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class SPGroupConfig:
    """model_path: the pipeline directory (ranks load its ``transformer/``); size: ranks in the
    group; threads: torch threads per rank; init_method: torch.distributed rendezvous (a ``file://``
    path rank 0 makes). The dtype is not here: rank 0 announces the one its transformer holds."""

    model_path: str
    size: int
    threads: int = 1
    init_method: str = ""

    def argv(self, rank: int) -> list[str]:
        return ["--rank", str(rank), "--model", self.model_path, "--size", str(self.size),
                "--threads", str(self.threads), "--init-method", self.init_method]


def _join_group(config: SPGroupConfig, rank: int):
    """Join the process group; return the command group (broadcasts that may wait while idle)."""
    join_world("gloo", config.init_method, rank, config.size, timeout=_STEP_TIMEOUT)
    return dist.new_group(list(range(config.size)), timeout=_IDLE_TIMEOUT)


class SequenceParallelDenoiser:
    """Rank 0's side: starts ranks 1..N-1 and runs the pipeline's transformer with them.

    Two steps, so that the ranks load their transformers while rank 0 loads the pipeline: the
    constructor starts the ranks; :meth:`attach` waits until they have loaded (and fails at once,
    having stopped them all, if one exits first), joins the process group, tells the ranks the dtypes
    rank 0's transformers hold, and replaces ``forward`` on those transformer instances
    (``nn.Module.__call__`` calls ``self.forward``), so the pipeline's own ``__call__`` (or the
    engine's stepwise runner) drives the group unchanged. Not thread-safe: the worker's loop is its
    one caller (the watcher thread only polls the rank processes and marks the group lost). Once
    lost (see the module docstring), every forward raises :class:`SequenceParallelGroupLost` at once
    instead of hanging; ``on_lost(reason)`` is called once, from whichever thread noticed, and must
    only flip flags (the worker's shutdown)."""

    def __init__(self, model_path: str, size: int, threads: int = 1,
                 on_lost: Callable[[str], None] | None = None):
        self.size = size
        self._tmp = tempfile.mkdtemp(prefix="omnirelay-sp-")
        self.config = SPGroupConfig(os.path.abspath(model_path), size, threads, f"file://{self._tmp}/rendezvous")
        self.folders = denoiser_folders(self.config.model_path) if os.path.isdir(self.config.model_path) else []
        self.experts: list = []   # rank 0's transformers, in the order of self.folders
        self.kernel = None
        self.stats = {"sp_forwards": 0}
        self._commands = None
        self._procs: list[subprocess.Popen] = []
        self._on_lost = on_lost
        self._lost: str | None = None
        self._lost_lock = threading.Lock()   # the watcher and the forward may both find the group lost
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._original_forwards: list = []
        self._loading: dict[int, int] = {}   # rank -> read end of its "loaded" pipe, until attach
        try:
            for rank in range(1, size):
                read_end, write_end = os.pipe()   # not inheritable: only this rank holds write_end
                self._loading[rank] = read_end
                try:
                    self._procs.append(subprocess.Popen(
                        [sys.executable, "-m", "omnirelay.workers.generate.sequence_parallel_group", *self.config.argv(rank),
                         "--ready-fd", str(write_end)],
                        preexec_fn=die_with_parent, stdin=subprocess.DEVNULL, pass_fds=(write_end,)))
                finally:
                    os.close(write_end)
        except BaseException:
            self._reap(0.0)
            raise

    def experts_of(self, pipe) -> list:
        """``pipe``'s transformers in the order the ranks load them (``transformer``, ``transformer_2``)."""
        return [getattr(pipe, folder) for folder, _ in self.folders]

    def attach(self, *experts) -> "SequenceParallelDenoiser":
        """Form the group over rank 0's ``experts`` (:meth:`experts_of`; one transformer for SD3
        and Z-Image, both of Wan 2.2's) and install the group's forward on each."""
        names = {type(expert).__name__ for expert in experts}
        if not experts or len(names) != 1 or next(iter(names)) not in KERNELS:
            raise SequenceParallelError(f"sequence parallelism needs transformers of one of {tuple(KERNELS)}, "
                                        f"got {sorted(names) or 'none'}")
        if self.folders and len(experts) != len(self.folders):
            raise SequenceParallelError(f"{self.config.model_path} has {len(self.folders)} transformer(s) "
                                        f"({', '.join(folder for folder, _ in self.folders)}), got {len(experts)}")
        self._wait_until_loaded()
        try:
            self._commands = _join_group(self.config, 0)
        except RuntimeError as exc:   # the rendezvous timed out: a rank died inside it, or hangs there
            dead = self._dead_rank()
            self._reap(0.0)
            if dead is None:
                raise
            raise SequenceParallelGroupLost(f"sequence-parallel {dead} while the group formed") from exc
        codes = [_dtype_codes(expert) for expert in experts]
        _send_header(self._commands, SETUP, len(experts), *(len(c) for c in codes))
        for expert_codes in codes:
            dist.broadcast(expert_codes, src=0, group=self._commands)
        self.kernel = KERNELS[next(iter(names))]
        self.experts = list(experts)
        for index, expert in enumerate(experts):
            self._original_forwards.append(expert.__dict__.get("forward"))
            expert.forward = _ExpertForward(self, index, type(expert).forward)
        # Owned here: close() stops and joins it before the ranks are stopped (their exit is then expected).
        self._watcher = threading.Thread(target=self._watch_ranks, name="sp-rank-watcher", daemon=True)
        self._watcher.start()
        return self

    def _wait_until_loaded(self) -> None:
        """Start-up: return once every rank has said it loaded its transformer (and is joining the
        group). A rank that exits first, or ranks still loading after ``_STEP_TIMEOUT``, raise
        :class:`SequenceParallelGroupLost` once every rank is stopped."""
        deadline = time.monotonic() + _STEP_TIMEOUT.total_seconds()
        exited: set[int] = set()   # closed their pipe without a byte: they are exiting
        try:
            while True:
                # First on every round: a rank that said "loaded" and died right after is still
                # found here, not in the rendezvous.
                dead = self._dead_rank()
                if dead is not None:
                    raise SequenceParallelGroupLost(
                        f"sequence-parallel {dead} during start-up, before the group formed (its own "
                        "output, a traceback if it raised one, went to this worker's stderr)")
                if not self._loading and not exited:
                    return
                if time.monotonic() > deadline:
                    raise SequenceParallelGroupLost(
                        f"sequence-parallel rank(s) {', '.join(map(str, sorted({*self._loading, *exited})))} "
                        f"not loaded {_STEP_TIMEOUT.total_seconds():.0f} s after rank 0 was ready")
                readable, _, _ = select.select(list(self._loading.values()), [], [], _START_POLL_S)
                for rank, fd in list(self._loading.items()):
                    if fd in readable:
                        if not os.read(fd, 1):   # end of file: the rank exited before it loaded, which
                            exited.add(rank)     # _dead_rank names once the process can be waited for
                        os.close(self._loading.pop(rank))
        except BaseException:
            self._reap(0.0)
            raise

    @property
    def lost(self) -> str | None:
        """Why the group is lost, or None while it can run forwards."""
        return self._lost

    def _mark_lost(self, reason: str) -> None:
        with self._lost_lock:
            if self._lost is not None:
                return
            self._lost = reason
        log.error("sequence-parallel group lost: %s; the worker stops taking work and exits", reason)
        if self._on_lost is not None:
            self._on_lost(reason)

    def _dead_rank(self) -> str | None:
        """The first rank process that has exited, described; None while all run."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                how = (f"was killed by signal {-code} ({_signal_name(-code)})" if code < 0
                       else f"exited with status {code}")
                return f"rank {rank} (pid {proc.pid}) {how}"
        return None

    def _watch_ranks(self) -> None:
        """Watcher thread: mark the group lost as soon as a rank exits, so that an idle worker does
        not wait for its next request to find out."""
        while not self._stop_watching.wait(_WATCH_INTERVAL_S):
            dead = self._dead_rank()
            if dead is not None:
                self._mark_lost(dead)
                return

    def check_size(self, width: int, height: int, vae_scale: int) -> None:
        """Raise :class:`BadRequest` for an image whose token count does not split over the ranks
        (SD3; the kernels of Z-Image and Wan pad the sequence, so every size splits)."""
        if self.kernel is None or self.kernel.pads:
            return
        unit = vae_scale * self.kernel.token_unit(self.experts[0])
        rows, cols = height // unit, width // unit
        if (rows * cols) % self.size:
            raise BadRequest(f"this model runs on {self.size} sequence-parallel ranks, so an image's "
                             f"{unit}×{unit}-pixel patches must divide by {self.size}; {width}x{height} has "
                             f"{cols}×{rows} = {rows * cols}", param="size")

    def forward(self, expert: int, arguments: dict):
        """Expert ``expert``'s forward over the group; ``arguments``: its own ``forward``'s, bound by
        name. What the kernel does not cover raises ValueError before anything is sent."""
        if self._closed:
            raise SequenceParallelGroupLost("the sequence-parallel group is closed")
        dead = self._dead_rank()   # found here before the watcher does: fail now, not in a collective
        if dead is not None:
            self._mark_lost(dead)
        if self._lost:
            raise SequenceParallelGroupLost(f"the sequence-parallel group is lost ({self._lost})")
        model = self.experts[expert]
        # Packed (and so checked) before anything is broadcast: a rank that raised mid-forward would
        # leave the others waiting in a collective. (check_size refuses such requests earlier, with a 400.)
        tensors, ints = self.kernel.pack(model, arguments)
        tensors = [t.contiguous() for t in tensors]
        if len(ints) > MAX_INTS or any(t.ndim > MAX_DIMS or t.dtype not in DTYPES for t in tensors):
            raise ValueError("a sequence-parallel forward's inputs exceed what its header describes")
        try:
            _send_header(self._commands, FORWARD, expert, len(tensors), len(ints), *ints)
            shapes = torch.zeros(len(tensors), SHAPE_ROW, dtype=torch.long)
            for row, tensor in zip(shapes, tensors):
                row[0], row[1] = DTYPES.index(tensor.dtype), tensor.ndim
                row[2:2 + tensor.ndim] = torch.tensor(tensor.shape, dtype=torch.long)
            dist.broadcast(shapes, src=0, group=self._commands)
            for tensor in tensors:
                dist.broadcast(tensor, src=0)
            out = self.kernel.run(model, tensors, ints)
        except RuntimeError as exc:   # a rank died or timed out: the group cannot resync
            # (A ValueError — the model refusing these inputs — is raised alike on every rank at the
            # same point, so the group stays in step and only this request fails.)
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            self._mark_lost(self._dead_rank() or f"a collective failed: {first_line}")
            raise SequenceParallelGroupLost(f"the sequence-parallel group is lost ({self._lost})") from exc
        self.stats["sp_forwards"] += 1
        return self.kernel.wrap(out, arguments)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop ranks 1..N-1 and join them; put the transformer's own forward back. Idempotent.
        Before :meth:`attach` the ranks are still loading or waiting to join, and after the group
        is lost the rest wait in a collective that will never complete: they are killed."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join()
        if self._commands is None:
            self._reap(0.0)
            return
        for expert, original in zip(self.experts, self._original_forwards):
            if original is None:
                expert.__dict__.pop("forward", None)
            else:
                expert.forward = original
        if self._lost:
            self._reap(0.0)   # before leave_world, which could wait on them otherwise
        try:
            if not self._lost:
                _send_header(self._commands, STOP)
            leave_world()
        except (RuntimeError, ValueError) as exc:
            log.warning("sequence-parallel group did not stop cleanly: %s", exc)
        self._reap(timeout_s)

    def _reap(self, timeout_s: float) -> None:
        while self._loading:   # start-up did not finish: the pipes of ranks still loading
            os.close(self._loading.popitem()[1])
        reap_ranks(self._procs, self._tmp, timeout_s)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _send_header(group, cmd: int, *fields: int) -> None:
    header = torch.zeros(HEADER, dtype=torch.long)
    header[0] = cmd
    if fields:
        header[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)


class _ExpertForward:
    """Installed as one transformer's ``forward``: binds the call to the model's own signature (so
    the kernel reads arguments by name) and runs it over the group."""

    def __init__(self, group: SequenceParallelDenoiser, expert: int, original):
        self._group, self._expert = group, expert
        self._signature = inspect.signature(original)

    def __call__(self, *args, **kwargs):
        bound = self._signature.bind(None, *args, **kwargs)   # None for self: only the arguments matter
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self._signature.parameters)))
        return self._group.forward(self._expert, arguments)


def _tensors_of(model):
    return itertools.chain((t for _, t in model.named_parameters()), (t for _, t in model.named_buffers()))


def _dtype_codes(model) -> torch.Tensor:
    """The dtype of every parameter and buffer, in order, as codes (what SETUP sends)."""
    return torch.tensor([DTYPES.index(t.dtype) for t in _tensors_of(model)], dtype=torch.long)


def _load_experts(config: SPGroupConfig) -> list:
    """The same transformers rank 0's pipeline loads, as stored (:func:`serve_rank` casts them to
    rank 0's dtypes)."""
    import importlib.util

    import diffusers

    return [getattr(diffusers, name).from_pretrained(
        config.model_path, subfolder=folder, local_files_only=True,
        low_cpu_mem_usage=importlib.util.find_spec("accelerate") is not None).eval()   # as load_pipeline
        for folder, name in denoiser_folders(config.model_path)]


def serve_rank(config: SPGroupConfig, rank: int, ready_fd: int = -1) -> None:
    """Ranks 1..N-1: load the transformers, say so to rank 0 (one byte on ``ready_fd``, then closed;
    -1: no pipe), take rank 0's dtypes (SETUP), then run each forward rank 0 announces, until STOP."""
    experts = _load_experts(config)
    kernel = KERNELS[type(experts[0]).__name__]
    if ready_fd >= 0:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    commands = _join_group(config, rank)
    header = torch.zeros(HEADER, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0, group=commands)
        cmd, *fields = header.tolist()
        if cmd == STOP:
            break
        if cmd == SETUP:
            count, sizes = fields[0], fields[1:1 + fields[0]]
            if count != len(experts):
                raise RuntimeError(f"rank 0 holds {count} transformer(s), this rank loaded {len(experts)}")
            for model, size in zip(experts, sizes):
                codes = torch.empty(size, dtype=torch.long)
                dist.broadcast(codes, src=0, group=commands)
                tensors = list(_tensors_of(model))
                if len(tensors) != size:
                    raise RuntimeError(f"rank 0's transformer has {size} parameters and buffers, this rank's "
                                       f"{len(tensors)}")
                for tensor, code in zip(tensors, codes.tolist()):
                    if tensor.dtype != DTYPES[code]:   # e.g. float32 pins of a bfloat16 model stay float32
                        tensor.data = tensor.data.to(DTYPES[code])
            continue
        expert, count, int_count = fields[:3]
        ints = fields[3:3 + int_count]
        shapes = torch.zeros(count, SHAPE_ROW, dtype=torch.long)
        dist.broadcast(shapes, src=0, group=commands)
        inputs = [torch.empty(row[2:2 + row[1]], dtype=DTYPES[row[0]]) for row in shapes.tolist()]
        for tensor in inputs:
            dist.broadcast(tensor, src=0)
        try:
            kernel.run(experts[expert], inputs, ints)   # rank 0 keeps the whole output; ours is a copy
        except ValueError as exc:
            # An input the model refuses (a shape): rank 0 holds the same inputs and weights, so it
            # failed at the same point, before the same collective; both go on to the next command.
            log.warning("sequence-parallel rank %d: forward refused its inputs: %s", rank, exc)
    leave_world()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnirelay.workers.generate.sequence_parallel_group",
                                 description="one sequence-parallel rank of a generate worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--ready-fd", type=int, default=-1, help="pipe to rank 0: one byte once the transformer loaded")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # rank 0 decides when the group stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    serve_rank(SPGroupConfig(args.model, args.size, args.threads, args.init_method), args.rank, args.ready_fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
