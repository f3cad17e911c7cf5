"""Layer-by-layer KV export (issue #5): prefill puts each layer's KV while the later layers compute.

No network apart from a real ``redis-server`` for the Redis case: the engines run in this process
and the real connectors carry the KV between them. Greedy output through layerwise export must equal
the whole-KV path and transformers; a failed, aborted or unneeded export leaves no key behind.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from omnirelay.connectors import create_connector
from omnirelay.pipeline import PipelineError, parse_pipeline
from omnirelay.handoffs import piece_key, release_kv
from omnirelay.workers.kv.export import ExportSequence, ExportState, LayerwiseExport, import_kv
from omnirelay.workers.llm.model_runner import local_runner
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.request_params import TextParams

from cluster import settled_workers
from connector_servers import started_redis
from engine_support import (  # noqa: F401  (fixtures)
    GREEDY, QUESTIONS, chat_ids, connector, decode_engine, is_first_token, is_result, model, outcomes, reference,
    run_decode, run_prefill, runner_for, shm_keys, tok)


def prefill_engine(model, connector, mode: str, **kw) -> PrefillEngine:
    args = {**dict(max_model_len=2048, max_batched_tokens=24, prefix_caching=False), **kw}
    pool = dict(block_size=args.pop("block_size", 4), kv_cache_bytes=args.pop("kv_cache_bytes", 8 << 20))
    return PrefillEngine(runner_for(model, **pool), connector, kv_transfer=mode, **args)


def test_layerwise_equals_whole_and_transformers(model, tok, reference, connector, tmp_path):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    # 24-token steps: most prompts span several steps (chunked prefill) and finish next to others.
    layerwise = prefill_engine(model, connector, "layerwise")
    whole = prefill_engine(model, connector, "whole")
    b = run_prefill(whole, prompts)
    kv_b = {k: import_kv(connector, r.outputs.kv_key, r.outputs.kv_handle, timeout=5) for k, r in b.items()}
    a = run_prefill(layerwise, prompts)
    assert layerwise.stats["kv_layerwise_handoffs"] == len(prompts) and not whole.stats["kv_layerwise_handoffs"]
    for key in a:
        assert a[key].token == b[key].token
        manifest = connector.get(a[key].outputs.kv_key)
        assert manifest["layerwise"] == model.config.num_layers and manifest["num_tokens"] == len(prompts[int(key[1:])])
    assert layerwise.allocator.free == layerwise.runner.num_blocks - 1
    outputs = run_decode(decode_engine(model, connector, num_blocks=256), prompts, a)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(ids), QUESTIONS[i]
    # The same KV either way (the same packed forwards: bitwise equal).
    a = run_prefill(layerwise, prompts)
    for key, result in a.items():
        assert torch.equal(import_kv(connector, result.outputs.kv_key, result.outputs.kv_handle, timeout=5),
                           kv_b[key])
    assert shm_keys(tmp_path) == []


def test_long_chunked_prompt_with_prefix_hit_exports_the_whole_sequence(model, connector, tmp_path):
    """A 1500-token prompt over six steps, then one sharing its first 1000 tokens (prefix-cache hit):
    each layer's piece covers the whole sequence, equal to what the whole-KV path reads."""
    g = torch.Generator().manual_seed(0)
    first = torch.randint(10, model.config.vocab_size, (1500,), generator=g).tolist()
    second = first[:1000] + torch.randint(10, model.config.vocab_size, (300,), generator=g).tolist()
    out = {}
    for mode in ("layerwise", "whole"):
        engine = prefill_engine(model, connector, mode, max_batched_tokens=256, block_size=16,
                                kv_cache_bytes=32 << 20, prefix_caching=True)
        params = TextParams(max_tokens=4, temperature=0, ignore_eos=True)
        for rid, ids in (("a", first), ("b", second)):
            engine.add(PrefillTask(rid, ids, params, time.time() + 60))
            results = []
            while engine.has_work:
                results += [r for r in outcomes(engine.step()) if not is_first_token(r)]
            (result,) = results
            assert is_result(result), result
            out[mode, rid] = import_kv(connector, result.outputs.kv_key, result.outputs.kv_handle, timeout=5)
        assert engine.stats["prefix_cached_tokens"] == 992   # 62 full blocks of b reused
    for rid, ids in (("a", first), ("b", second)):
        assert out["layerwise", rid].shape[2] == len(ids)
        assert torch.equal(out["layerwise", rid], out["whole", rid])
    assert shm_keys(tmp_path) == []
    # Every layer piece and whole KV was gathered in place; only the two manifests were copied.
    health = connector.health()
    assert health["puts"] - health["puts_in_place"] == 2
    assert health["puts_in_place"] == 2 * len(model.layers) + 2


