"""LoRA adapters in the compact engines (issue #29): PEFT's files, checked at load; batched,
unmerged LoRA terms in one prefill and one decode batch mixing adapters and the base, token for
token equal to transformers + peft (each adapter applied by peft to the base, unmerged); the prefix
cache keyed by adapter; more adapters than slots (LRU eviction)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from omnirelay.block_hash import block_hashes
from omnirelay.broker.prefix_index import prompt_route_keys, route_keys
from omnirelay.request_params import TextParams
from omnirelay.deploy.builders.lora import build_tiny_lora
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.llm.lora import LoraError, LoraSlots, load_adapter
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.model_runner import LocalRunner
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask

from engine_support import (  # noqa: F401  (fixtures)
    QUESTIONS, SYSTEM, chat_ids, connector, drain_prefill, runner_for, tok)

peft = pytest.importorskip("peft")

NEW_TOKENS = 24
# Adapter name → (rank, targets, rsLoRA): attention only, MLP only, everything with rsLoRA, ...
RECIPES = {"a1": (8, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", False),
           "a2": (4, "q_proj,v_proj", False), "a3": (16, "gate_proj,up_proj,down_proj,o_proj", True)}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, (rank, targets, rslora)) in enumerate(RECIPES.items(), 1):
        out[name] = str(build_tiny_lora(tiny_model, root / name, rank=rank, targets=tuple(targets.split(",")),
                                        seed=seed, use_rslora=rslora))
    return out


@pytest.fixture(scope="module")
def peft_reference(tiny_model):
    """``greedy(adapter_dir or None, ids, n)``: transformers' greedy tokens, the adapter applied by
    peft to the base (unmerged)."""
    memo: dict = {}
    models: dict = {}

    def greedy(adapter: str | None, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
        key = (adapter, tuple(ids), n)
        if key not in memo:
            if adapter not in models:
                hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
                # ignore_eos as the requests ask: no EOS stop (min_new_tokens would mask EOS out instead)
                hf.generation_config.eos_token_id = None
                models[adapter] = hf if adapter is None else peft.PeftModel.from_pretrained(hf, adapter).eval()
            with torch.no_grad():
                out = models[adapter].generate(input_ids=torch.tensor([ids]), max_new_tokens=n,
                                               do_sample=False)
            memo[key] = out[0, len(ids):].tolist()
        return memo[key]

    return greedy


def _params(name: str, n: int = NEW_TOKENS) -> TextParams:
    return TextParams(max_tokens=n, temperature=0, ignore_eos=True, lora=name)


def _engines(tiny_model, adapters, connector, *, max_loras: int, max_batched_tokens: int = 256,
             quantization: str | None = None):
    """A prefill and a decode engine on their own model copies (each holds its own LoRA slots)."""
    torch.set_num_threads(1)
    pm, dm = LlamaModel(tiny_model, quantization=quantization), LlamaModel(tiny_model, quantization=quantization)
    p_slots = LoraSlots(pm, adapters, max_loras=max_loras, max_rank=16)
    d_slots = LoraSlots(dm, adapters, max_loras=max_loras, max_rank=16)
    prefill = PrefillEngine(runner_for(pm, block_size=8, kv_cache_bytes=8 << 20), connector, max_model_len=2048,
                            max_batched_tokens=max_batched_tokens, lora=p_slots)
    cfg = dm.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=16, num_blocks=256)
    decode = DecodeEngine(LocalRunner(dm, cache), connector, max_num_seqs=16, max_model_len=2048, transfer_timeout_s=5,
                          lora=d_slots)
    return prefill, decode


def _generate(prefill: PrefillEngine, decode: DecodeEngine, jobs: list[tuple[str, list[int]]],
              n: int = NEW_TOKENS) -> list[list[int]]:
    """Every job ``(adapter, prompt ids)`` submitted at once through prefill, then decode."""
    for i, (name, ids) in enumerate(jobs):
        prefill.add(PrefillTask(f"r{i}", ids, _params(name, n), time.time() + 120))
    prefilled = drain_prefill(prefill, max_steps=400)
    outputs = {}
    for i, (name, ids) in enumerate(jobs):
        result = prefilled[f"r{i}"]
        outputs[f"r{i}"] = [result.token]
        decode.add(DecodeTask(f"r{i}", ids, result.token, _params(name, n), time.time() + 120, "",
                              result.outputs.kv_key, result.outputs.kv_handle))
    for _ in range(4000):
        out = decode.step()
        assert not out.failed, out.failed
        for token in out.tokens:
            outputs[token.request_id].append(token.token)
        if not decode.has_work:
            return [outputs[f"r{i}"] for i in range(len(jobs))]
    raise AssertionError("decode did not finish")


def test_mixed_batch_of_base_and_three_adapters_equals_peft(tiny_model, adapters, tok, connector, peft_reference):
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    names = ["", *RECIPES]
    # Every prompt under every adapter and the base, all in one load: 16 sequences per batch.
    jobs = [(name, ids) for ids in prompts for name in names]
    prefill, decode = _engines(tiny_model, adapters, connector, max_loras=3)
    outputs = _generate(prefill, decode, jobs)
    for (name, ids), got in zip(jobs, outputs):
        assert got == peft_reference(adapters.get(name), ids), (name, ids)
    # The adapters really change the answers (a LoRA term that is never added would fail above too).
    for ids in prompts:
        assert len({tuple(peft_reference(adapters.get(n), ids)) for n in names}) == len(names)


def test_adapters_on_an_int8_base(tiny_model, adapters, tok, connector, peft_reference):
    """LoRA on a base quantized at load (W8A8; the adapters stay float, their terms separate matmuls):
    each adapter still changes the answer, and the first token under it is peft's on the float base
    (the int8 rounding moves later tokens of the random tiny model, not the first)."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    names = ["", *RECIPES]
    jobs = [(name, ids) for ids in prompts for name in names]
    prefill, decode = _engines(tiny_model, adapters, connector, max_loras=3, quantization="int8")
    assert type(prefill.runner.model.layers[0].qkv).__name__ == "Int8Linear"
    outputs = _generate(prefill, decode, jobs)
    firsts = [got[0] == peft_reference(adapters.get(name), ids)[0] for (name, ids), got in zip(jobs, outputs)]
    assert sum(firsts) >= len(jobs) - 1, firsts
    for i in range(len(prompts)):
        assert len({tuple(outputs[i * len(names) + k]) for k in range(len(names))}) == len(names)


