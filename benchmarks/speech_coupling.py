"""First audio of a streamed spoken answer alone, and while another request's one-shot token2wav runs.

Issue #42: a one-shot request's token2wav used to hold the speech engine's one turn for the whole
utterance (its noise came from the process-global random stream, swapped in under that turn), so a
new request's talker could not start until it ended. This measures what a new streamed request
waits for its first audio piece on the real engine of the tiny Qwen2.5-Omni (built by
``omni-make-model``'s builder), in two cases, ``--rounds`` times each:

* ``alone``: the streamed request is the only one;
* ``beside``: added the moment a one-shot request (``--one-shot-codes`` codes) enters its token2wav
  (a forward pre-hook on the DiT that only notes the first entry: it holds nothing back).

It also reports the talker's mean forward time (a forward hook on the talker module): the issue asks
that ``beside`` exceed ``alone`` by no more than about one talker step.

Run against another checkout (the code before the change) with ``--root DIR``: the ``omnirelay``
packages are then imported from DIR (its pyproject's package layout) instead of this tree. The
engine's loader and attributes moved in the change, so the script finds either.

    python benchmarks/speech_coupling.py --models /tmp/speech-models [--root /tmp/speech-before]
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

PACKAGE_DIRS = {"omnirelay": "omnirelay", "omnirelay.broker": "broker", "omnirelay.workers": "workers",
                "omnirelay.connectors": "connectors", "omnirelay.gateway": "gateway", "omnirelay.deploy": "deploy"}


class _RootFinder(importlib.abc.MetaPathFinder):
    """Imports ``omnirelay.*`` from another checkout, laid out as pyproject.toml's package-dir says."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "omnirelay" and not name.startswith("omnirelay."):
            return None
        base = max((p for p in PACKAGE_DIRS if name == p or name.startswith(p + ".")), key=len)
        rel = Path(PACKAGE_DIRS[base], *name[len(base):].lstrip(".").split(".")) if name != base \
            else Path(PACKAGE_DIRS[base])
        where = self.root / rel
        if (where / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(name, where / "__init__.py",
                                                          submodule_search_locations=[str(where)])
        if where.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, where.with_suffix(".py"))
        return None


def _engine(path: str, max_batch_size: int):
    """The tiny Qwen2.5-Omni's speech engine and the object holding its modules (either layout)."""
    try:
        from omnirelay.workers.speech.qwen2_5_omni import load_qwen2_5_omni
    except ImportError:   # before the families: the engine class loads itself and holds the modules
        from omnirelay.workers.speech.engine import GenerateSpeechEngine
        engine = GenerateSpeechEngine.from_pretrained(path, max_batch_size=max_batch_size)
        return engine, engine
    engine = load_qwen2_5_omni(path, max_batch_size=max_batch_size)
    return engine, engine.family


def _task(modules, request_id: str, *, codes: int, stream: bool, seed: int):
    import torch

    from omnirelay.speech_params import SpeechParams
    from omnirelay.workers.speech.engine import SpeechTask
    hidden = modules.thinker_embed.shape[1]
    gen = torch.Generator().manual_seed(seed)
    prompt = [int(t) for t in torch.randint(100, 1000, (16,), generator=gen)]
    reply = [int(t) for t in torch.randint(100, 1000, (codes // 2,), generator=gen)]
    return SpeechTask(request_id, prompt, torch.randn(len(prompt), hidden, generator=gen), reply,
                      torch.randn(len(reply) - 1, hidden, generator=gen),
                      SpeechParams("Chelsie", seed=seed, max_codes=codes), time.time() + 3600, stream=stream)


def _first_audio(engine, task) -> float:
    """Seconds from add to the first streamed piece of ``task``; then steps until the engine is idle."""
    start = time.perf_counter()
    engine.add(task)
    first = None
    while engine.has_work:
        step = engine.step()
        if first is None and any(c.request_id == task.request_id for c in step.chunks):
            first = time.perf_counter() - start
        if step.failed:
            raise RuntimeError(f"failed: {step.failed}")
    assert first is not None
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="/tmp/speech-coupling-models")
    parser.add_argument("--root", default=None, help="import omnirelay from this checkout instead")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one-shot-codes", type=int, default=600)
    parser.add_argument("--stream-codes", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.root:
        sys.meta_path.insert(0, _RootFinder(Path(args.root).resolve()))
    import torch
    torch.set_num_threads(args.threads)
    from omnirelay.deploy.builders.omni import build_tiny_omni
    path = Path(args.models) / "tiny-omni"
    if not path.exists():
        build_tiny_omni(path, seed=0)
    engine, modules = _engine(str(path), max_batch_size=2)
    talker_s: list[float] = []
    began: list[float] = []
    modules.talker.register_forward_pre_hook(lambda m, a: began.append(time.perf_counter()))
    modules.talker.register_forward_hook(lambda m, a, o: talker_s.append(time.perf_counter() - began[-1]))
    vocoding = threading.Event()
    modules.token2wav.code2wav_dit_model.register_forward_pre_hook(lambda m, a: vocoding.set())
    alone, beside, one_shot_s = [], [], []
    try:
        _first_audio(engine, _task(modules, "warm", codes=args.stream_codes, stream=True, seed=1))
        for r in range(args.rounds):
            alone.append(_first_audio(engine, _task(modules, f"alone{r}", codes=args.stream_codes, stream=True,
                                                    seed=2 + r)))
        talker_step = statistics.median(talker_s)   # the streamed requests' talker forwards, one at a time
        for r in range(args.rounds):
            vocoding.clear()
            t0 = time.perf_counter()
            engine.add(_task(modules, f"one-shot{r}", codes=args.one_shot_codes, stream=False, seed=50 + r))
            done_one_shot = None
            while not vocoding.is_set():   # its talker speaks; then its token2wav starts
                step = engine.step()
                if step.outputs:
                    raise RuntimeError("the one-shot ended before its token2wav was seen")
            task = _task(modules, f"beside{r}", codes=args.stream_codes, stream=True, seed=2 + r)
            start = time.perf_counter()
            engine.add(task)
            first = None
            while engine.has_work:
                step = engine.step()
                if first is None and any(c.request_id == task.request_id for c in step.chunks):
                    first = time.perf_counter() - start
                if any(o.request_id.startswith("one-shot") for o in step.outputs):
                    done_one_shot = time.perf_counter() - t0
                if step.failed:
                    raise RuntimeError(f"failed: {step.failed}")
            beside.append(first)
            one_shot_s.append(done_one_shot)
    finally:
        engine.close()
    print(json.dumps({
        "root": args.root or "this tree", "rounds": args.rounds, "one_shot_codes": args.one_shot_codes,
        "stream_codes": args.stream_codes, "threads": args.threads,
        "talker_step_ms": round(talker_step * 1000, 1),
        "first_audio_alone_ms": [round(x * 1000) for x in alone],
        "first_audio_beside_one_shot_ms": [round(x * 1000) for x in beside],
        "median_alone_ms": round(statistics.median(alone) * 1000),
        "median_beside_ms": round(statistics.median(beside) * 1000),
        "median_added_ms": round((statistics.median(beside) - statistics.median(alone)) * 1000),
        "one_shot_e2e_ms": [round(x * 1000) for x in one_shot_s],
    }, indent=1))


if __name__ == "__main__":
    main()
