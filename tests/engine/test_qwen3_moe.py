"""Qwen3 and Qwen3-MoE in the compact model, with and without expert parallelism.

The MoE block is checked against transformers' own modules (router tie-breaking included); the
group runs real rank processes over gloo, compared token for token with one process and with
transformers; placement errors surface at start-up; a rank that dies inside the all-to-all makes
the surviving rank's collective raise instead of hanging, and a worker whose rank dies fails its
requests with a structured ``worker_lost`` and exits for a restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from omnirelay.connectors.shared_memory import sweep_orphans
from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.workers.llm.expert_parallel import ExpertPlacementError, expert_range, token_chunks
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.models.moe import MoeConfig, SparseMoE, route
from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner
from omnirelay.workers.llm.prefill import PrefillEngine

from engine_support import (  # noqa: F401
    QUESTIONS, chat_ids, connector, decode_engine, run_decode, run_prefill, runner_for)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def moe_model() -> str:
    return str(cached_qwen3(moe=True))


@pytest.fixture(scope="module")
def dense_model() -> str:
    return str(cached_qwen3(moe=False))


# ------------------------------------------------------------------ the block against transformers


def _hf_block(num_experts: int, top_k: int, norm: bool, hidden: int = 32, inter: int = 16):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return block, MoeConfig(num_experts, top_k, inter, norm)


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
def test_router_breaks_ties_as_transformers_does(norm):
    torch.set_num_threads(1)
    block, config = _hf_block(num_experts=8, top_k=2, norm=norm)
    with torch.no_grad():
        # Experts 1, 4 and 6 get the same router row, experts 0 and 7 another: their logits tie
        # exactly for every token, so top-2 must pick among equals the way torch.topk does.
        block.gate.weight[4] = block.gate.weight[1]
        block.gate.weight[6] = block.gate.weight[1]
        block.gate.weight[7] = block.gate.weight[0]
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
        x[:8] = 0.0   # all eight logits 0: an eight-way tie
        _, hf_weights, hf_experts = block.gate(x)
        weights, experts = route(torch.nn.functional.linear(x, block.gate.weight), config.top_k, config.norm_topk_prob)
        assert torch.equal(experts, hf_experts)
        assert torch.equal(weights, hf_weights)
        ties = [row for row in experts.tolist() if len({1, 4, 6} & set(row)) >= 1]
        assert len(ties) > 10   # the tied experts really were chosen
        ours = SparseMoE(config, block.gate.weight.clone(),
                         block.experts.gate_up_proj.clone(), block.experts.down_proj.clone())
        torch.testing.assert_close(ours(x), block(x[None])[0], rtol=1e-5, atol=1e-6)


def test_expert_placement_is_contiguous_blocks_and_refuses_a_remainder():
    assert [expert_range(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [expert_range(128, 4, r) for r in range(4)] == [range(32 * r, 32 * (r + 1)) for r in range(4)]
    assert expert_range(6, 1, 0) == range(6)
    assert token_chunks(5, 2) == [3, 2] and token_chunks(1, 2) == [1, 0]
    with pytest.raises(ExpertPlacementError, match="5 experts do not divide over the 2 ranks"):
        expert_range(5, 2, 0)


def test_experts_that_do_not_divide_fail_start_up_with_a_clear_error(tmp_path, moe_model):
    five = str(cached_qwen3(moe=True, num_experts=5))
    # The group: refused before any rank process starts.
    with pytest.raises(ExpertPlacementError, match="5 experts do not divide over the 2 ranks"):
        GroupRunner(GroupConfig(five, tp_size=2, expert_parallel=True, num_blocks=16))
    # A dense model has no experts to place.
    with pytest.raises(ExpertPlacementError, match="no experts"):
        GroupRunner(GroupConfig(str(cached_qwen3(moe=False)), tp_size=2, expert_parallel=True, num_blocks=16))
    # omni-worker: exit 2 with the reason, before it loads anything.
    worker = subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "decode", "--model", five,
                             "--tensor-parallel-size", "2", "--enable-expert-parallel"],
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 2
    assert "5 experts do not divide over the 2 ranks" in worker.stderr
    # omni-serve: the launch check, before any child starts.
    from omnirelay.deploy.serve import LaunchError, build_parser, check_parallel
    from omnirelay.deploy.served_models import plan_models

    args = build_parser().parse_args([five, "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    [plan] = plan_models([(five, "m")], None)
    with pytest.raises(LaunchError, match="the 5 experts of .* do not divide over the prefill worker's"):
        check_parallel(args, plan)
    args = build_parser().parse_args([moe_model, "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    [plan] = plan_models([(moe_model, "m")], None)
    assert check_parallel(args, plan) == {"prefill": (2, 1), "decode": (2, 1)}


# ------------------------------------------------------------------ engines on a group


@pytest.fixture(scope="module")
def prompts(moe_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(moe_model)
    return [chat_ids(tok, q) for q in QUESTIONS]


def _run(runner_or_model, connector, prompts):  # noqa: F811
    from omnirelay.workers.llm.decode import DecodeEngine

    runner = runner_for(runner_or_model) if isinstance(runner_or_model, LlamaModel) else runner_or_model
    prefilled = run_prefill(PrefillEngine(runner, connector, max_model_len=2048, max_batched_tokens=64), prompts)
    if isinstance(runner_or_model, LlamaModel):
        return run_decode(decode_engine(runner_or_model, connector, num_blocks=128), prompts, prefilled)
    engine = DecodeEngine(runner_or_model, connector, max_num_seqs=16, max_model_len=2048, transfer_timeout_s=5)
    return run_decode(engine, prompts, prefilled)


@pytest.mark.parametrize("tp,pp,expert_parallel", [(2, 1, False), (2, 1, True), (1, 2, False)],
                         ids=["tp2", "tp2-ep2", "pp2"])
def test_moe_group_equals_single_process(moe_model, connector, prompts, tp, pp, expert_parallel):  # noqa: F811
    torch.set_num_threads(1)
    expected = _run(LlamaModel(moe_model), connector, prompts)
    runner = GroupRunner(GroupConfig(moe_model, tp_size=tp, pp_size=pp, block_size=16, num_blocks=128,
                                     expert_parallel=expert_parallel))
    try:
        assert runner._rank.model.layers[0].moe.gate_up.shape[0] == (4 if expert_parallel else 8)
        assert _run(runner, connector, prompts) == expected
    finally:
        runner.close()
    assert all(p.poll() is not None for p in runner._procs)


def test_qwen3_dense_engines_match_transformers(dense_model, connector):  # noqa: F811
    from transformers import AutoTokenizer

    from conftest import hf_chat_greedy

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(dense_model)
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
    got = _run(LlamaModel(dense_model), connector, prompts)
    for i, question in enumerate(QUESTIONS[:3]):
        reference = hf_chat_greedy(dense_model, question, 16)
        assert got[f"r{i}"][:len(reference)] == reference


# ------------------------------------------------------------------ a rank dying in the all-to-all

_RANK = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from omnirelay.workers.llm.expert_parallel import ExpertDispatch
    from omnirelay.workers.llm.models.moe import MoeConfig, SparseMoE
    from omnirelay.workers.llm.parallel import _TPGroup
    from omnirelay.workers.runtime.process_group import join_world, leave_world

    class DiesInside(_TPGroup):   # rank 1 only: exits between two exchanges of one dispatch
        calls = 0
        def all_to_all(self, *args):
            DiesInside.calls += 1
            if DiesInside.calls == die_at:
                os._exit(9)
            super().all_to_all(*args)

    def run() -> int:
        # Everything that holds the group is local: the group is freed, its threads joined, on return.
        join_world("gloo", rendezvous, rank, 2)
        comm = (DiesInside if rank == 1 else _TPGroup)(dist.group.WORLD)
        gen = torch.Generator().manual_seed(0)
        config = MoeConfig(num_experts=4, top_k=2, intermediate_size=8, norm_topk_prob=True)
        block = SparseMoE(config, torch.randn(4, 16, generator=gen), torch.randn(2, 16, 16, generator=gen),
                          torch.randn(2, 16, 8, generator=gen), rank=rank, size=2, expert_parallel=True, comm=comm)
        x = torch.randn(7, 16, generator=gen)
        steps = 0
        try:
            while True:
                block(x)
                steps += 1
        except RuntimeError as exc:
            print(f"rank {rank} raised after {steps} steps: {type(exc).__name__}", flush=True)
            return 3
        finally:
            leave_world()

    rank, rendezvous, die_at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    sys.exit(run())
""")