def test_first_token_that_ends_the_request_leaves_no_piece(model, tok, connector, tmp_path):
    engine = prefill_engine(model, connector, "layerwise")
    engine.add(PrefillTask("one", chat_ids(tok, QUESTIONS[1]), TextParams(max_tokens=1, temperature=0),
                           time.time() + 60))
    results = []
    while engine.has_work:
        results += outcomes(engine.step())
    assert results[0].finish_reason == "length" and not results[0].outputs
    assert shm_keys(tmp_path) == []


def test_failed_put_mid_stream_fails_the_request_and_deletes_every_piece(model, tok, tmp_path):
    # Every 3rd put fails: the third layer of the first sequence finishing in the step.
    conn = create_connector("fault_injection", {"inner": "shared_memory", "inner_options": {"shm_dir": str(tmp_path)},
                                                "fail_every_nth_put": 3})
    try:
        engine = prefill_engine(model, conn, "layerwise", max_batched_tokens=4096)
        for i, q in enumerate(QUESTIONS[:2]):
            engine.add(PrefillTask(f"r{i}", chat_ids(tok, q), GREEDY, time.time() + 60))
        results = []
        for _ in range(500):   # one forward; the failures arrive once the hand-off job has returned
            if not engine.has_work:
                break
            results += [r for r in outcomes(engine.step()) if not is_first_token(r)]
        assert [r.error_type for r in results] == ["transfer_failed", "transfer_failed"], results
        assert engine.stats["prefill_steps"] == 1 and not engine.has_work and engine.allocator.free == engine.runner.num_blocks - 1
        assert shm_keys(tmp_path) == []
    finally:
        conn.close()


class _GatedConnector:
    """Forwards to a real connector; every put (in place or not) waits for the test to open the
    gate once."""

    def __init__(self, inner):
        self.inner = inner
        self.gate = threading.Semaphore(0)
        self.puts = 0

    def _pass_gate(self):
        assert self.gate.acquire(timeout=10), "test never let the put through"
        self.puts += 1

    def put(self, key, payload):
        self._pass_gate()
        return self.inner.put(key, payload)

    def reserve(self, layout):
        return self.inner.reserve(layout)

    def put_reserved(self, key, reservation, extra=None):
        self._pass_gate()
        return self.inner.put_reserved(key, reservation, extra)

    def release(self, reservation):
        self.inner.release(reservation)

    def get(self, key, handle=None, timeout=30.0):
        return self.inner.get(key, handle, timeout)

    def delete(self, key):
        self.inner.delete(key)


def test_abort_mid_transfer_deletes_every_piece(model, connector, tmp_path):
    runner = local_runner(model, block_size=4, budget_bytes=1 << 20)
    gated = _GatedConnector(connector)
    seqs = [ExportSequence(f"kv/s{i}/0", [1 + 2 * i, 2 + 2 * i], 7) for i in range(2)]
    export = LayerwiseExport(gated, runner.cache, seqs, len(model.layers))
    for layer in range(len(model.layers)):
        export.layer_done(layer)
    for _ in range(3):   # three pieces out, the fourth put waits at the gate
        gated.gate.release()
    deadline = time.time() + 10
    while len(shm_keys(tmp_path)) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(shm_keys(tmp_path)) == 3
    # abort() while a put is blocked: it lets that put finish, stops, joins and deletes.
    gated.gate.release()
    export.abort()
    assert export.state is ExportState.ABORTED and not export._thread.is_alive()
    assert gated.puts <= 4 and shm_keys(tmp_path) == []
    assert export.complete({"kv/s0/0"})["kv/s0/0"].error_type == "transfer_failed"


