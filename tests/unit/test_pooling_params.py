"""The pooling contracts: a model's pooling resolved from its directory (sentence-transformers'
modules, the decoder default, ``--pooler-config``), the Matryoshka rule for ``dimensions``, and the
bus carrying a PoolingParams and a PooledResult through the strict decoder."""

from __future__ import annotations

import json

import msgspec
import pytest

from omnirelay.broker import protocol as p
from omnirelay.errors import InvalidParam
from omnirelay.pooling_params import PoolingParams, resolve_pooler_config


def _model(tmp_path, modules: list | None = None, pooling: dict | None = None, **config):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_decoder_default_is_last_token_normalised(tmp_path):
    config = resolve_pooler_config(_model(tmp_path))
    assert (config.pooling_type, config.normalize, config.source, config.matryoshka) == ("last", True, "default", None)


def test_sentence_transformers_modules(tmp_path):
    path = _model(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True})
    config = resolve_pooler_config(path)
    assert (config.pooling_type, config.normalize, config.source) == ("mean", False, "modules.json")
    (path / "modules.json").write_text(json.dumps([TRANSFORMER, POOLING, NORMALIZE]))
    assert resolve_pooler_config(path).normalize
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="exactly one"):
        resolve_pooler_config(path)


def test_pooler_config_flag_overrides_and_refuses_unknown_keys(tmp_path):
    path = _model(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_cls_token": True})
    config = resolve_pooler_config(path, '{"pooling_type": "MEAN", "normalize": false}')
    assert (config.pooling_type, config.normalize, config.source) == ("mean", False, "--pooler-config")
    for bad, match in [('{"softmax": true}', "'softmax' is not served"), ('{"pooling_type": "MAX"}', "pooling_type"),
                       ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=match):
            resolve_pooler_config(path, bad)


def test_dimensions_need_matryoshka(tmp_path):
    plain = resolve_pooler_config(_model(tmp_path))
    with pytest.raises(InvalidParam) as info:
        plain.params(dimensions=32)
    assert info.value.param == "dimensions"
    assert plain.params().dimensions == 0
    listed = resolve_pooler_config(_model(tmp_path, matryoshka_dimensions=[16, 32]))
    assert listed.params(dimensions=32).dimensions == 32
    with pytest.raises(InvalidParam, match="allowed: 16, 32"):
        listed.params(dimensions=20)
    anything = resolve_pooler_config(_model(tmp_path, is_matryoshka=True))
    assert anything.params(dimensions=20).dimensions == 20
    assert anything.params(dimensions=64).dimensions == 0   # the whole vector
    with pytest.raises(InvalidParam):
        anything.params(dimensions=65)


def test_pooling_request_travels_the_bus():
    params = PoolingParams(pooling="mean", normalize=False, dimensions=8, cache_salt="s")
    task = p.Task("r1", "prefill", "m", [1, 2, 3], params, None, "tcp://127.0.0.1:5", 1.0)
    assert p.decode(p.encode(task)).params == params
    result = p.PooledResult("r1", b"\x00\x00\x80\x3f" * 3, "w1")
    assert p.decode(p.encode(result)) == result
    for bad in (b"", b"\x00" * 5):
        with pytest.raises(p.ProtocolError):   # a peer's malformed vector is refused at decoding
            p.decode([p.VERSION_FRAME, p.PooledResult.TAG, msgspec.msgpack.encode({"request_id": "r1", "data": bad})])
    with pytest.raises(InvalidParam):
        PoolingParams(pooling="max")
