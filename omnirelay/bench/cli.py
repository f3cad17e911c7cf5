"""``omni-bench``: load any OpenAI-compatible server and report latency and throughput.

Example (the same settings as ``vllm bench serve``'s random dataset)::

    omni-bench --base-url http://127.0.0.1:8091 --tokenizer MODEL_DIR --dataset-name random \\
        --random-input-len 128 --output-len 64 --num-prompts 64 --max-concurrency 16 --ignore-eos \\
        --temperature 0 --result-file result.json --plot-dir plots/

``--sweep-concurrency 1,2,4,8,16`` runs one pass per level (and plots throughput against
concurrency); ``--request-rate R`` releases requests as a Poisson process of rate R instead of all
at once. Exit status: 0 when every pass completed at least one request, 1 otherwise, 2 on bad
arguments or when the benchmark cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys

from . import metrics, plots
from .client import ENDPOINT_PATHS, Target
from .datasets import DatasetError, Prompt, Tokenizer, file_prompts, random_prompts
from .runner import BenchmarkError, RunConfig, benchmark, discover_model, new_session


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8091", help="the server's root URL")
    server.add_argument("--endpoint-type", choices=sorted(ENDPOINT_PATHS), default="completions")
    server.add_argument("--endpoint", help="path of the endpoint (default: /v1/completions or /v1/chat/completions)")
    server.add_argument("--model", help="model id to request (default: the first of GET /v1/models)")
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    server.add_argument("--voice", default="", help="speech: the voice of /v1/audio/speech requests")
    server.add_argument("--audio-sample-rate", type=int, default=24000,
                        help="sample rate of the spoken answers' PCM (for audio_rtf)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "file"), default="random")
    data.add_argument("--dataset-path", help="JSONL or JSON file of {'prompt'} or {'conversations'} records")
    data.add_argument("--tokenizer", help="model directory whose tokenizer sizes the random prompts "
                                          "(default: --model when it is a directory; else prompts are words)")
    data.add_argument("--random-input-len", type=int, default=128, help="prompt length in tokens (or words)")
    data.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                      help="max_tokens per request")
    data.add_argument("--num-prompts", type=int, default=64)
    data.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    load.add_argument("--sweep-concurrency", type=_concurrency_list, metavar="C1,C2,...",
                      help="one pass per concurrency level, e.g. 1,2,4,8,16 (overrides --max-concurrency)")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests/s as a Poisson process (default: inf, all at once)")
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request, connect to last byte")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM's field)")
    sampling.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                          help='fields added to every request body, e.g. \'{"presence_penalty": 0.5}\'')
    out = p.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (milliseconds)")
    out.add_argument("--result-file", help="write the results as JSON here")
    out.add_argument("--plot-dir", help="write PNG plots here (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar (off anyway when stderr is not a TTY)")
    return p


def _prompts(args: argparse.Namespace) -> tuple[list[Prompt], str | None]:
    tokenizer_dir = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None
    if args.dataset_name == "file":
        if not args.dataset_path:
            raise DatasetError("--dataset-name file needs --dataset-path")
        return file_prompts(args.dataset_path, args.num_prompts, args.output_len, tokenizer), tokenizer_dir
    return random_prompts(args.num_prompts, args.random_input_len, args.output_len, tokenizer,
                          args.seed), tokenizer_dir


async def _model_id(args: argparse.Namespace) -> str:
    async with new_session(min(args.timeout, 30.0)) as session:
        return await discover_model(session, args.base_url, args.api_key)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_summary(run: dict, stream=sys.stdout) -> None:
    title = f" omni-bench: concurrency {run['max_concurrency'] or 'unlimited'}, rate {run['request_rate']} "
    lines = [f"{title:=^60}",
             f"{'Successful requests:':<40}{run['completed']}",
             f"{'Failed requests:':<40}{run['failed']}",
             f"{'Benchmark duration (s):':<40}{_fmt(run['duration'])}",
             f"{'Total input tokens:':<40}{run['total_input_tokens']}",
             f"{'Total generated tokens:':<40}{run['total_output_tokens']}",
             f"{'Output tokens from usage (requests):':<40}{run['output_tokens_from_usage']}",
             f"{'Request throughput (req/s):':<40}{_fmt(run['request_throughput'])}",
             f"{'Output token throughput (tok/s):':<40}{_fmt(run['output_throughput'])}",
             f"{'Total token throughput (tok/s):':<40}{_fmt(run['total_token_throughput'])}"]
    if "request_goodput" in run:
        lines.append(f"{'Request goodput (req/s):':<40}{_fmt(run['request_goodput'])}"
                     f"  ({run['good_requests']} good at {run['goodput_slo_ms']})")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + title + ' ':-^60}")
        for stat, shown in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            label = f"{shown} {name.upper()} (ms):"
            lines.append(f"{label:<40}{_fmt(run[f'{stat}_{name}_ms'])}")
    if run.get("audio_ttfps"):
        lines.append(f"{' Audio (spoken answers) ':-^60}")
        for stat, shown in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{shown + ' AUDIO_TTFP (ms):':<40}{_fmt(run[f'{stat}_audio_ttfp_ms'])}")
        for stat, shown in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{shown + ' AUDIO_RTF:':<40}{_fmt(run[f'{stat}_audio_rtf'], 3)}")
    if run["errors"]:
        lines.append(f"{' Errors ':-^60}")
        lines.extend(f"{e['count']:>5} x {e['error']}" for e in run["errors"][:10])
    lines.append("=" * 60)
    stream.write("\n".join(lines) + "\n")
    stream.flush()


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slo = metrics.parse_goodput(args.goodput or [])
        if args.plot_dir:
            plots.check_available()   # fail before the run, not after it
        prompts, tokenizer_dir = _prompts(args)
        model = args.model or asyncio.run(_model_id(args))
        target = Target(url=args.base_url.rstrip("/") + (args.endpoint or ENDPOINT_PATHS[args.endpoint_type]),
                        model=model, endpoint_type=args.endpoint_type, temperature=args.temperature,
                        ignore_eos=args.ignore_eos, api_key=args.api_key, extra_body=args.extra_body,
                        audio_sample_rate=args.audio_sample_rate, voice=args.voice)
        config = RunConfig(target=target,
                           concurrencies=args.sweep_concurrency or (args.max_concurrency,),
                           request_rate=args.request_rate, num_warmups=args.num_warmups,
                           timeout_s=args.timeout, seed=args.seed, slo=slo,
                           progress=not args.no_progress and sys.stderr.isatty())
        runs = asyncio.run(benchmark(config, prompts))
    except (ValueError, BenchmarkError, plots.PlotError) as exc:   # DatasetError is a ValueError
        print(f"omni-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:       # asyncio.run has cancelled and joined the request tasks
        print("\nomni-bench: interrupted", file=sys.stderr)
        return 130
    for run in runs:
        print_summary(run)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "base_url": args.base_url, "endpoint": target.url, "endpoint_type": args.endpoint_type,
            "model": model, "tokenizer": tokenizer_dir, "dataset_name": args.dataset_name,
            "dataset_path": args.dataset_path,
            "random_input_len": args.random_input_len if args.dataset_name == "random" else None,
            "output_len": args.output_len, "num_warmups": args.num_warmups, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "seed": args.seed, "timeout": args.timeout, "extra_body": args.extra_body}
    if args.result_file:
        result = {**meta, **runs[0]} if not args.sweep_concurrency else {**meta, "runs": runs}
        with open(args.result_file, "w") as handle:
            json.dump(result, handle, indent=1)
    if args.plot_dir:
        for path in plots.write_plots(runs, args.plot_dir):
            print(f"plot: {path}")
    return 0 if all(run["completed"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