def test_prefix_cached_under_one_adapter_is_not_reused_by_another(tiny_model, adapters, tok, connector,
                                                                  peft_reference):
    prompt = chat_ids(tok, QUESTIONS[1], SYSTEM)
    prefill, decode = _engines(tiny_model, adapters, connector, max_loras=3)
    _generate(prefill, decode, [("a1", prompt)], n=2)
    assert prefill.prefix_hit_tokens(prompt, "a1") >= 40
    # The broker's routing keys (the gateway's hint, the worker's heartbeat) are the adapter's too.
    added = set(route_keys(prefill.prefix_events()[0]))
    hint = prompt_route_keys(prompt, 8, lora="a1")
    assert len(hint) >= 5 and set(hint) <= added and not set(prompt_route_keys(prompt, 8)) & added
    assert prefill.prefix_hit_tokens(prompt, "a2") == prefill.prefix_hit_tokens(prompt) == 0
    assert prefill.stats["prefix_cached_tokens"] == 0
    # The same prompt under a2 and under the base: nothing reused, and their own right answers.
    outputs = _generate(prefill, decode, [("a2", prompt), ("", prompt)], n=4)
    assert prefill.stats["prefix_cached_tokens"] == 0
    assert outputs == [peft_reference(adapters["a2"], prompt, 4), peft_reference(None, prompt, 4)]
    # Under a1 again it is reused.
    again = _generate(prefill, decode, [("a1", prompt)], n=4)
    assert prefill.stats["prefix_cached_tokens"] >= 40
    assert again == [peft_reference(adapters["a1"], prompt, 4)]
    # Without an adapter the block names are what they always were.
    assert block_hashes(prompt, 8, "") == block_hashes(prompt, 8) != block_hashes(prompt, 8, "a1")


def test_eight_adapters_through_two_slots(tiny_model, tok, connector, tmp_path, peft_reference):
    many = {f"m{i}": str(build_tiny_lora(tiny_model, tmp_path / f"m{i}", rank=4, targets=("q_proj", "v_proj", "down_proj"),
                                         seed=10 + i)) for i in range(8)}
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:2]]
    jobs = [(name, ids) for name in many for ids in prompts]
    prefill, decode = _engines(tiny_model, many, connector, max_loras=2)
    outputs = _generate(prefill, decode, jobs, n=8)
    for (name, ids), got in zip(jobs, outputs):
        assert got == peft_reference(many[name], ids, 8), name
    assert prefill.lora.stats["lora_evictions"] >= 6 and decode.lora.stats["lora_evictions"] >= 6
    # Only max_cpu_loras (= max_loras here) stay read: an evicted adapter comes back from disk.
    assert prefill.lora.stats["lora_disk_loads"] >= 1 and len(prefill.lora._cpu) == 2
    assert len(prefill.lora.resident) == len(decode.lora.resident) == 2


