"""The sampling stage of one decode step, with and without the logits processors, no server.

What is measured (one torch thread, interleaved, ``--repeats`` rounds of ``--steps`` steps each;
the median round reported as µs per step, in process CPU time, which a loaded machine disturbs far
less than wall time): a batch of ``--batch`` greedy rows over a vocabulary of ``--vocab`` tokens,
each with a 128-token prompt and 64 output tokens, through

* ``sample`` alone (the path before the pipeline existed);
* ``LogitsProcessors.apply`` then ``sample``, no option set (today's path for such requests);
* the same with presence, frequency and repetition penalties on every row;
* the same with every option on every row (penalties, logit_bias, min_tokens, bad_words,
  allowed_token_ids; min_p too, which a greedy row skips: it cannot change the argmax).

Usage::

    python benchmarks/sampling_step.py [--batch 16] [--vocab 151936] [--steps 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from omnirelay.workers.llm.logits_processors import LogitsProcessors, TokenHistory
from omnirelay.request_params import TextParams
from omnirelay.workers.llm.sampling import sample


def _cases(vocab: int) -> dict[str, TextParams]:
    greedy = dict(temperature=0.0, max_tokens=64)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    return {
        "no options": TextParams(**greedy),
        "penalties": TextParams(**greedy, **penalties),
        "every option": TextParams(**greedy, **penalties, min_p=0.05, min_tokens=70,
                                       logit_bias=tuple((t, 2.0) for t in range(0, vocab, vocab // 16)),
                                       bad_words_token_ids=((5, 6), (7,), (8, 9, 10)),
                                       allowed_token_ids=tuple(range(0, vocab, 3))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    logits = torch.randn(args.batch, args.vocab)
    histories = [TokenHistory([rng.randrange(args.vocab) for _ in range(128)], 0,
                              [rng.randrange(args.vocab) for _ in range(64)]) for _ in range(args.batch)]
    processors = LogitsProcessors((2,))
    positions = list(range(args.batch))
    cases = _cases(args.vocab)

    def sample_only() -> None:
        sample(logits, [cases["no options"]] * args.batch, positions)

    def with_pipeline(name: str):
        params = [cases[name]] * args.batch
        return lambda: sample(processors.apply(logits, params, histories), params, positions)

    runs = {"sample only (before)": sample_only, **{f"pipeline + sample, {name}": with_pipeline(name)
                                                   for name in cases}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            run()   # warm
            start = time.process_time()
            for _ in range(args.steps):
                run()
            times[name].append((time.process_time() - start) / args.steps * 1e6)
    print(f"batch {args.batch}, vocab {args.vocab}, {args.steps} steps × {args.repeats} rounds, "
          "µs per step (process CPU time): median [min – max]")
    for name, values in times.items():
        print(f"  {name:<40} {statistics.median(values):>10.1f}  [{min(values):.1f} – {max(values):.1f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