def test_a_rank_dying_inside_the_all_to_all_raises_on_the_survivor(tmp_path):
    rendezvous = f"file://{tmp_path}/rendezvous"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A dispatch is four all-to-alls (counts, rows, expert ids, results back): the 10th is the rows
    # of the third dispatch, so rank 0 has sent its counts and waits there for rank 1's rows.
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), rendezvous, "10"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    try:
        start = time.monotonic()
        out0, _ = procs[0].communicate(timeout=90)
        assert procs[1].wait(30) == 9
        assert procs[0].returncode == 3, out0
        assert "rank 0 raised after 2 steps" in out0
        assert time.monotonic() - start < 60
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_a_worker_whose_rank_dies_fails_its_requests_and_exits(moe_model, tmp_path):
    """Decode worker at TP=2 with expert parallelism; its rank 1 is killed while it decodes."""
    import concurrent.futures

    import openai

    from cluster import Cluster

    cluster = Cluster(model=moe_model, log_dir=str(tmp_path), model_name="tiny-qwen3-moe")
    prefill = None
    try:
        cluster.start_broker()
        prefill = cluster.start_worker("prefill")
        decode = cluster.start_worker("decode", "--tensor-parallel-size", "2", "--enable-expert-parallel")
        cluster.start_gateway()
        cluster.wait_healthy()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ranks = _children(decode.pid)
        assert len(ranks) == 1, ranks

        def long_answer():
            return client.chat.completions.create(
                model="tiny-qwen3-moe", messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=1900, temperature=0, extra_body={"ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(long_answer)
            time.sleep(3.0)   # decoding by now (a 1900-token answer takes far longer)
            assert not answer.done()
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                answer.result(timeout=90)
        assert time.monotonic() - killed < 60
        assert info.value.status_code == 503
        assert decode.proc.wait(30) == 1
        out = decode.output()
        assert "parallel group lost mid-step" in out and "Traceback" not in out, out[-3000:]
    finally:
        cluster.stop()
        # The broker re-dispatches the lost request (worker_lost is recoverable): prefill publishes
        # its KV again for a decode worker that no longer exists, and a producer leaves published
        # keys in place at shutdown (their consumer deletes them). Nobody will: sweep that PID's.
        if prefill is not None:
            sweep_orphans(owners={prefill.pid})


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_fused_expert_layout_loads_like_the_hub_layout(moe_model, tmp_path):
    """transformers 5's fused ``experts.gate_up_proj``/``down_proj`` tensors read as the per-expert ones."""
    import shutil

    from safetensors.torch import load_file, save_file

    fused = tmp_path / "fused"
    shutil.copytree(moe_model, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    config = LlamaModel(moe_model).config.moe
    for layer in (i for i in range(4) if config.is_sparse(i)):
        pre = f"model.layers.{layer}.mlp.experts."
        experts = range(config.num_experts)
        tensors[pre + "gate_up_proj"] = torch.stack([torch.cat((tensors.pop(f"{pre}{e}.gate_proj.weight"),
                                                                tensors.pop(f"{pre}{e}.up_proj.weight")))
                                                     for e in experts])
        tensors[pre + "down_proj"] = torch.stack([tensors.pop(f"{pre}{e}.down_proj.weight") for e in experts])
    save_file(tensors, str(fused / "model.safetensors"))
    ids = list(range(5, 40))
    hub_logits, hub_kv = LlamaModel(moe_model).prefill(ids)
    fused_logits, fused_kv = LlamaModel(str(fused)).prefill(ids)
    assert torch.equal(hub_logits, fused_logits) and torch.equal(hub_kv, fused_kv)
