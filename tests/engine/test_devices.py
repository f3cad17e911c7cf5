"""Device placement and KV sizing of the prefill/decode engines (``--devices``,
``--gpu-memory-utilization``, ``--kv-cache-bytes``).

On this CPU-only CI: the pure rules (:mod:`omnirelay.workers.runtime.devices`), the fail-fast errors of the
real ``omni-worker`` process (exit status 2, a message, no traceback), omni-serve passing the flags
through, and the CPU side of the device plumbing. The tests marked ``cuda`` run only where torch sees
GPUs; they say what a GPU run verifies (see :func:`test_cuda_placement_and_tp2_equals_tp1`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.runtime.devices import (DEFAULT_CPU_KV_BYTES, KVBudgetError, blocks_in_budget, kv_cache_budget,
                                       parse_device_ids, rank_kv_budget, resolve_devices)

from engine_support import QUESTIONS, chat_ids, run_decode, run_prefill, tok  # noqa: F401

GiB = 1 << 30
CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------ the KV budget rule (pure)

@pytest.mark.parametrize("total, free, own, utilization, explicit, expected", [
    # The worker's share is 0.9 × 80 GiB = 72 GiB; its weights took 2 GiB → 70 GiB for KV.
    (80 * GiB, 78 * GiB, 2 * GiB, 0.9, 0, 70 * GiB),
    # An explicit byte budget caps the share ...
    (80 * GiB, 78 * GiB, 2 * GiB, 0.9, 4 * GiB, 4 * GiB),
    # ... but never raises it above what the share leaves.
    (80 * GiB, 78 * GiB, 2 * GiB, 0.9, 100 * GiB, 70 * GiB),
    # Two workers at 0.45 each on one device: the second sees the first's 36 GiB as not free, yet
    # its own share is intact (vLLM's rule; the old "fill up to 0.9 of total" left it nothing).
    (80 * GiB, 42 * GiB, 2 * GiB, 0.45, 0, 34 * GiB),
    # Never more than is free now: other processes hold most of the device.
    (80 * GiB, 10 * GiB, 2 * GiB, 0.9, 0, 10 * GiB),
    # The weights alone exceed the share: nothing is left (never negative).
    (80 * GiB, 40 * GiB, 40 * GiB, 0.25, 0, 0),
    (80 * GiB, 80 * GiB, 0, 1.0, 0, 80 * GiB),
])
def test_kv_cache_budget(total, free, own, utilization, explicit, expected):
    assert kv_cache_budget(total=total, free=free, own=own, utilization=utilization, explicit=explicit) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"total": GiB, "free": GiB, "own": 0, "utilization": 0.0}, "must be in (0, 1]"),
    ({"total": GiB, "free": GiB, "own": 0, "utilization": 1.5}, "must be in (0, 1]"),
    ({"total": GiB, "free": 2 * GiB, "own": 0, "utilization": 0.9}, "not a valid reading"),
    ({"total": GiB, "free": GiB, "own": 2 * GiB, "utilization": 0.9}, "not a valid reading"),
])
def test_kv_cache_budget_rejects_bad_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        kv_cache_budget(**kwargs)


def test_a_budget_below_two_blocks_fails_with_the_numbers():
    assert blocks_in_budget(10 * 4096, 4096, "cuda:0") == 10
    with pytest.raises(KVBudgetError, match=r"KV cache on cuda:0: a budget of 4096 bytes holds 1 block\(s\) of 4096 "
                                            r"bytes, at least 2 are needed .* --gpu-memory-utilization"):
        blocks_in_budget(4096, 4096, "cuda:0")


def test_cpu_budget_is_the_byte_budget():
    assert rank_kv_budget(torch.device("cpu"), 0.9, 0)[0] == DEFAULT_CPU_KV_BYTES
    assert rank_kv_budget(torch.device("cpu"), 0.9, 1234)[0] == 1234   # utilization does not apply


# ------------------------------------------------------------------ placement (pure)

def test_device_ids_parse():
    assert parse_device_ids("0, 3") == (0, 3)
    for bad in ("", "0,x", "0,0", "-1"):
        with pytest.raises(ValueError, match="expected distinct device ids"):
            parse_device_ids(bad)


def test_resolve_devices():
    assert resolve_devices((2, 0), 2, cuda_count=4) == ("cuda:2", "cuda:0")
    assert resolve_devices((), 2, cuda_count=4) == ("cuda:0", "cuda:1")   # default: the first visible ones
    assert resolve_devices((), 2, cuda_count=0) == ("cpu", "cpu")
    with pytest.raises(ValueError, match="this host has no CUDA device"):
        resolve_devices((0,), 1, cuda_count=0)
    with pytest.raises(ValueError, match=r"device 4 does not exist; 4 CUDA device\(s\) are visible"):
        resolve_devices((1, 4), 2, cuda_count=4)
    with pytest.raises(ValueError, match="a group of 4 ranks needs 4 CUDA devices but 2 are visible"):
        resolve_devices((), 4, cuda_count=2)


def test_worker_config_checks_devices_against_the_group(tiny_model):
    with pytest.raises(ValueError, match=r"--devices 0 names 1 device\(s\) but the group is "
                                         r"--tensor-parallel-size 2 × --pipeline-parallel-size 1 = 2"):
        WorkerConfig("prefill", tiny_model, "m", tensor_parallel_size=2, devices=(0,))
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.0"):
        WorkerConfig("prefill", tiny_model, "m", gpu_memory_utilization=0.0)


# ------------------------------------------------------------------ the real omni-worker process

def _worker(tiny_model, *flags: str) -> subprocess.CompletedProcess:
    # A broker that does not exist: every case here must stop before the worker dials it.
    return subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "decode", "--model", tiny_model,
                           "--broker", "ipc:///nonexistent/omnirelay-test", *flags],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "2", "--devices", "0"],
     "--devices 0 names 1 device(s) but the group is --tensor-parallel-size 2 × --pipeline-parallel-size 1 = 2"),
    (["--pipeline-parallel-size", "2", "--devices", "0,1,2"],
     "--devices 0,1,2 names 3 device(s) but the group is --tensor-parallel-size 1 × --pipeline-parallel-size 2 = 2"),
    (["--devices", "0,x"], "--devices '0,x': expected distinct device ids like 0,1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
])
def test_omni_worker_refuses_inconsistent_values(tiny_model, flags, message):
    done = _worker(tiny_model, *flags)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(CUDA_COUNT > 0, reason="checks the CPU-only host's refusal; this host has CUDA")
def test_omni_worker_refuses_devices_on_a_host_without_cuda(tiny_model):
    done = _worker(tiny_model, "--devices", "0")
    assert done.returncode == 2, done.stderr
    assert "--devices 0: this host has no CUDA device" in done.stderr
    assert "leave --devices out to run on the CPU" in done.stderr
    assert "Traceback" not in done.stderr


def test_omni_worker_refuses_a_kv_pool_of_less_than_two_blocks(tiny_model):
    """After the weights load: a budget too small for the pool fails start-up, naming the numbers."""
    done = _worker(tiny_model, "--kv-cache-bytes", "1")
    assert done.returncode == 2, done.stderr
    assert "a budget of 1 bytes holds 0 block(s)" in done.stderr
    assert "Traceback" not in done.stderr


def test_group_ranks_agree_on_the_smallest_pool(tiny_model):
    """PP=2 on the CPU, sized from a byte budget on each rank: the ranks agree on the count the
    stage with the most layers can hold, and a pool too small on a rank fails the group's start."""
    from omnirelay.workers.kv.cache import PagedKVCache
    from omnirelay.workers.llm.models.llama import LlamaConfig
    from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner, layer_ranges

    cfg = LlamaConfig.from_dir(__import__("pathlib").Path(tiny_model))
    layers = max(len(r) for r in layer_ranges(cfg.num_layers, 2))
    per_block = PagedKVCache.block_bytes(layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32)
    runner = GroupRunner(GroupConfig(tiny_model, pp_size=2, kv_cache_bytes=40 * per_block + 7))
    try:
        assert runner.num_blocks == 40
        assert runner._rank.cache.keys[0].device.type == "cpu"
    finally:
        runner.close()
    with pytest.raises(KVBudgetError, match="at least 2 are needed"):
        GroupRunner(GroupConfig(tiny_model, pp_size=2, kv_cache_bytes=per_block))


