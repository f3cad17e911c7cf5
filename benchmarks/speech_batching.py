"""The batched talker inside one speech engine (issue #25): N requests spoken one after another vs
the same N held at once (their talker steps one batched forward), per speech family, in process.

For each family: the wall time of N one-shot syntheses run alone, then of the same N added at once
and stepped to completion; the talker's share (the vocoder's time is measured around its calls and
subtracted), the mean batch size the step batch ran, and whether every request's audio was bitwise
what it was alone. Audio RTF = wall time / seconds of audio produced.

    python benchmarks/speech_batching.py --models /tmp/m --requests 8 --codes 200

``--models`` holds (or gets) the tiny models ``omni-make-model`` writes: tiny-omni, tiny-qwen3-omni,
tiny-qwen3-tts (the last skipped without the qwen_tts package).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import torch

from omnirelay.speech_params import SpeechParams


class VocoderClock:
    """Seconds spent inside the vocoder's one-shot entry (``chunked_decode`` where it has one, which
    calls its forward; else its forward), from any thread."""

    def __init__(self, module: torch.nn.Module):
        self.seconds = 0.0
        self._wrap(module, "chunked_decode" if hasattr(module, "chunked_decode") else "forward")

    def _wrap(self, module, name: str) -> None:
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(module, name, timed)


def omni_tasks(engine, count: int, codes: int) -> list:
    from omnirelay.workers.speech.engine import SpeechTask
    from omnirelay.workers.speech.qwen3 import Qwen3OmniFamily
    hidden = engine.family.thinker_embed.shape[1]
    tasks = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        prompt = [int(t) for t in torch.randint(100, 1000, (12 + 2 * i,), generator=gen)]
        if isinstance(engine.family, Qwen3OmniFamily):
            cfg = engine.family.config
            prompt = [cfg.im_start_token_id, cfg.user_token_id, *prompt, cfg.im_start_token_id, cfg.assistant_token_id]
        reply = [int(t) for t in torch.randint(100, 1000, (64,), generator=gen)]
        tasks.append(SpeechTask(f"r{i}", prompt, torch.randn(len(prompt), hidden, generator=gen), reply,
                                torch.randn(len(reply) - 1, hidden, generator=gen),
                                SpeechParams(engine.voices[0], seed=7, max_codes=codes), time.time() + 3600))
    return tasks


def tts_tasks(engine, count: int, codes: int) -> list:
    from transformers import AutoTokenizer

    from omnirelay.workers.speech.qwen3_tts import TTSTask
    tokenizer = AutoTokenizer.from_pretrained(engine.path)
    tasks = []
    for i in range(count):
        text = f"Request number {i} reads a sentence about the harbor town at dusk."
        ids = engine.family.wrap(tokenizer(text, add_special_tokens=False)["input_ids"])
        tasks.append(TTSTask(f"r{i}", ids, SpeechParams(engine.voices[0], seed=7, max_codes=codes), time.time() + 3600))
    return tasks


def measure(name: str, engine, vocoder: torch.nn.Module, tasks: list, sample_rate: int) -> dict:
    clock = VocoderClock(vocoder)
    engine.synthesize(tasks[0])   # warm-up
    clock.seconds = 0.0
    start = time.perf_counter()
    alone = {t.request_id: engine.synthesize(t)[0] for t in tasks}
    alone_s, alone_vocoder = time.perf_counter() - start, clock.seconds
    batches, rows = engine.step_batch.batches, engine.step_batch.rows
    clock.seconds = 0.0
    start = time.perf_counter()
    for task in tasks:
        engine.add(dataclasses.replace(task))
    outputs = {}
    while engine.has_work:
        out = engine.step()
        if out.failed:
            raise RuntimeError(f"{name}: {out.failed}")
        outputs.update({o.request_id: o.waveform for o in out.outputs})
    together_s, together_vocoder = time.perf_counter() - start, clock.seconds
    audio_s = sum(w.numel() for w in alone.values()) / sample_rate
    return {"family": name, "requests": len(tasks), "audio_s": round(audio_s, 2),
            "alone_s": round(alone_s, 3), "together_s": round(together_s, 3),
            "alone_talker_s": round(alone_s - alone_vocoder, 3),
            "together_talker_s": round(together_s - together_vocoder, 3),
            "speedup": round(alone_s / together_s, 2),
            "talker_speedup": round((alone_s - alone_vocoder) / max(1e-9, together_s - together_vocoder), 2),
            "rtf_alone": round(alone_s / audio_s, 3), "rtf_together": round(together_s / audio_s, 3),
            "mean_batch": round((engine.step_batch.rows - rows) / max(1, engine.step_batch.batches - batches), 2),
            "bitwise_as_alone": all(torch.equal(outputs[k], w) for k, w in alone.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="/tmp/m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--codes", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.models)
    results = []

    from omnirelay.deploy.builders.omni import build_tiny_omni
    from omnirelay.deploy.builders.qwen3_omni import build_tiny_qwen3_omni
    from omnirelay.workers.speech.engine import SAMPLE_RATE
    from omnirelay.workers.speech.qwen2_5_omni import load_qwen2_5_omni
    from omnirelay.workers.speech.qwen3 import load_qwen3_omni
    families = [("qwen2.5-omni", "tiny-omni", build_tiny_omni, load_qwen2_5_omni, omni_tasks),
                ("qwen3-omni", "tiny-qwen3-omni", build_tiny_qwen3_omni, load_qwen3_omni, omni_tasks)]
    if importlib.util.find_spec("qwen_tts") is not None:
        from omnirelay.deploy.builders.qwen3_tts import build_tiny_qwen3_tts
        from omnirelay.workers.speech.qwen3_tts import load_qwen3_tts
        families.append(("qwen3-tts", "tiny-qwen3-tts", build_tiny_qwen3_tts, load_qwen3_tts, tts_tasks))
    for name, folder, build, load, make_tasks in families:
        path = root / folder
        if not path.exists():
            build(path, seed=0)
        engine = load(str(path), max_batch_size=args.requests, device=args.device)
        engine.path = str(path)
        vocoder = engine.family.decoder if name == "qwen3-tts" else engine.family.token2wav
        try:
            results.append(measure(name, engine, vocoder, make_tasks(engine, args.requests, args.codes), SAMPLE_RATE))
        finally:
            engine.close()
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
