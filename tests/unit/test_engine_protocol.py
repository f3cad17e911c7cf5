"""Every role's engine implements the runtime's Engine protocol; abilities are declared by the role.

The class-level check covers all six engines without loading their models (a missing or renamed
method fails here, not in a worker at run time); the instance checks run real tiny engines: a
prefill engine with and without its prefix cache, and the roles that declare (or do not declare)
the cache to the loop.
"""

from __future__ import annotations

import inspect

import pytest

from omnirelay.workers.encode.engine import EncodeEngine
from omnirelay.workers.generate.image import GenerateImageEngine
from omnirelay.workers.generate.video import GenerateVideoEngine
from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.workers.runtime.engine import Engine, PrefixCacheSource
from omnirelay.workers.llm.roles import DecodeRole, PrefillRole
from omnirelay.workers.speech.engine import GenerateSpeechEngine

from engine_support import (  # noqa: F401
    QUESTIONS, chat_ids, connector, decode_engine, model, run_prefill, runner_for, tok)

ENGINES = [PrefillEngine, DecodeEngine, EncodeEngine, GenerateImageEngine, GenerateVideoEngine,
           GenerateSpeechEngine]
PROPERTIES = ("has_work", "num_requests")
METHODS = {"add": ["task"], "step": [], "cancel": ["request_id"], "wake": [], "close": []}


@pytest.mark.parametrize("engine_class", ENGINES, ids=lambda c: c.__name__)
def test_every_engine_class_has_the_protocol_members(engine_class):
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(engine_class, name), property), f"{engine_class.__name__}.{name}"
    for name, required in METHODS.items():
        method = getattr(engine_class, name, None)
        assert callable(method), f"{engine_class.__name__}.{name}"
        params = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
        positional = [p for p in params if p.default is inspect.Parameter.empty
                      and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(positional) == len(required), f"{engine_class.__name__}.{name}{inspect.signature(method)}"


def test_the_prefill_role_declares_its_prefix_cache_and_the_loop_reads_it_through_the_protocol(model, tok,
                                                                                             connector):
    cached = PrefillEngine(runner_for(model, block_size=8, kv_cache_bytes=4 << 20), connector, max_model_len=2048)
    uncached = PrefillEngine(runner_for(model, block_size=8, kv_cache_bytes=4 << 20), connector, max_model_len=2048,
                             prefix_caching=False)
    assert isinstance(cached, Engine) and isinstance(cached, PrefixCacheSource)
    assert PrefillRole("w", cached).prefix_cache is cached
    assert PrefillRole("w", uncached).prefix_cache is None
    decode = decode_engine(model, connector, num_blocks=64)
    assert isinstance(decode, Engine) and DecodeRole("w", decode).prefix_cache is None

    prompt = chat_ids(tok, QUESTIONS[0])
    run_prefill(cached, [prompt])
    added, evicted = cached.prefix_events()
    assert len(added) == len(prompt) // 8 and evicted == []
    assert cached.prefix_names() == added   # nothing evicted yet: every cached block, oldest first
