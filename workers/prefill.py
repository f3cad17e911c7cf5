"""Prefill engine: prompt → first token + KV cache handed to decode through the connector.

Life of a request through this engine::

    add(PrefillTask) ──▶ waiting (FIFO) ──step()──▶ forward over the prompt ──▶ sample first token
        ──▶ put KV to the connector under ``kv/<request_id>/<attempt>`` ──▶ PrefillResult(handles)

A request whose first token already ends it (EOS, a stop token, ``max_tokens == 1``) finishes here:
no KV is handed off and the decode stage is skipped. ``cancel`` drops a waiting request. The engine
holds no sockets; the worker runtime feeds it tasks and sends its results.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from omnirelay.connectors import Connector
from omnirelay.errors import OmniError

from .models.llama import LlamaModel
from .sampling import SamplingParams, sample
from .stopping import finish_reason_for


@dataclasses.dataclass
class PrefillTask:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float
    attempt: int = 0
    position_offset: int = 0


@dataclasses.dataclass
class PrefillResult:
    request_id: str
    first_token: int | None = None
    position: int = 0
    finish_reason: str = ""
    outputs: dict = dataclasses.field(default_factory=dict)
    error_type: str = ""
    message: str = ""


class PrefillEngine:
    def __init__(self, model: LlamaModel, connector: Connector, *, max_batch: int = 4, max_model_len: int):
        self.model = model
        self.connector = connector
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.waiting: collections.deque[PrefillTask] = collections.deque()
        self.stats = collections.Counter()

    @property
    def num_requests(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add(self, task: PrefillTask) -> None:
        self.waiting.append(task)

    def cancel(self, request_id: str) -> bool:
        for task in self.waiting:
            if task.request_id == request_id:
                self.waiting.remove(task)
                return True
        return False

    def step(self) -> list[PrefillResult]:
        results = []
        for _ in range(min(self.max_batch, len(self.waiting))):
            results.append(self._run(self.waiting.popleft()))
        return results

    def _run(self, task: PrefillTask) -> PrefillResult:
        if time.time() > task.deadline:
            return PrefillResult(task.request_id, error_type="deadline_exceeded", message="deadline passed before prefill")
        if not task.prompt_token_ids or len(task.prompt_token_ids) >= self.max_model_len:
            return PrefillResult(task.request_id, error_type="bad_request",
                                 message=f"prompt of {len(task.prompt_token_ids)} tokens does not fit "
                                         f"max_model_len {self.max_model_len}")
        logits, kv = self.model.prefill(task.prompt_token_ids)
        self.stats["prefill_tokens"] += len(task.prompt_token_ids)
        position = task.position_offset
        (token,) = sample(logits[None], [task.params], [position])
        reason = finish_reason_for(token, 1, len(task.prompt_token_ids) + 1, task.params,
                                   self.model.config.eos_token_ids, self.max_model_len)
        result = PrefillResult(task.request_id, first_token=token, position=position, finish_reason=reason)
        if reason:
            return result
        key = f"kv/{task.request_id}/{task.attempt}"
        try:
            handle = self.connector.put(key, {"kv": kv, "num_tokens": len(task.prompt_token_ids)})
        except OmniError as exc:
            return PrefillResult(task.request_id, error_type=exc.error_type, message=str(exc))
        self.stats["kv_handoffs"] += 1
        result.outputs = {"kv_key": key, "kv_handle": handle, "first_token": token}
        return result