# ------------------------------------------------------------------ omni-serve passes the flags through

def test_omni_serve_passes_devices_and_utilization_to_every_worker():
    from omnirelay.deploy import serve
    from omnirelay.pipeline import default_llm_pipeline
    from omnirelay.deploy.served_models import ModelPlan

    assert serve.WORKER_TAKES_DEVICES
    plan = ModelPlan(path="/srv/m", name="m", kind="llm", pipeline=default_llm_pipeline(), pipeline_file=None,
                     groups={"prefill": (2, 1), "decode": (2, 1)})
    args = serve.build_parser().parse_args(["/srv/m", "--tensor-parallel-size", "2", "--devices", "2,3",
                                            "--gpu-memory-utilization", "0.9"])
    commands = serve.worker_commands(args, [plan], "ipc:///tmp/b")
    assert {c.role for c in commands} == {"prefill", "decode"}
    for command in commands:
        argv = command.argv
        assert argv[argv.index("--devices") + 1] == "2,3"
        # Prefill and decode share this host's devices: each worker owns half of the 0.9.
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.45"
        assert argv[argv.index("--kv-cache-bytes") + 1] == "0"   # unset: the worker's default rule
        assert command.group_size == 2


# ------------------------------------------------------------------ CPU side of the device plumbing

def test_runner_hands_kv_to_connectors_on_the_host(tiny_model):
    from omnirelay.workers.llm.forward_batch import ForwardBatch
    from omnirelay.workers.llm.model_runner import local_runner
    from omnirelay.workers.llm.models.llama import LlamaModel

    runner = local_runner(LlamaModel(tiny_model), block_size=16, budget_bytes=1 << 20)
    batch = ForwardBatch.build([([1, 2, 3], 0, [1])], 16)
    assert batch.to("cpu") is batch   # no copy where the batch already is
    runner.forward(batch)
    kv = runner.read_kv([1], 3)
    assert kv.device.type == "cpu" and kv.shape[2] == 3