def test_bad_adapters_are_refused_at_load(tiny_model, adapters, tmp_path):
    config = LlamaModel(tiny_model).config
    good = adapters["a1"]
    assert load_adapter("a1", good, config, max_rank=8).rank == 8
    with pytest.raises(LoraError, match=r"'a1'.*rank 8 is above --max-lora-rank 4"):
        load_adapter("a1", good, config, max_rank=4)
    with pytest.raises(LoraError, match=r"adapter_config.json is missing"):
        load_adapter("x", tmp_path, config, max_rank=16)

    def variant(name: str, edit_config=None, edit_weights=None) -> str:
        path = tmp_path / name
        path.mkdir()
        raw = json.loads((tmp_path.parent / "x").joinpath().read_text()) if False else \
            json.loads(open(f"{good}/adapter_config.json").read())
        weights = load_file(f"{good}/adapter_model.safetensors")
        if edit_config:
            edit_config(raw)
        if edit_weights:
            edit_weights(weights)
        (path / "adapter_config.json").write_text(json.dumps(raw))
        save_file(weights, str(path / "adapter_model.safetensors"))
        return str(path)

    def narrow(weights):   # an adapter made for another base: A of q_proj one column short
        key = next(k for k in weights if "q_proj.lora_A" in k)
        weights[key] = weights[key][:, :-1].contiguous()

    with pytest.raises(LoraError, match=r"q_proj: A \(8, 255\).*do not fit the base"):
        load_adapter("narrow", variant("narrow", edit_weights=narrow), config, max_rank=16)
    with pytest.raises(LoraError, match=r"target modules \['lm_head'\] are not supported"):
        load_adapter("head", variant("head", lambda r: r.update(target_modules=["q_proj", "lm_head"])),
                     config, max_rank=16)
    with pytest.raises(LoraError, match="use_dora"):
        load_adapter("dora", variant("dora", lambda r: r.update(use_dora=True)), config, max_rank=16)
    # LoraSlots checks every module when it is built: the bad one is named before any request.
    with pytest.raises(LoraError, match="'big'"):
        LoraSlots(LlamaModel(tiny_model), {"a2": adapters["a2"], "big": good}, max_loras=1, max_rank=4)


def test_a_request_for_an_adapter_the_worker_lacks_fails_by_name(tiny_model, adapters, tok, connector):
    prefill, _ = _engines(tiny_model, {"a2": adapters["a2"]}, connector, max_loras=1)
    prefill.add(PrefillTask("r0", chat_ids(tok, "Hi!"), _params("nope"), time.time() + 60))
    failures = prefill.step().failed
    assert len(failures) == 1 and "'nope'" in failures[0].message
    plain = PrefillEngine(runner_for(LlamaModel(tiny_model)), connector, max_model_len=2048)   # LoRA off
    plain.add(PrefillTask("r1", chat_ids(tok, "Hi!"), _params("a2"), time.time() + 60))
    failures = plain.step().failed
    assert len(failures) == 1 and "'a2'" in failures[0].message
    assert b"lora" not in msgspec.msgpack.encode(TextParams(max_tokens=2))   # the base's params name none
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_params("a2")), type=TextParams).lora == "a2"


@pytest.mark.parametrize("daemon", ["omnirelay.workers.daemon", "omnirelay.gateway.daemon"])
def test_daemons_refuse_a_bad_adapter_at_start_by_name(daemon, tiny_model, tmp_path):
    role = ["--role", "prefill"] if "workers" in daemon else []
    base = [sys.executable, "-m", daemon, *role, "--model", tiny_model, "--broker", "tcp://127.0.0.1:9"]
    bad = subprocess.run([*base, "--enable-lora", "--lora-modules", f"broken={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'broken'" in bad.stderr, bad.stderr[-2000:]
    off = subprocess.run([*base, "--max-loras", "2"], capture_output=True, text=True, timeout=120)
    assert off.returncode == 2 and "--max-loras needs --enable-lora" in off.stderr, off.stderr[-2000:]


def test_the_kv_hand_off_names_its_adapter_and_decode_checks_it(tiny_model, adapters, tok, connector):
    from omnirelay.broker import protocol as p
    from omnirelay.handoffs import KVHandoff
    from omnirelay.workers.llm.roles import DecodeRole

    prefill, decode = _engines(tiny_model, adapters, connector, max_loras=2)
    ids = chat_ids(tok, "Hi!")
    for i, name in enumerate(("a1", "")):
        prefill.add(PrefillTask(f"r{i}", ids, _params(name, 4), time.time() + 60))
    results = drain_prefill(prefill)
    under_a1, base = results["r0"].outputs, results["r1"].outputs
    assert isinstance(under_a1, KVHandoff) and under_a1.lora == "a1" and base.lora == ""
    assert b"lora" not in msgspec.msgpack.encode(base)   # the base's hand-off is as before LoRA
    role = DecodeRole("dec-1", decode)

    def task(request_id: str, handoff: KVHandoff, name: str) -> p.Task:
        return p.Task(request_id=request_id, stage="decode", model="tiny-llm", prompt_token_ids=ids,
                      params=_params(name, 4), inputs=handoff, reply_to="gw", deadline=time.time() + 60)

    # a1's KV continued under a2, or the base's under a1: refused by name, the KV released.
    for request_id, handoff, name in (("r0", under_a1, "a2"), ("r1", base, "a1")):
        out = role.accept(task(request_id, handoff, name))
        (_, failure), = out
        assert isinstance(failure, p.StageFailed) and failure.error_type == "bad_request"
        assert f"computed under LoRA adapter {handoff.lora!r}, the request names {name!r}" in failure.message
    assert decode.num_requests == 0
