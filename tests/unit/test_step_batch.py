"""StepBatch (workers/speech/step_batch.py): the talker steps of the threads that are ready run as
one batch; a thread away (waiting for its thinker, vocoding) holds nobody back; a failed batch
fails the requests in it. Plain threads; every wait is bounded."""

from __future__ import annotations

import threading

import pytest

from omnirelay.workers.speech.step_batch import StepBatch


def test_seats_that_all_asked_run_as_one_batch():
    runs: list[list[str]] = []
    batch = StepBatch(lambda seats: runs.append(sorted(s.state for s in seats)))
    both_seated, steps = threading.Barrier(2), 5

    def talker(name: str) -> None:
        with batch.seat(name) as seat:
            both_seated.wait(10)
            for _ in range(steps):
                batch.ride(seat)

    threads = [threading.Thread(target=talker, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert runs == [["a", "b"]] * steps
    assert (batch.batches, batch.rows, batch.largest) == (steps, 2 * steps, 2)


def test_a_seat_away_holds_back_no_other():
    ran: list[list[str]] = []
    batch = StepBatch(lambda seats: ran.append([s.state for s in seats]))
    away, release = threading.Event(), threading.Event()

    def waiting_for_its_thinker() -> None:
        with batch.seat("slow"):
            batch.away(lambda: (away.set(), release.wait(10)))

    slow = threading.Thread(target=waiting_for_its_thinker)
    slow.start()
    assert away.wait(10)
    with batch.seat("fast") as seat:
        for _ in range(3):
            batch.ride(seat)   # would wait forever if the away seat were counted
    release.set()
    slow.join(10)
    assert ran == [["fast"]] * 3


def test_a_failed_batch_fails_each_request_in_it_and_the_next_batch_runs():
    calls = []

    def run(seats):
        calls.append(len(seats))
        if len(calls) == 1:
            raise RuntimeError("out of memory")

    batch = StepBatch(run)
    with batch.seat("r") as seat:
        with pytest.raises(RuntimeError, match="out of memory"):
            batch.ride(seat)
        batch.ride(seat)
    assert calls == [1, 1]


def test_the_last_seat_leaving_frees_what_the_batch_held():
    freed = []
    batch = StepBatch(lambda seats: None, idle=lambda: freed.append(True))
    with batch.seat("a") as a:
        with batch.seat("b"):
            batch.away(lambda: batch.ride(a))   # b away: a's step runs alone
        assert not freed
    assert freed == [True]


def test_batch_kv_lays_rows_side_by_side_and_gives_each_its_own_back():
    import torch
    from transformers import DynamicCache

    from omnirelay.workers.speech.talker_batch import BatchKV, KVRow

    def own(length: int, seed: int) -> DynamicCache:
        gen = torch.Generator().manual_seed(seed)
        cache = DynamicCache()
        for layer in range(2):
            keys, values = torch.randn(2, 1, 2, length, 4, generator=gen)
            cache.update(keys, values, layer)
        return cache

    rows = [KVRow(own(2, 0), 2, rope_delta=0), KVRow(own(4, 1), 4, rope_delta=-3)]
    before = [[(l.keys.clone(), l.values.clone()) for l in r.cache.layers] for r in rows]
    kv = BatchKV()
    cache, mask, positions = kv.take(rows)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]   # left padding, then the step's column
    assert positions[:, :, 0].tolist() == [[2, 1]] * 3            # own length + own rope delta
    new = [(torch.full((2, 2, 1, 4), float(layer)), torch.full((2, 2, 1, 4), -float(layer))) for layer in range(2)]
    for layer, (keys, values) in enumerate(new):   # what the forward appends
        cache.update(keys, values, layer)
    kv.advance()
    assert kv.take(rows)[0] is cache   # the same rows again: the same cache, nothing copied
    kv.give_back()
    for row, layers, length in zip(rows, before, (3, 5)):
        assert row.length == length and row.cache.get_seq_length() == length
        for layer, (keys, values) in enumerate(layers):
            assert torch.equal(row.cache.layers[layer].keys, torch.cat((keys, new[layer][0][:1]), dim=2))
            assert torch.equal(row.cache.layers[layer].values, torch.cat((values, new[layer][1][:1]), dim=2))
