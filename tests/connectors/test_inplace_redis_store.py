"""The in-place path (``reserve`` → ``put_reserved``) of the ``redis`` and ``mooncake_store``
connectors: the tensors are lent from the buffer the backend sends from, so ``put_reserved``
writes only the header and the added items, and the buffer goes back to the pool once the payload
is sent (or failed to be).

The contract suite checks what a consumer gets; this one checks that no copy was made: every
``codec.write_into`` call is counted (the encode copy goes through it), and so is the pool memory
a reservation holds. Redis and the Mooncake master are real servers on free ports of 127.0.0.1,
stopped by PID; producer and consumer are two connectors of this process. A backend that cannot
run here is skipped with the precise reason.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from connector_peer import make_payload, put_reserved, same_payload
from connector_servers import MooncakeMaster, RedisServer, free_port, started_mooncake_master, started_redis
from omnirelay.connectors import codec, create_connector
from omnirelay.errors import TransferFailed

pytestmark = pytest.mark.timeout(120)

BIG_MB = 1   # the payload's largest tensor: what a copy would write, and an in-place put does not


def _start_redis(workdir) -> tuple[RedisServer, dict]:
    server = started_redis(workdir)
    return server, {"url": server.url, "prefix": f"ortest-inplace-{uuid.uuid4().hex[:8]}:", "pool_mb": 8}


def _start_mooncake_master(workdir) -> tuple[MooncakeMaster, dict]:
    master = started_mooncake_master(workdir)
    return master, {"master": master.address, "segment_mb": 64, "pool_mb": 8}


@pytest.fixture(scope="module", params=["redis", "mooncake_store"])
def backend(request, tmp_path_factory):
    """(name, options) of a backend whose server runs for this module."""
    start = _start_redis if request.param == "redis" else _start_mooncake_master
    server, options = start(tmp_path_factory.mktemp(request.param))
    yield request.param, options
    server.stop()


def _open(name: str, options: dict):
    try:
        return create_connector(name, options)
    except TransferFailed as exc:   # e.g. Mooncake's engine cannot start in this sandbox
        pytest.skip(f"{name} unavailable: {exc}")


@pytest.fixture(scope="module")
def pair(backend):
    """A producer and a consumer connector, shared by the module (a store client takes a second
    to close): tests compare counters before and after."""
    name, options = backend
    producer, consumer = _open(name, options), _open(name, options)
    yield producer, consumer
    consumer.close()
    producer.close()


@pytest.fixture
def bytes_written(monkeypatch) -> list[int]:
    """Bytes each ``codec.write_into`` call writes (header and data): what encoding copies."""
    written: list[int] = []
    write_into = codec.write_into

    def counting(buf, encode_plan):
        written.append(len(encode_plan.header) + sum(data.nbytes for _, data in encode_plan.writes))
        write_into(buf, encode_plan)

    monkeypatch.setattr(codec, "write_into", counting)
    return written


def _counters(conn) -> dict[str, int]:
    health = conn.health()
    return {k: health.get(k, 0) for k in ("puts_in_place", "reserved_copied", "pool_in_use", "reservations_open")}


def _published_and_got(producer, consumer, key: str, payload: dict) -> None:
    handle = put_reserved(producer, key, payload)
    try:
        assert same_payload(consumer.get(key, handle, timeout=10), payload) == []
    finally:
        consumer.delete(key)


def test_put_reserved_sends_the_lent_buffer_without_copying_the_tensors(pair, bytes_written):
    producer, consumer = pair
    payload = make_payload(801, BIG_MB)
    before = _counters(producer)
    reservation = producer.reserve({"big": (tuple(payload["big"].shape), payload["big"].dtype)})
    # The tensors lie in the pool: the memory the payload is sent (or upserted) from.
    assert _counters(producer)["pool_in_use"] - before["pool_in_use"] >= payload["big"].nbytes
    producer.release(reservation)

    _published_and_got(producer, consumer, f"inplace/{uuid.uuid4().hex}", payload)
    after = _counters(producer)
    assert len(bytes_written) == 1 and bytes_written[0] < 16 * 1024   # the header and the small items only
    assert after == {**before, "puts_in_place": before["puts_in_place"] + 1}


def test_a_reservation_larger_than_the_pool_is_written_in_place_too(backend, bytes_written):
    name, options = backend
    producer = _open(name, {**options, "pool_mb": 1})
    consumer = _open(name, options)
    try:
        payload = make_payload(802, 3)   # 3 MiB: the pool cannot hold it, a one-off buffer does
        _published_and_got(producer, consumer, f"inplace-big/{uuid.uuid4().hex}", payload)
        assert len(bytes_written) == 1 and bytes_written[0] < 16 * 1024
        assert _counters(producer) == {"puts_in_place": 1, "reserved_copied": 0, "pool_in_use": 0,
                                       "reservations_open": 0}
    finally:
        consumer.close()
        producer.close()


def test_extras_beyond_the_reserved_room_are_published_by_copy(pair, bytes_written):
    producer, consumer = pair
    payload = {**make_payload(803, BIG_MB), "large_blob": bytes(range(256)) * 256}   # 64 KiB: no room left
    before = _counters(producer)
    _published_and_got(producer, consumer, f"inplace-copied/{uuid.uuid4().hex}", payload)
    assert bytes_written[-1] > payload["big"].nbytes   # the fallback put encoded everything
    assert _counters(producer) == {**before, "reserved_copied": before["reserved_copied"] + 1}


def test_redis_put_reserved_that_cannot_send_gives_the_buffer_back():
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'omnirelay[redis]')")
    nobody = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there: the connection is refused
    conn = create_connector("redis", {"url": nobody, "connect_timeout_s": 0.5, "pool_mb": 8})
    try:
        reservation = conn.reserve({"kv": ((256, 1024), torch.float32)})
        reservation.tensors["kv"].fill_(1.0)
        with pytest.raises(TransferFailed, match="unreachable during put"):
            conn.put_reserved("unsent", reservation, {"n": 1})
        assert reservation.done and reservation.tensors == {}
        assert _counters(conn) == {"puts_in_place": 0, "reserved_copied": 0, "pool_in_use": 0,
                                   "reservations_open": 0}
        assert conn.health()["ok"] is False
    finally:
        conn.close()
