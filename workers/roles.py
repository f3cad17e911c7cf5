"""Adapters between bus messages and the engines: ``Task`` in, ``TokenDelta``/``TokenDeltas``/
``StageDone``/``StageFailed`` out. One adapter per role; the runtime treats them alike.

Each outgoing message is addressed either to :data:`BROKER` or to a gateway's ``reply_to``
endpoint, so the runtime knows which socket to use without looking inside. The runtime sends a
step's list in order, so a stage report placed after a token delta is sent after it.
"""

from __future__ import annotations

from omnirelay.broker import protocol as p

from .decode import DecodeEngine, DecodeTask, TokenOut
from .kv_export import delete_quietly, release_kv
from .prefill import PrefillEngine, PrefillTask
from .sampling import SamplingParams

BROKER = ""
Outbound = tuple[str, p.Message]   # (BROKER or a reply_to endpoint, message)


class RoleAdapter:
    role = ""
    connector = None   # the connector this role reads its inputs from, if any

    def release_inputs(self, inputs: dict) -> None:
        """Delete connector keys a previous stage produced for a request that died in between."""
        for name in ("kv_key", "mm_key"):   # KV from prefill; media embeddings from encode
            key = inputs.get(name)
            if self.connector is not None and isinstance(key, str) and key:
                if name == "kv_key":   # a layerwise KV is a manifest and one key per layer
                    handle = inputs.get("kv_handle")
                    release_kv(self.connector, key, handle if isinstance(handle, dict) else None)
                else:
                    delete_quietly(self.connector, key)

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._attempts: dict[str, int] = {}   # request → attempt of the task we hold, echoed in reports

    def failure(self, request_id: str, stage: str, error_type: str, message: str,
                attempt: int | None = None) -> Outbound:
        """A StageFailed report for the broker (``attempt`` defaults to the held task's)."""
        held = self._attempts.pop(request_id, 0)
        return BROKER, p.StageFailed(self.worker_id, request_id, stage, error_type, message,
                                     attempt=held if attempt is None else attempt)

    def _done(self, request_id: str, outputs: dict, finished: bool) -> Outbound:
        return BROKER, p.StageDone(self.worker_id, request_id, self.role, outputs, finished=finished,
                                   attempt=self._attempts.pop(request_id, 0))


class PrefillRole(RoleAdapter):
    role = "prefill"

    def __init__(self, worker_id: str, engine: PrefillEngine):
        super().__init__(worker_id)
        self.engine = engine
        self.connector = engine.connector   # to delete its own output when the request died meanwhile
        self._reply_to: dict[str, str] = {}

    def accept(self, task: p.Task) -> list[Outbound]:
        try:
            params = SamplingParams.from_wire(task.sampling)
        except (TypeError, ValueError) as exc:
            return [self.failure(task.request_id, task.stage, "bad_request", f"invalid sampling: {exc}")]
        self._reply_to[task.request_id] = task.reply_to
        self._attempts[task.request_id] = task.attempt
        self.engine.add(PrefillTask(task.request_id, list(task.prompt_token_ids), params, task.deadline,
                                    task.attempt, task.position_offset, speech=_speech_mode(task.sampling),
                                    media=dict(task.inputs) if "mm_key" in task.inputs else None))
        return []

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._reply_to.pop(request_id, None)
        self._attempts.pop(request_id, None)

    def step(self) -> list[Outbound]:
        out: list[Outbound] = []
        for result in self.engine.step():
            reply_to = self._reply_to.pop(result.request_id, "")
            if result.error_type:
                out.append(self.failure(result.request_id, self.role, result.error_type, result.message))
                continue
            # The first token goes to the gateway at once (time to first token), before decode.
            out.append((reply_to, p.TokenDelta(result.request_id, result.position, [result.first_token],
                                               result.finish_reason, self.worker_id)))
            out.append(self._done(result.request_id, result.outputs,
                                  bool(result.finish_reason) and not result.speech_next))
        return out


class DecodeRole(RoleAdapter):
    role = "decode"

    def __init__(self, worker_id: str, engine: DecodeEngine):
        super().__init__(worker_id)
        self.engine = engine
        self.connector = engine.connector

    def accept(self, task: p.Task) -> list[Outbound]:
        inputs = task.inputs
        try:
            params = SamplingParams.from_wire(task.sampling)
            decode_task = DecodeTask(
                request_id=task.request_id, prompt_token_ids=list(task.prompt_token_ids),
                first_token=int(inputs["first_token"]), params=params, deadline=task.deadline,
                reply_to=task.reply_to, kv_key=str(inputs["kv_key"]), kv_handle=dict(inputs["kv_handle"]),
                position_offset=task.position_offset, speech_inputs=_speech_inputs(task),
                rope_delta=int(inputs.get("rope_delta", 0)), has_media=bool(inputs.get("has_media", False)))
        except (KeyError, TypeError, ValueError) as exc:
            return [self.failure(task.request_id, task.stage, "bad_request", f"invalid decode task: {exc!r}")]
        self._attempts[task.request_id] = task.attempt
        self.engine.add(decode_task)
        return []

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._attempts.pop(request_id, None)

    def step(self) -> list[Outbound]:
        """One engine step: its tokens, one message per gateway, then the stage reports of the
        requests that finished (each after the message with its last token) and the failures."""
        result = self.engine.step()
        by_gateway: dict[str, list[TokenOut]] = {}
        reports: list[Outbound] = []
        for token in result.tokens:   # one token per running request per step
            by_gateway.setdefault(token.reply_to, []).append(token)
            if token.finish_reason:   # a speech request goes on to the generate stage with our outputs
                reports.append(self._done(token.request_id, token.outputs or {}, token.outputs is None))
        out = [(reply_to, self._token_message(tokens)) for reply_to, tokens in by_gateway.items()]
        out += reports
        for request_id, _reply_to, error_type, message in result.failed:
            out.append(self.failure(request_id, self.role, error_type, message))
        return out

    def _token_message(self, tokens: list[TokenOut]) -> p.Message:
        """One gateway's tokens of one step as one message. A lone token goes as a plain
        TokenDelta: wrapping it saves no send, and a gateway serving a single stream keeps
        receiving exactly what it did before TokenDeltas existed."""
        if len(tokens) == 1:
            (t,) = tokens
            return p.TokenDelta(t.request_id, t.position, [t.token], t.finish_reason, self.worker_id)
        return p.TokenDeltas([p.TokenDelta(t.request_id, t.position, [t.token], t.finish_reason) for t in tokens],
                             self.worker_id)


def _speech_mode(sampling: dict) -> str:
    """What prefill does for speech out: "" none, "reply" (decode's reply is spoken), "prompt"
    (``/v1/audio/speech``: the prompt's teacher-forced tail is spoken). See ``omnirelay.speech_params``."""
    audio = sampling.get("audio")
    if not isinstance(audio, dict):
        return ""
    reply_start = audio.get("reply_start", -1)
    return "prompt" if isinstance(reply_start, int) and reply_start >= 0 else "reply"


def _speech_inputs(task: p.Task) -> dict | None:
    """Prefill's prompt-state handles a speech request's decode passes on; None for text only."""
    if not isinstance(task.sampling.get("audio"), dict):
        return None
    return {"speech_prompt_key": str(task.inputs["speech_prompt_key"]),
            "speech_prompt_handle": task.inputs.get("speech_prompt_handle")}
