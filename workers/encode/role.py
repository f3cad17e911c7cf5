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

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.encode.engine import EncodeEngine, EncodeTask, MediaItem, OmniEncoders
from omnirelay.workers.runtime.assembly import BuiltRole, closed_on_error, open_connector
from omnirelay.workers.runtime.engine import RequestFailure
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
        # The engine's connector: to delete its own output when the request died meanwhile.
        super().__init__(worker_id, engine, engine.connector)

    def accept(self, task: p.Task) -> list[Outbound]:
        self._replace_held(task)
        try:
            items = _items(task.inputs)
        except ValueError as exc:
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, str(exc), attempt=task.attempt)]
        self._hold(task, reply_to=False)   # nothing goes to the gateway from here
        self.engine.add(EncodeTask(task.request_id, items, task.deadline, task.attempt))
        return []

    def step(self) -> list[Outbound]:
        return [self.failure(result.request_id, self.role, result.error_type, result.message)
                if isinstance(result, RequestFailure) else self._done(result.request_id, result.outputs, False)
                for result in self.engine.step()]


def build_encode_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """An encode worker for a Qwen2.5-Omni directory."""
    return _build(config, lambda dtype: OmniEncoders(config.model_path, dtype=dtype))


def build_qwen3_omni_encode_role(config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
    """An encode worker for a Qwen3-Omni directory."""
    from omnirelay.workers.encode.qwen3 import Qwen3OmniEncoders
    return _build(config, lambda dtype: Qwen3OmniEncoders(config.model_path, dtype=dtype))


def _build(config: WorkerConfig, load_encoders: Callable[[torch.dtype], OmniEncoders | Qwen3OmniEncoders]
           ) -> BuiltRole:
    """The role adapter, heartbeat stats and owned connector of an encode worker; ``config.capacity``
    bounds the requests encoded together in one step."""
    connector = open_connector(config)
    with closed_on_error(connector):
        engine = EncodeEngine(load_encoders(getattr(torch, config.dtype)), connector, max_batch=max(1, config.capacity))
    log.info("encode worker: %s, batch up to %d requests", config.model_path, engine.max_batch)

    def stats() -> dict:
        return {"running": 0, "waiting": len(engine.waiting), "encoder_cache_items": len(engine.cache),
                **engine.stats}

    return BuiltRole(EncodeRole(config.worker_id, engine), stats, owned=(connector,))