def test_release_kv_deletes_a_layerwise_handoff_nobody_imported(model, tok, connector, tmp_path):
    engine = prefill_engine(model, connector, "layerwise")
    result = run_prefill(engine, [chat_ids(tok, QUESTIONS[2])])["r0"]
    assert len(shm_keys(tmp_path)) == model.config.num_layers + 1
    release_kv(connector, result.outputs.kv_key)   # key only (a CancelTask's inputs may lack the handle)
    assert shm_keys(tmp_path) == []
    release_kv(connector, result.outputs.kv_key)   # twice: nothing there, no error


def test_decode_cancel_before_admission_deletes_the_pieces(model, tok, connector, tmp_path):
    prompts = [chat_ids(tok, QUESTIONS[0])]
    prefilled = run_prefill(prefill_engine(model, connector, "layerwise"), prompts)
    decode = decode_engine(model, connector, num_blocks=64)
    from omnirelay.workers.llm.decode import DecodeTask
    r = prefilled["r0"]
    assert r.outputs.layers == model.config.num_layers   # the hand-off says its layout
    decode.add(DecodeTask("r0", prompts[0], r.token, GREEDY, time.time() + 60, "", r.outputs.kv_key,
                          r.outputs.kv_handle, kv_layers=r.outputs.layers))
    assert decode.cancel("r0")   # every piece deleted by name: the manifest is not read
    assert shm_keys(tmp_path) == []


def test_missing_piece_fails_the_import_and_deletes_the_rest(model, tok, connector, tmp_path):
    result = run_prefill(prefill_engine(model, connector, "layerwise"), [chat_ids(tok, QUESTIONS[2])])["r0"]
    key = result.outputs.kv_key
    connector.delete(piece_key(key, 2))
    with pytest.raises(Exception) as info:
        import_kv(connector, key, result.outputs.kv_handle, timeout=0.2)
    assert getattr(info.value, "error_type", "") == "transfer_failed"
    assert shm_keys(tmp_path) == []


def test_layerwise_over_redis_equals_transformers_and_leaves_no_key(model, tok, reference, tmp_path):
    server = started_redis(tmp_path)
    conn = create_connector("redis", {"url": server.url, "prefix": f"ortest-{uuid.uuid4().hex[:8]}:"})
    try:
        prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
        prefill = prefill_engine(model, conn, "layerwise")
        prefilled = run_prefill(prefill, prompts)
        assert prefill.stats["kv_layerwise_handoffs"] == len(prompts)
        named = [k for k in server.keys() if "#" not in k]   # a payload's data keys carry a '#' suffix
        assert len(named) == len(prompts) * (model.config.num_layers + 1)
        outputs = run_decode(decode_engine(model, conn, num_blocks=256), prompts, prefilled)
        for i, ids in enumerate(prompts):
            assert outputs[f"r{i}"] == reference(ids), QUESTIONS[i]
        assert server.keys() == []
    finally:
        conn.close()
        server.stop()