# ------------------------------------------------------------------ on CUDA only

@pytest.mark.skipif(CUDA_COUNT == 0, reason="no CUDA device: CI is CPU-only; a GPU run checks model, KV pool and "
                                            "per-step tensors on cuda and TP=2 greedy output equal to TP=1")
@pytest.mark.timeout(600)
def test_cuda_placement_and_tp2_equals_tp1(tiny_model, tok, tmp_path):  # noqa: F811
    """What a GPU run verifies: weights, the KV pool and a step's tensors sit on the rank's device;
    KV leaves for the connector on the host; the utilization share sizes the pool; the first token of
    each prompt on cuda equals the CPU's (whole sequences may part at a near-tie: different kernels),
    and TP=2 over NCCL (two devices) gives the same greedy output as TP=1 on cuda."""
    from omnirelay.connectors import create_connector
    from omnirelay.workers.llm.decode import DecodeEngine
    from omnirelay.workers.llm.model_runner import local_runner
    from omnirelay.workers.llm.models.llama import LlamaModel
    from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner
    from omnirelay.workers.llm.prefill import PrefillEngine

    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    conn = create_connector("shared_memory", {"shm_dir": str(tmp_path)})

    def generate(runner_for_prefill, runner_for_decode):
        prefilled = run_prefill(PrefillEngine(runner_for_prefill, conn, max_model_len=2048, max_batched_tokens=64),
                                prompts)
        key = prefilled["r0"].outputs.kv_key
        payload = conn.get(key)   # whole KV, or a layerwise manifest (a local runner) and one piece per layer
        kv = payload["kv"] if "kv" in payload else conn.get(f"{key}/layer/0")["k"]
        assert kv.device.type == "cpu"   # connectors get host memory
        engine = DecodeEngine(runner_for_decode, conn, max_num_seqs=16, max_model_len=2048, transfer_timeout_s=5)
        return run_decode(engine, prompts, prefilled)

    def first_tokens(runner):
        prefilled = run_prefill(PrefillEngine(runner, conn, max_model_len=2048, max_batched_tokens=64), prompts)
        return {rid: result.token for rid, result in prefilled.items()}

    try:
        cpu = local_runner(LlamaModel(tiny_model), block_size=16, budget_bytes=8 << 20)
        model = LlamaModel(tiny_model, device="cuda:0")
        assert model.layers[0].qkv.weight.device == torch.device("cuda:0")
        single = local_runner(model, block_size=16, gpu_memory_utilization=0.5)
        assert single.cache.keys[0].device == torch.device("cuda:0")
        free, total = torch.cuda.mem_get_info(0)
        assert single.cache.num_blocks * single.cache.bytes_per_block <= 0.5 * total
        assert first_tokens(single) == first_tokens(cpu)
        expected = generate(single, single)
        if CUDA_COUNT < 2:
            pytest.skip("one CUDA device: TP=2 over NCCL needs two")
        group = GroupRunner(GroupConfig(tiny_model, tp_size=2, devices=("cuda:0", "cuda:1"),
                                        kv_cache_bytes=64 << 20))
        try:
            assert group._rank.cache.keys[0].device == torch.device("cuda:0")
            assert generate(group, group) == expected
        finally:
            group.close()
    finally:
        conn.close()


def test_a_wedge_limit_must_exceed_two_heartbeats(tiny_model):
    # A limit inside two heartbeat intervals would drop a worker for one ordinary slow step.
    with pytest.raises(ValueError, match="--wedged-after 1.5 must exceed two heartbeat intervals"):
        WorkerConfig("prefill", tiny_model, "m", heartbeat_interval_s=1.0, wedged_after_s=1.5)
    assert WorkerConfig("prefill", tiny_model, "m", wedged_after_s=30.0).wedged_after_s == 30.0
