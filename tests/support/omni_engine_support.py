"""The Omni engine chain with no network (not a test module), as tests/e2e/test_omni_thinker.py and
tests/e2e/test_qwen3_omni.py run it: the encode engine embeds a request's media, a prefill engine
prefills it in chunks of 8 tokens beside a text-only request, and a decode engine continues both.
The engines are imported when called, as the tests that use them do.
"""

from __future__ import annotations

import json
import os
import time

from engine_support import drain_prefill, runner_for


def encode_then_prefill(model_dir: str, encoders, connector, items: list, media_ids: list[int],
                        text_ids: list[int], greedy) -> tuple[object, object, dict]:
    """Encode ``items`` (the gateway's media items) for request "m", then prefill "m" (``media_ids``,
    with those embeddings) and the text request "t" (``text_ids``) in the same steps, in chunks of
    8 tokens. Returns (the encoder's outputs, the model, every prefill result by request id)."""
    from omnirelay.mrope import MropeSpec
    from omnirelay.workers.encode.engine import EncodeEngine, EncodeResult, EncodeTask, MediaItem
    from omnirelay.workers.llm.models.llama import LlamaModel
    from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask

    encode = EncodeEngine(encoders, connector)
    encode.add(EncodeTask("m", [MediaItem(m.kind, m.data) for m in items], time.time() + 60))
    (encoded,) = encode.step()
    assert isinstance(encoded, EncodeResult), encoded

    model = LlamaModel(model_dir)
    config = json.loads(open(os.path.join(model_dir, "config.json")).read())
    prefill = PrefillEngine(runner_for(model, block_size=4), connector, max_model_len=4096, max_batched_tokens=8,
                            mrope=MropeSpec.from_config(config))
    prefill.add(PrefillTask("m", media_ids, greedy, time.time() + 60, media=encoded.outputs))
    prefill.add(PrefillTask("t", text_ids, greedy, time.time() + 60))
    done = drain_prefill(prefill)
    assert prefill.stats["prefill_steps"] > (len(media_ids) + len(text_ids)) // 8   # really chunked
    return encoded.outputs, model, done


def decode_prefilled(model, connector, done: dict, prompts: dict[str, list[int]], greedy,
                     num_blocks: int) -> tuple[dict[str, list[int]], dict]:
    """Decode every prefilled request of ``prompts`` (request id → prompt ids, added in that order)
    in a pool of ``num_blocks`` blocks of 4 tokens until all finish. Returns (each request's tokens,
    its first token included; the decode engine's stats)."""
    from omnirelay.workers.kv.cache import PagedKVCache
    from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
    from omnirelay.workers.llm.model_runner import LocalRunner

    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=4, num_blocks=num_blocks)
    decode = DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=4, max_model_len=4096,
                          transfer_timeout_s=5)
    outputs = {}
    for rid, prompt in prompts.items():
        out = done[rid].outputs
        outputs[rid] = [done[rid].token]
        decode.add(DecodeTask(rid, prompt, done[rid].token, greedy, time.time() + 60, "", out.kv_key,
                              out.kv_handle, rope_delta=out.rope_delta, has_media=out.has_media))
    for _ in range(500):
        step = decode.step()
        assert not step.failed, step.failed
        for token in step.tokens:
            outputs[token.request_id].append(token.token)
        if not decode.has_work:
            break
    return outputs, decode.stats
