"""A spoken reply streamed from decode to the generate stage (workers/llm/reply_stream.py, read by
workers/speech/reply_source.py) over a real shared-memory connector: the chunks carry exactly what
the whole hand-off carries, the stream is announced after its first chunk and before the reply
ends, a consumer that falls a window behind holds the producer back without stalling its batch,
and a cancel leaves no key behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omnirelay.handoffs import SpeechHandoff
from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm import reply_stream
from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.llm.model_runner import LocalRunner
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.request_params import TextParams
from omnirelay.workers.speech.reply_source import ReplySource

from engine_support import (  # noqa: F401  (fixtures)
    QUESTIONS, chat_ids, connector, model, run_prefill, runner_for, shm_keys, tok)

REPLY_TOKENS = 11
CHUNK = 3


def make_decode(model, connector, chunk_tokens: int) -> DecodeEngine:
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=16, num_blocks=128)
    return DecodeEngine(LocalRunner(model, cache), connector, max_num_seqs=8, max_model_len=2048, transfer_timeout_s=5,
                        stream_chunk_tokens=chunk_tokens)


def speaking_task(connector, rid: str, ids: list[int], result) -> DecodeTask:
    prompt_key = f"speech/{rid}/0/prompt"
    speech = SpeechHandoff(prompt_key, connector.put(prompt_key, {"hidden": torch.zeros(2, 4)}))
    return DecodeTask(rid, ids, result.token, TextParams(max_tokens=REPLY_TOKENS, temperature=0,
                                                                   ignore_eos=True),
                      time.time() + 60, "", result.outputs.kv_key, result.outputs.kv_handle, speech_inputs=speech)


def run(engine: DecodeEngine, max_steps: int = 3000, until=None) -> dict:
    """Step until ``until()`` (default: no work left): every token, announced stream and failure."""
    seen = {"tokens": [], "streams": [], "failed": []}
    for _ in range(max_steps):
        out = engine.step()
        seen["tokens"] += out.tokens
        seen["streams"] += out.streams
        seen["failed"] += out.failed
        if (until or (lambda: not engine.has_work))():
            return seen
    raise AssertionError("the engine did not get there")


def read_to_the_end(handoff: SpeechHandoff, connector, engine: DecodeEngine) -> tuple[ReplySource, dict]:
    """A consumer reading ``handoff``'s stream on a thread (as the talker does) while the engine steps
    to its end: the reader, and what the steps produced (none failed)."""
    reader = ReplySource.streamed(handoff.reply_stream, connector, timeout_s=10, deadline=time.time() + 60)
    got = threading.Thread(target=reader.wait_end)
    got.start()
    rest = run(engine)
    got.join(30)
    assert not got.is_alive() and not rest["failed"]
    return reader, rest


def speak(model, connector, engine: DecodeEngine, ids: list[int]) -> None:
    """Prefill ``ids`` and hand the engine request r0, whose reply is spoken."""
    prefilled = run_prefill(PrefillEngine(runner_for(model), connector, max_model_len=2048), [ids])
    engine.add(speaking_task(connector, "r0", ids, prefilled["r0"]))


def test_a_streamed_reply_carries_what_the_whole_handoff_carries(model, tok, connector, tmp_path):
    ids = chat_ids(tok, QUESTIONS[2])
    whole = make_decode(model, connector, 0)
    streamed = make_decode(model, connector, CHUNK)
    try:
        prefilled = run_prefill(PrefillEngine(runner_for(model), connector, max_model_len=2048), [ids, ids])
        whole.add(speaking_task(connector, "r0", ids, prefilled["r0"]))
        reference = run(whole)
        (last,) = [t for t in reference["tokens"] if t.finish_reason]
        expected = connector.get(last.outputs.speech_reply_key, last.outputs.speech_reply_handle)
        last.outputs.release(connector)

        streamed.add(speaking_task(connector, "r1", ids, prefilled["r1"]))
        seen = run(streamed, until=lambda: bool(streamed.stats["speech_streams"]))
        ((rid, handoff),) = seen["streams"]
        assert rid == "r1" and handoff.reply_stream is not None and not handoff.speech_reply_key
        assert not any(t.finish_reason for t in seen["tokens"])   # announced while the reply goes on
        reader, rest = read_to_the_end(handoff, connector, streamed)
        (end,) = [t for t in seen["tokens"] + rest["tokens"] if t.finish_reason]
        assert end.outputs is None   # the stream was the hand-off
        assert reader.token_ids == expected["token_ids"]
        assert torch.equal(reader.states(), expected["hidden"])
        assert reader.chunks_read == -(-REPLY_TOKENS // CHUNK)
        handoff.release(connector)
        assert shm_keys(tmp_path) == []
    finally:
        whole.close()
        streamed.close()


def test_a_consumer_a_window_behind_holds_the_producer_back_not_its_batch(model, tok, connector, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(reply_stream, "STREAM_WINDOW", 2)
    ids = chat_ids(tok, QUESTIONS[1])
    engine = make_decode(model, connector, 1)
    try:
        speak(model, connector, engine, ids)
        seen = run(engine, until=lambda: engine.stats["speech_stream_deferred"] > 0
                   and len([t for t in engine.running]) == 0)
        ((_, handoff),) = seen["streams"]
        # Nobody reads: two chunks in the store, the reply itself decoded to its end meanwhile.
        # (the connector names its keys by hash: the prompt's states and two chunks)
        assert len(shm_keys(tmp_path)) == 1 + 2 and engine.num_requests == 1
        reader, rest = read_to_the_end(handoff, connector, engine)
        assert len(reader.token_ids) == REPLY_TOKENS and reader.num_states == REPLY_TOKENS - 1
        handoff.release(connector)
        assert shm_keys(tmp_path) == []
    finally:
        engine.close()


@pytest.mark.parametrize("when", ["streaming", "finishing"])
def test_a_cancelled_stream_leaves_no_key(model, tok, connector, tmp_path, monkeypatch, when):
    monkeypatch.setattr(reply_stream, "STREAM_WINDOW", 2)
    ids = chat_ids(tok, QUESTIONS[0])
    engine = make_decode(model, connector, 2)
    try:
        speak(model, connector, engine, ids)
        if when == "streaming":
            run(engine, until=lambda: bool(engine.stats["speech_streams"]))
        else:   # decoded to its end, the last chunks held back by the window
            run(engine, until=lambda: engine.stats["speech_stream_deferred"] > 0 and not engine.running)
        assert len(shm_keys(tmp_path)) > 1   # the prompt's states and chunks
        assert engine.cancel("r0") and engine.num_requests == 0
        run(engine)
        assert shm_keys(tmp_path) == []
    finally:
        engine.close()


def test_a_stream_its_consumer_finished_reading_is_closed_and_the_reply_goes_on(model, tok, connector, tmp_path,
                                                                                monkeypatch):
    """The talker stopped before the thinker (its codec budget): the broker's CancelTask.streams_only
    closes the stream. Nothing more is written, nothing unread is left, and the reply's last token
    leaves without waiting for a reader (a window-full writer would otherwise wait forever)."""
    monkeypatch.setattr(reply_stream, "STREAM_WINDOW", 2)
    ids = chat_ids(tok, QUESTIONS[3])
    engine = make_decode(model, connector, 1)
    try:
        speak(model, connector, engine, ids)
        seen = run(engine, until=lambda: engine.stats["speech_stream_deferred"] > 0)
        ((_, handoff),) = seen["streams"]
        reader = ReplySource.streamed(handoff.reply_stream, connector, timeout_s=10, deadline=time.time() + 60)
        assert reader.wait_tokens(1) and not reader.ended   # read a little, then stop reading
        engine.close_stream("r0")
        rest = run(engine)
        assert not rest["failed"] and engine.stats["speech_streams_closed"] == 1
        (last,) = [t for t in seen["tokens"] + rest["tokens"] if t.finish_reason]
        assert last.outputs is None and last.position == REPLY_TOKENS - 1
        connector.delete(handoff.speech_prompt_key)   # the consumer's part: the prompt's states
        assert shm_keys(tmp_path) == []               # no chunk left by the producer
    finally:
        engine.close()


def test_a_stream_closed_after_decode_finished_writing_it_is_still_cleaned_up(model, tok, connector, tmp_path):
    """The consumer's stop and decode's last chunk cross: CancelTask.streams_only arrives after
    decode reported its last token. The chunks the consumer did not read are deleted all the same."""
    ids = chat_ids(tok, QUESTIONS[4])
    engine = make_decode(model, connector, CHUNK)
    try:
        speak(model, connector, engine, ids)
        seen = run(engine)
        ((_, handoff),) = seen["streams"]
        reader = ReplySource.streamed(handoff.reply_stream, connector, timeout_s=10, deadline=time.time() + 60)
        assert reader.wait_tokens(1) and not reader.ended   # the talker read one chunk, then stopped
        engine.close_stream("r0")
        connector.delete(handoff.speech_prompt_key)          # the consumer's part
        assert shm_keys(tmp_path) == [] and engine.stats["speech_streams_closed"] == 1
    finally:
        engine.close()
