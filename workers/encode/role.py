"""The encode role, between the bus and :class:`~omnirelay.workers.encode.engine.EncodeEngine`.

``Task`` in: its ``inputs`` are the :class:`~omnirelay.handoffs.MediaInputs` the gateway put in the
request's Submit, the media in prompt order (image: the encoded file; audio: float32 little-endian
PCM at 16 kHz). Out: ``StageDone`` whose outputs (an :class:`~omnirelay.handoffs.EmbedsHandoff`,
the embeddings' connector key and the media shapes) become the prefill stage's inputs, or one ``StageFailed``
(``bad_request`` for media that does not decode or a malformed list, ``deadline_exceeded``,
a connector error). Nothing goes to the gateway from here: the first token comes from prefill.

Same interface as the adapters in ``roles.py``; the runtime treats it alike.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from omnirelay.errors import BadRequest
from omnirelay.broker import protocol as p
from omnirelay.handoffs import Handoff, MediaInputs
from omnirelay.model_kind import ModelKind, model_kind

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.encode.engine import EncodeEngine, EncodeTask, MediaItem, OmniEncoders
from omnirelay.workers.runtime.roles import Outbound, RoleAdapter

if TYPE_CHECKING:
    from omnirelay.workers.encode.qwen3 import Qwen3OmniEncoders

log = logging.getLogger("omnirelay.worker.encode")
MAX_ITEMS = 64   # far above what the gateway lets through; a bound on what one Task may ask for


def _items(inputs: Handoff | None) -> list[MediaItem]:
    if not isinstance(inputs, MediaInputs) or not inputs.media or len(inputs.media) > MAX_ITEMS:
        raise ValueError(f"inputs.media must be a list of 1 to {MAX_ITEMS} items")
    for i, item in enumerate(inputs.media):
        if item.kind not in ("image", "audio") or not item.data:
            raise ValueError(f"inputs.media[{i}] must be {{kind: image|audio, data: bytes}}")
    return [MediaItem(item.kind, item.data) for item in inputs.media]


class EncodeRole(RoleAdapter):
    role = "encode"

    def __init__(self, worker_id: str, engine: EncodeEngine):
        super().__init__(worker_id)
        self.engine = engine
        self.connector = engine.connector   # to delete its own output when the request died meanwhile

    def accept(self, task: p.Task) -> list[Outbound]:
        if task.request_id in self._attempts:
            self.engine.cancel(task.request_id)   # re-dispatched while we hold it: the new attempt wins
        try:
            items = _items(task.inputs)
        except ValueError as exc:
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, str(exc), attempt=task.attempt)]
        self._attempts[task.request_id] = task.attempt
        self.engine.add(EncodeTask(task.request_id, items, task.deadline, task.attempt))
        return []

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._attempts.pop(request_id, None)

    def step(self) -> list[Outbound]:
        out: list[Outbound] = []
        for result in self.engine.step():
            if result.error_type:
                out.append(self.failure(result.request_id, self.role, result.error_type, result.message))
            else:
                out.append(self._done(result.request_id, result.outputs, False))
        return out


def build_encode_role(config: WorkerConfig, connector) -> tuple[EncodeRole, Callable[[], dict]]:
    """The role adapter and heartbeat-stats function of an encode worker for a Qwen2.5-Omni or
    Qwen3-Omni directory (by its ``model_type``); ``config.capacity`` bounds the requests encoded together in one step."""
    dtype = getattr(torch, config.dtype)
    if model_kind(config.model_path) is ModelKind.QWEN3_OMNI:
        from omnirelay.workers.encode.qwen3 import Qwen3OmniEncoders
        encoders: OmniEncoders | Qwen3OmniEncoders = Qwen3OmniEncoders(config.model_path, dtype=dtype)
    else:
        encoders = OmniEncoders(config.model_path, dtype=dtype)
    engine = EncodeEngine(encoders, connector, max_batch=max(1, config.capacity))
    log.info("encode worker: %s, batch up to %d requests", config.model_path, engine.max_batch)

    def stats() -> dict:
        return {"running": 0, "waiting": len(engine.waiting), "encoder_cache_items": len(engine.cache),
                **engine.stats}

    return EncodeRole(config.worker_id, engine), stats
