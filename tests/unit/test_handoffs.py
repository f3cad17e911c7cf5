"""Typed stage hand-offs (omnirelay/handoffs.py): they cross the bus unchanged inside StageDone, Task
and CancelTask; a worker older than them reads the map it always read, and what an old worker or
gateway sends (untagged maps) decodes as the typed hand-off; each releases every connector key it
holds, a layer-wise KV's pieces included, on a real shared-memory connector."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch

from omnirelay.broker import protocol as p
from omnirelay.request_params import TextParams
from omnirelay.connectors import create_connector
from omnirelay.errors import TransferFailed
from omnirelay.handoffs import EmbedsHandoff, KVHandoff, MediaInputs, MediaItem, SpeechHandoff, piece_key

KV = KVHandoff("kv/r1/0", {"segment": "a"}, 11, rope_delta=-3, has_media=True,
               speech_prompt_key="speech/r1/0/prompt", speech_prompt_handle={"segment": "b"})
EMBEDS = EmbedsHandoff("mm/r1/0", {"segment": "c"}, [[1, 4, 4]], [25])
SPEECH = SpeechHandoff("speech/r1/0/prompt", {"segment": "b"}, "speech/r1/0/reply", {"segment": "d"})
MEDIA = MediaInputs([MediaItem("image", b"\x89PNG"), MediaItem("audio", b"\x00\x00\x80?")])
HANDOFFS = [KV, KVHandoff("kv/r2/0", {}, 5), EMBEDS, SPEECH, SpeechHandoff("speech/r3/0/prompt"), MEDIA]


def _task(inputs) -> p.Task:
    return p.Task("r1", "decode", "m", [1, 2], TextParams(), inputs, "tcp://gw:1", 1e9)


def _frames(tag: bytes, body: dict) -> list[bytes]:
    return [p.VERSION_FRAME, tag, msgpack.packb(body, use_bin_type=True)]


@pytest.mark.parametrize("handoff", HANDOFFS, ids=lambda h: type(h).__name__)
def test_a_handoff_crosses_the_bus_as_itself(handoff):
    for msg in (p.StageDone("w", "r1", "prefill", handoff), _task(handoff), p.CancelTask("r1", handoff)):
        decoded = p.decode(p.encode(msg))
        assert decoded == msg
        assert type(getattr(decoded, "outputs", None) or decoded.inputs) is type(handoff)


def test_a_version_1_peer_is_refused_at_its_first_message():
    """Version 2 dropped the untyped sampling map and the untagged hand-offs: there was no release
    with them, so an old peer is refused outright instead of half understood."""
    frames = p.encode(_task(KV))
    with pytest.raises(p.ProtocolError, match="unsupported protocol version"):
        p.decode([bytes([1]), *frames[1:]])


def test_an_untagged_or_malformed_map_is_a_protocol_error():
    for bad in ({"weights": 1}, {"kv_key": "k", "kv_handle": {}, "first_token": 1}, {"mm_key": 7},
                {"media": [{"kind": "image", "data": "not bytes"}]}):
        with pytest.raises(p.ProtocolError, match="StageDone.outputs"):
            p.decode(_frames(b"DONE", {"worker_id": "w", "request_id": "r1", "stage": "prefill", "outputs": bad}))


# ------------------------------------------------------------------------------------ release


@pytest.fixture
def connector(tmp_path):
    conn = create_connector("shared_memory", {"shm_dir": str(tmp_path)})
    yield conn
    conn.close()


def _keys(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if os.path.islink(os.path.join(directory, n)))


def _gone(connector, *keys: str) -> bool:
    for key in keys:
        with pytest.raises(TransferFailed):
            connector.get(key, timeout=0.0)
    return True


def test_a_kv_handoff_releases_its_kv_and_the_speech_prompt(connector, tmp_path):
    handle = connector.put("kv/r1/0", {"kv": torch.zeros(2, 2, 3, 1, 4), "num_tokens": 3})
    prompt = connector.put("speech/r1/0/prompt", {"hidden": torch.zeros(3, 8)})
    kv = KVHandoff("kv/r1/0", handle, 7, speech_prompt_key="speech/r1/0/prompt", speech_prompt_handle=prompt)
    kv.release(connector)
    assert _keys(tmp_path) == [] and _gone(connector, "kv/r1/0", "speech/r1/0/prompt")
    kv.release(connector)   # twice (a CancelTask after a failure): nothing there, no error


def test_a_layerwise_kv_handoff_releases_every_piece(connector, tmp_path):
    """The manifest under the key names the layers: releasing deletes the pieces, which the key alone does not name."""
    layers = 3
    handles = [connector.put(piece_key("kv/r1/0", i), {"k": torch.ones(3, 1, 4), "v": torch.ones(3, 1, 4)})
               for i in range(layers)]
    manifest = connector.put("kv/r1/0", {"layerwise": layers, "num_tokens": 3, "handles": handles})
    assert len(_keys(tmp_path)) == layers + 1
    KVHandoff("kv/r1/0", manifest, 7).release(connector)   # layout unknown: the manifest is read
    assert _keys(tmp_path) == [] and _gone(connector, *(piece_key("kv/r1/0", i) for i in range(layers)))
    handles = [connector.put(piece_key("kv/r2/0", i), {"k": torch.ones(3, 1, 4), "v": torch.ones(3, 1, 4)})
               for i in range(layers)]
    connector.put("kv/r2/0", {"layerwise": layers, "num_tokens": 3, "handles": handles})
    KVHandoff("kv/r2/0", {}, 7, layers=layers).release(connector)   # layout given: no read, same keys deleted
    assert _keys(tmp_path) == []


def test_embeds_and_speech_handoffs_release_their_keys_and_media_holds_none(connector, tmp_path):
    embeds = EmbedsHandoff("mm/r1/0", connector.put("mm/r1/0", {"image_embeds": torch.zeros(4, 8)}), [[1, 2, 2]])
    speech = SpeechHandoff("speech/r1/0/prompt", connector.put("speech/r1/0/prompt", {"hidden": torch.zeros(3, 8)}),
                           "speech/r1/0/reply", connector.put("speech/r1/0/reply", {"hidden": torch.zeros(1, 8)}))
    prompt_only = SpeechHandoff("speech/r2/0/prompt", connector.put("speech/r2/0/prompt", {"hidden": torch.zeros(3, 8)}))
    MEDIA.release(connector)
    assert len(_keys(tmp_path)) == 4
    for handoff in (embeds, speech, prompt_only):
        handoff.release(connector)
    assert _keys(tmp_path) == []
