"""Tensor and pipeline parallelism with ranks as real processes over gloo.

Each group is rank 0 here (a :class:`GroupRunner`) plus child processes it starts and stops. The
engines run unchanged on top of it; outputs are compared token for token with a single-process run
on batches of mixed lengths, and KV crosses from a TP=2 prefill to a TP=1 decode through the real
shared-memory connector (re-sharded by heads on the way).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner, layer_ranges
from omnirelay.workers.llm.prefill import PrefillEngine

from engine_support import (  # noqa: F401
    QUESTIONS, chat_ids, connector, decode_engine, model, run_decode, run_prefill, runner_for, tok)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def prompts(tok):
    return [chat_ids(tok, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(model, prompts, tmp_path_factory):
    from omnirelay.connectors import create_connector
    conn = create_connector("shared_memory", {"shm_dir": str(tmp_path_factory.mktemp("shm"))})
    try:
        engine = PrefillEngine(runner_for(model), conn, max_model_len=2048, max_batched_tokens=64)
        prefilled = run_prefill(engine, prompts)
        return run_decode(decode_engine(model, conn, num_blocks=128), prompts, prefilled)
    finally:
        conn.close()


@pytest.fixture
def group(tiny_model):
    runners = []

    def start(tp: int, pp: int) -> GroupRunner:
        runner = GroupRunner(GroupConfig(tiny_model, tp_size=tp, pp_size=pp, block_size=16, num_blocks=128))
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        runner.close()
        assert all(p.poll() is not None for p in runner._procs)


def run_on(runner: GroupRunner, connector, prompts):  # noqa: F811
    prefilled = run_prefill(PrefillEngine(runner, connector, max_model_len=2048, max_batched_tokens=64), prompts)
    engine = DecodeEngine(runner, connector, max_num_seqs=16, max_model_len=2048, transfer_timeout_s=5)
    return run_decode(engine, prompts, prefilled)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_group_equals_single_process(group, connector, prompts, expected, tp, pp):  # noqa: F811
    runner = group(tp, pp)
    assert run_on(runner, connector, prompts) == expected


def test_prefill_tp2_hands_kv_to_decode_tp1(group, connector, model, prompts, expected):  # noqa: F811
    runner = group(2, 1)
    prefilled = run_prefill(PrefillEngine(runner, connector, max_model_len=2048, max_batched_tokens=64), prompts)
    kv = connector.get(prefilled["r0"].outputs.kv_key)["kv"]
    cfg = model.config
    assert kv.shape == (cfg.num_layers, 2, len(prompts[0]), cfg.num_kv_heads, cfg.head_dim)   # all heads
    assert run_decode(decode_engine(model, connector, num_blocks=128), prompts, prefilled) == expected


def test_kv_round_trip_through_the_group_reshards_by_heads(group, model):
    runner = group(2, 1)
    cfg = model.config
    kv = torch.randn(cfg.num_layers, 2, 21, cfg.num_kv_heads, cfg.head_dim)
    blocks = [5, 9]
    runner.write_kv(blocks, kv)
    assert torch.equal(runner.read_kv(blocks, 21), kv)
    # Rank 0 holds KV head 0 only.
    assert torch.equal(runner._rank.cache.read_sequence(blocks, 21), kv[:, :, :, :1])


def test_layer_ranges_and_config_validation(tiny_model):
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError):
        layer_ranges(2, 3)
    with pytest.raises(ValueError):
        GroupConfig(tiny_model, tp_size=0)
    shard = dataclasses.replace(GroupConfig(tiny_model, tp_size=2, pp_size=2)).shard(3, 4)
    assert (shard.tp_rank, shard.first_layer, shard.last_layer) == (1, 2, 4)
    with pytest.raises(ValueError, match="must divide"):
        from omnirelay.workers.llm.models.llama import Shard
        LlamaModel(tiny_model, shard=Shard(tp_rank=0, tp_size=3), comm=object())


def test_omni_serve_with_tensor_parallel_prefill_and_decode(tiny_model, tmp_path):
    """Through the whole daemon path: workers of two ranks each, greedy output unchanged."""
    import openai

    from conftest import ServeProcess, hf_chat_greedy

    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--tensor-parallel-size", "2",
                         log_path=str(tmp_path / "serve.log"))
    try:
        assert len(serve.children) >= 6   # broker, gateway, 2 workers and one extra rank each
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = [{"role": "user", "content": "What is the capital of France?"}]
        parallel = client.chat.completions.create(model="tiny-llm", messages=prompt, max_tokens=16, temperature=0,
                                                  extra_body={"return_token_ids": True, "ignore_eos": True})
        tokens = parallel.choices[0].model_extra["token_ids"]
        assert len(tokens) == 16
        reference = hf_chat_greedy(tiny_model, prompt, 16)
        assert tokens[: len(reference)] == reference
    finally:
        serve.stop()