def test_pipeline_yaml_kv_transfer_option():
    def stages(engine_args):
        return {"stages": [{"name": "prefill", "role": "prefill", "engine_args": engine_args},
                           {"name": "decode", "role": "decode"}],
                "connectors": {"kv": {"type": "shared_memory", "options": {}}},
                "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}
    assert parse_pipeline(stages({})).stage_for_role("prefill").kv_transfer == "auto"
    assert parse_pipeline(stages({"kv_transfer": "whole"})).stage_for_role("prefill").kv_transfer == "whole"
    with pytest.raises(PipelineError, match="kv_transfer"):
        parse_pipeline(stages({"kv_transfer": "sometimes"}))


def test_layerwise_prefill_to_a_tp2_decode_reshards_by_heads(model, tok, reference, tiny_model, connector, tmp_path):
    """Pieces carry all KV heads of their layer: a TP=2 decode splits the assembled KV by heads."""
    from omnirelay.workers.llm.decode import DecodeEngine
    from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner

    prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
    prefilled = run_prefill(prefill_engine(model, connector, "layerwise"), prompts)
    runner = GroupRunner(GroupConfig(tiny_model, tp_size=2, block_size=16, num_blocks=128))
    try:
        engine = DecodeEngine(runner, connector, max_num_seqs=16, max_model_len=2048, transfer_timeout_s=5)
        outputs = run_decode(engine, prompts, prefilled)
    finally:
        runner.close()
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(ids), QUESTIONS[i]
    assert shm_keys(tmp_path) == []


def test_auto_streams_only_a_step_with_enough_kv(model, tok, connector):
    """``auto`` (the default) streams layers for a step whose finishing sequences hold at least
    ``layerwise_min_bytes`` of KV and puts smaller ones whole; decode reads both the same."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    small = prefill_engine(model, connector, "auto")    # the default 16 MiB: the tiny model's KV is far below
    assert PrefillEngine(runner_for(model), connector, max_model_len=2048).kv_transfer == "auto"
    a = run_prefill(small, prompts)
    assert small.stats.get("kv_layerwise_handoffs", 0) == 0 and small.stats["kv_handoffs"] == len(prompts)
    # Read (and so delete) the first run's KV before the second run puts under the same keys.
    kv_a = {k: import_kv(connector, r.outputs.kv_key, r.outputs.kv_handle, timeout=5) for k, r in a.items()}
    big = prefill_engine(model, connector, "auto", layerwise_min_bytes=1)
    b = run_prefill(big, prompts)
    assert big.stats["kv_layerwise_handoffs"] == len(prompts)
    for key in a:
        kv_b = import_kv(connector, b[key].outputs.kv_key, b[key].outputs.kv_handle, timeout=5)
        assert a[key].token == b[key].token and torch.equal(kv_a[key], kv_b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["layerwise", "whole"])
def test_pipeline_switch_reaches_the_prefill_worker(mode, tiny_model, tmp_path):
    """omni-serve with the stage's ``engine_args.kv_transfer``: the prefill worker hands off that way
    (its heartbeat stats count layerwise handoffs) and the answer equals transformers."""
    import openai
    import yaml
    from conftest import ServeProcess, hf_chat_greedy

    pipeline = {"stages": [{"name": "prefill", "role": "prefill", "engine_args": {"kv_transfer": mode}},
                           {"name": "decode", "role": "decode"}],
                "connectors": {"kv": {"type": "shared_memory", "options": {}}},
                "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--stage-configs-path", str(path),
                         "--log-level", "WARNING", log_path=str(tmp_path / "serve.log"))
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        content = QUESTIONS[1]
        response = client.chat.completions.create(
            model="tiny-llm", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=8,
            extra_body={"return_token_ids": True})
        assert response.choices[0].model_extra["token_ids"] == hf_chat_greedy(tiny_model, content, 8)
        # The stats arrive with the workers' heartbeats: read once the cluster says they are final.
        stats = next(w for w in settled_workers(serve.url) if w["role"] == "prefill")["stats"]
        assert stats.get("kv_handoffs") == 1, stats
        assert stats.get("kv_layerwise_handoffs", 0) == (1 if mode == "layerwise" else 0), stats
    finally:
        assert serve.stop() == 0, serve.output()[-3000:]


def test_abort_while_the_store_is_down_does_not_raise(model, connector, tmp_path):
    """Clean-up after a failed export must survive a store that is down (a Redis outage once
    crashed the prefill worker here): deletes that fail are logged and left to the TTL / sweep."""
    from omnirelay.errors import TransferFailed

    class DownForDeletes(_GatedConnector):
        def delete(self, key):
            raise TransferFailed(f"store unreachable during delete of {key!r}")

    down = DownForDeletes(connector)
    release_kv(down, "kv/nothing-here")   # missing, and its delete fails too: no exception
    runner = local_runner(model, block_size=4, budget_bytes=1 << 20)
    export = LayerwiseExport(down, runner.cache, [ExportSequence("kv/aborted/0", [1, 2], 7)], len(model.layers))
    down.gate.release()
    export.layer_done(0)
    deadline = time.time() + 10
    while not shm_keys(tmp_path) and time.time() < deadline:
        time.sleep(0.01)
    export.abort()   # the layer-0 piece cannot be deleted now: logged, not raised
    assert len(shm_keys(tmp_path)) == 1
    connector.delete(piece_key("kv/aborted/0", 0))
