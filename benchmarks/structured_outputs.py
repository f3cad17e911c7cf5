"""The cost per output token of a JSON schema on every request, in the real engines, no server.

A batch of ``--batch`` chat prompts is prefilled (PrefillEngine) and decoded (DecodeEngine) over the
shared-memory connector, ``--tokens`` output tokens each, twice per repeat, interleaved: with no
grammar, and with the same JSON schema on every request (xgrammar: one compiled grammar, one
matcher per sequence, the batch's bitmask filled in one call and applied to the logits, the
sampled token accepted). The schema asks for a long array of small objects, so every sequence
runs to ``--tokens`` in both modes and the step counts match. One torch thread, greedy.

Reported: decode milliseconds per step and per token (minimum and median over repeats), wall clock
and the engine thread's CPU time (``time.thread_time``: on a shared, loaded machine the wall clock
mostly measures waiting), the difference, the part spent in the grammar calls themselves (mask +
accept, timed inside the engine), the one-off costs (the worker's compile of the schema for the tokenizer, the gateway's
check) and the decode matchers' replay of prefill's token.

Usage::

    python benchmarks/structured_outputs.py [--model DIR] [--batch 8] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import msgspec
import torch

ITEM = {"type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
                       "sunny": {"type": "boolean"},
                       "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["city", "sunny", "rating"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}   # longer than any --tokens here
QUESTIONS = ["Weather report, please.", "What is the capital of France?", "Tell me a story.", "Why?",
             "List three colours.", "Count from one to five.", "Describe a rainy morning.", "Hi!"]


class _Timed:
    """Wraps a GrammarSampler, adding the seconds spent in mask and accept."""

    def __init__(self, inner):
        self.inner, self.seconds, self.cpu_seconds = inner, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __contains__(self, request_id):
        return request_id in self.inner

    def mask(self, logits, rows):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self.inner.mask(logits, rows)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    def accept(self, rows, tokens):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self.inner.accept(rows, tokens)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, help="HF directory (default: the tiny built-in model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from omnirelay.request_params import StructuredOutput
    from omnirelay.connectors import create_connector
    from omnirelay.deploy.builders.llm import default_model_dir
    from omnirelay.gateway.structured import check_spec
    from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
    from omnirelay.workers.kv.cache import PagedKVCache
    from omnirelay.workers.llm.model_runner import LocalRunner, local_runner
    from omnirelay.workers.llm.models.llama import LlamaModel
    from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
    from omnirelay.request_params import TextParams
    from omnirelay.workers.llm.structured_output import GrammarCompilerCache, GrammarSampler

    path = str(args.model or default_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    model = LlamaModel(path)
    cfg = model.config
    spec_text = json.dumps(SCHEMA)
    spec = StructuredOutput("json_schema", spec_text)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for q in (QUESTIONS * args.batch)[: args.batch]]
    params = TextParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    import xgrammar  # noqa: F401  (its import, about a second, is not the check's cost)

    start = time.perf_counter()
    check_spec("json_schema", spec_text)
    gateway_check_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    check_spec("json_schema", spec_text)
    gateway_cached_ms = (time.perf_counter() - start) * 1e3

    # per run: wall s, grammar wall s, steps, tokens, this thread's CPU s, grammar CPU s
    results: dict[bool, list[tuple[float, float, int, int, float, float]]] = {False: [], True: []}
    compile_ms = replayed = 0.0
    with tempfile.TemporaryDirectory() as shm_dir:
        connector = create_connector("shared_memory", {"shm_dir": shm_dir})
        try:
            for repeat in range(args.repeats):
                for constrained in (False, True):
                    compilers = GrammarCompilerCache(path, cfg.vocab_size, cfg.eos_token_ids)
                    if constrained:   # the one-off compile, outside the timed decode
                        start = time.perf_counter()
                        compilers.get(spec)
                        compile_ms = (time.perf_counter() - start) * 1e3
                    asked = msgspec.structs.replace(params, structured=spec if constrained else None)
                    prefill = PrefillEngine(local_runner(model, block_size=16, budget_bytes=256 << 20), connector,
                                            max_model_len=2048, prefix_caching=False,
                                            grammars=GrammarSampler(compilers))
                    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=16,
                                         num_blocks=args.batch * (-(-(64 + args.tokens) // 16) + 2) + 1)
                    grammars = _Timed(GrammarSampler(compilers))
                    decode = DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=args.batch,
                                          max_model_len=2048, grammars=grammars)
                    for i, ids in enumerate(prompts):
                        prefill.add(PrefillTask(f"r{repeat}-{i}", ids, asked, time.time() + 600))
                    done = []
                    while prefill.has_work:
                        done += [r for r in prefill.step().tokens if r.done]
                    for result in done:
                        i = int(result.request_id.rsplit("-", 1)[1])
                        decode.add(DecodeTask(result.request_id, prompts[i], result.token, asked,
                                              time.time() + 600, "", result.outputs.kv_key,
                                              result.outputs.kv_handle))
                    decode.step()   # imports and admits every KV, runs the first step (not timed)
                    while len(decode.running) < args.batch:
                        decode.step()
                    steps = tokens = 0
                    grammars.seconds = grammars.cpu_seconds = 0.0
                    start, cpu = time.perf_counter(), time.thread_time()
                    while decode.has_work:
                        out = decode.step()
                        assert not out.failed, out.failed
                        steps += 1
                        tokens += len(out.tokens)
                    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
                    results[constrained].append((elapsed, grammars.seconds, steps, tokens, cpu, grammars.cpu_seconds))
                    replayed = compilers.stats["grammar_replayed_tokens"]
        finally:
            connector.close()

    def per(kind: bool, index: int, unit: int) -> list[float]:
        return [r[index] / r[unit] * 1e3 for r in results[kind]]

    print(f"model {path}: batch {args.batch}, {args.tokens} tokens each, {args.repeats} repeats, 1 torch thread")
    for label, kind in (("no grammar", False), ("json_schema on every request", True)):
        step, token = per(kind, 0, 2), per(kind, 0, 3)
        print(f"  {label:30s} decode step min {min(step):7.3f} ms  median {statistics.median(step):7.3f} ms"
              f"  | per token min {min(token):6.3f} ms  median {statistics.median(token):6.3f} ms")
    # CPU time of the engine's thread: what the step costs, less what a loaded machine adds by waiting.
    for label, kind in (("no grammar", False), ("json_schema on every request", True)):
        step = per(kind, 4, 2)
        print(f"  {label:30s} decode step CPU min {min(step):7.3f} ms  median {statistics.median(step):7.3f} ms")
    extra_cpu = statistics.median(per(True, 4, 2)) - statistics.median(per(False, 4, 2))
    print(f"  difference of CPU medians per step: {extra_cpu:+.3f} ms "
          f"({extra_cpu / statistics.median(per(False, 4, 2)) * 100:+.1f}%); per token {extra_cpu / args.batch:+.3f} ms")
    print(f"  grammar calls' CPU per step: median {statistics.median(per(True, 5, 2)):.3f} ms, "
          f"per token {statistics.median(per(True, 5, 2)) / args.batch:.3f} ms")
    grammar_step = per(True, 1, 2)
    extra = statistics.median(per(True, 0, 2)) - statistics.median(per(False, 0, 2))
    print(f"  difference of medians per step: {extra:+.3f} ms ({extra / statistics.median(per(False, 0, 2)) * 100:+.1f}%)"
          f"; per token {extra / args.batch:+.3f} ms")
    print(f"  inside the grammar calls (mask + accept) per step: median {statistics.median(grammar_step):.3f} ms,"
          f" per token {statistics.median(grammar_step) / args.batch:.3f} ms")
    print(f"  one-off: worker compile {compile_ms:.1f} ms; gateway check {gateway_check_ms:.1f} ms cold, "
          f"{gateway_cached_ms:.3f} ms cached; decode replayed {int(replayed)} token(s) per batch "
          f"(prefill's first token of each sequence)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
