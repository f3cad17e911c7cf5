"""Prefill refusing a task's parameters deletes the media embeddings the task brought (issue #42):
nobody else will read them (the request fails here), as decode deletes the KV of a task it refuses.
Before, a refusal for bad params left the encode stage's key behind until its TTL.

A real prefill engine on the tiny model and a real shared-memory connector, driven through its role
adapter as the worker loop drives it.
"""

from __future__ import annotations

import time

import pytest
import torch

from omnirelay.broker import protocol as p
from omnirelay.errors import TransferFailed
from omnirelay.handoffs import EmbedsHandoff
from omnirelay.request_params import TextParams
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.workers.llm.roles import PrefillRole

from engine_support import connector, model, runner_for  # noqa: F401  (fixtures)

GW = "tcp://127.0.0.1:5001"


def test_prefill_refusing_bad_params_deletes_the_media_key(model, connector):  # noqa: F811
    role = PrefillRole("pre-1", PrefillEngine(runner_for(model), connector, max_model_len=2048))
    handle = connector.put("r1-mm", {"image_embeds": torch.zeros(4, 8)})
    vocab = model.config.vocab_size
    params = TextParams(max_tokens=4, logit_bias=[(vocab + 5, 1.0)])   # an id outside the vocabulary
    task = p.Task("r1", "prefill", "tiny-llm", [1, 5, 9, 14], params, EmbedsHandoff("r1-mm", handle), GW,
                  time.time() + 60)
    out = role.accept(task)
    assert [(m.request_id, m.error_type) for _, m in out] == [("r1", "bad_request")]
    with pytest.raises(TransferFailed):
        connector.get("r1-mm", timeout=0.05)
