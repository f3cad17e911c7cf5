"""The prefill and decode role adapters: bus ``Task`` in, the LLM engines' outputs out as
``TokenDelta``/``TokenDeltas``/``StageDone``/``StageFailed`` (what every adapter shares is
:class:`~omnirelay.workers.runtime.roles.RoleAdapter`).

A step's list, for prefill and decode alike: its token deltas first, one message per gateway
(:func:`token_messages`), then the StageDone reports in the order the requests finished, then the
failures. So a request's token (prefill: its first token; decode: its last) always leaves before
its StageDone, which is what makes the broker dispatch the next stage. Decode's spoken reply may
instead be streamed (``workers/llm/reply_stream.py``): a ``StageStreaming`` with its stream's
hand-off follows the step's deltas as soon as the first chunk is written, and the StageDone after
the last token then carries no hand-off. A token of a request that
asked for logprobs carries them in its delta (``TokenDelta.logprobs``/``top_token_ids``/``top_logprobs``, filled from
``TokenOut.logprobs``, which the engine computed with :func:`~omnirelay.workers.llm.sampling.chosen_logprobs`).

A pooling request's result (prefill's ``TokenOut.pooled``) leaves as a ``PooledResult`` to its gateway
in place of a token delta, before the StageDone that ends the request (its only stage is prefill).

Both engines report a step as one :class:`~omnirelay.workers.llm.requests.EngineStep`, read by
one :meth:`_LlmRole.step`.
"""

from __future__ import annotations

from omnirelay.errors import BadRequest
from omnirelay.broker import protocol as p
from omnirelay.handoffs import EmbedsHandoff, KVHandoff, SpeechHandoff
from omnirelay.pooling_params import PoolingParams
from omnirelay.request_params import RequestParams, TextParams, speech_of, text_params_of

from omnirelay.workers.llm.decode import DecodeEngine, DecodeTask
from omnirelay.workers.llm.prefill import PrefillEngine, PrefillTask
from omnirelay.workers.llm.requests import TokenOut
from omnirelay.workers.runtime.roles import BROKER, Outbound, RoleAdapter


class _LlmRole(RoleAdapter):
    """What the prefill and decode adapters share: reading an engine step, and the LoRA adapters
    their engine holds."""

    def held_loras(self) -> list[str] | None:
        return self.engine.held_loras()

    def step(self) -> list[Outbound]:
        """One engine step: its tokens, one message per gateway, then the announced streams, then the
        stage reports of the requests this stage is done with (each after the message with its
        token), then the failures."""
        result = self.engine.step()
        tokens: list[TokenOut] = []
        pooled: list[Outbound] = []
        reports: list[Outbound] = []
        for token in result.tokens:
            if token.pooled is not None:
                pooled.append((self._reply_to.get(token.request_id, ""),
                               p.PooledResult(token.request_id, token.pooled, self.worker_id)))
            elif not token.token_sent:   # prefill's first token may have left ahead of its hand-off
                # Prefill's tokens go to the gateway the task named (decode's carry it).
                token.reply_to = token.reply_to or self._reply_to.get(token.request_id, "")
                tokens.append(token)
            if token.done:   # a speech request goes on to a speech stage with our outputs
                self._reply_to.pop(token.request_id, None)
                reports.append(self._done(token.request_id, token.outputs,
                                          bool(token.finish_reason) and not token.speech_next))
        out = pooled + token_messages(tokens, self.worker_id)
        # A spoken reply's first chunk is out: the broker may start the generate stage on it now.
        out += [(BROKER, p.StageStreaming(self.worker_id, request_id, self.role, handoff,
                                          attempt=self._attempts.get(request_id, 0)))
                for request_id, handoff in result.streams]
        out += reports
        for failure in result.failed:
            self._reply_to.pop(failure.request_id, None)
            out.append(self.failure(failure.request_id, self.role, failure.error_type, failure.message))
        return out


class PrefillRole(_LlmRole):
    role = "prefill"

    def __init__(self, worker_id: str, engine: PrefillEngine):
        # The engine's connector: to delete its own output when the request died meanwhile.
        super().__init__(worker_id, engine, engine.connector)
        self.prefix_cache = engine if engine.prefix_caching else None

    def accept(self, task: p.Task) -> list[Outbound]:
        self._replace_held(task)
        try:
            params = text_params_of(task.params)
            _check_token_ids(params, self.engine)
        except ValueError as exc:
            self.release(task.inputs)   # the request fails here: nobody will read its media embeddings
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid params: {exc}")]
        if task.inputs is not None and not isinstance(task.inputs, EmbedsHandoff):
            self.release(task.inputs)
            return [self.failure(task.request_id, task.stage, BadRequest.error_type,
                                 f"prefill reads media embeddings, not {type(task.inputs).__name__}")]
        self._hold(task)
        self.engine.add(PrefillTask(task.request_id, list(task.prompt_token_ids), params, task.deadline,
                                    task.attempt, task.position_offset, speech=_speech_mode(task.params),
                                    media=task.inputs,
                                    priority=task.priority,
                                    pooling=task.params if isinstance(task.params, PoolingParams) else None))
        return []


class DecodeRole(_LlmRole):
    role = "decode"

    def __init__(self, worker_id: str, engine: DecodeEngine):
        super().__init__(worker_id, engine, engine.connector)

    def close_stream(self, request_id: str) -> None:
        self.engine.close_stream(request_id)

    def accept(self, task: p.Task) -> list[Outbound]:
        self._replace_held(task)
        kv = task.inputs
        try:
            if not isinstance(kv, KVHandoff):
                raise ValueError(f"decode reads a prefilled KV, not {type(kv).__name__}")
            params = text_params_of(task.params)
            _check_token_ids(params, self.engine)
            if kv.lora != params.lora:   # KV of one adapter never continues under another (or the base)
                raise ValueError(f"the KV was computed under LoRA adapter {kv.lora!r}, the request names {params.lora!r}")
            decode_task = DecodeTask(
                request_id=task.request_id, prompt_token_ids=list(task.prompt_token_ids),
                first_token=kv.first_token, params=params, deadline=task.deadline,
                reply_to=task.reply_to, kv_key=kv.kv_key, kv_handle=kv.kv_handle, kv_layers=kv.layers,
                position_offset=task.position_offset, speech_inputs=_speech_inputs(task.params, kv),
                rope_delta=kv.rope_delta, has_media=kv.has_media,
                priority=task.priority)
        except ValueError as exc:
            self.release(kv)   # the request fails here: nobody will import its KV
            return [self.failure(task.request_id, task.stage, BadRequest.error_type, f"invalid decode task: {exc!r}")]
        self._hold(task, reply_to=False)   # its DecodeTask carries the gateway
        self.engine.add(decode_task)
        return []


def token_messages(tokens: list[TokenOut], worker_id: str) -> list[Outbound]:
    """A step's tokens (one per request) as one message per gateway, in the order each gateway first
    appears, each gateway's tokens in step order: a worker serving many streams of one gateway would
    otherwise send (and the gateway receive and decode) a message per stream per step. A lone token
    goes as a plain TokenDelta: wrapping it saves no send, and a gateway serving a single stream
    keeps receiving exactly what it did before TokenDeltas existed."""
    by_gateway: dict[str, list[TokenOut]] = {}
    for token in tokens:
        by_gateway.setdefault(token.reply_to, []).append(token)
    out: list[Outbound] = []
    for reply_to, group in by_gateway.items():
        if len(group) == 1:
            out.append((reply_to, _delta(group[0], worker_id)))
        else:
            out.append((reply_to, p.TokenDeltas([_delta(t) for t in group], worker_id)))
    return out


def _delta(t: TokenOut, worker_id: str = "") -> p.TokenDelta:
    """One token as a delta, with its logprobs when the request asked (``TokenOut.logprobs``)."""
    prompt = None
    if t.prompt_logprobs is not None:
        lp = t.prompt_logprobs
        prompt = p.PromptLogprobs(lp.logprobs, lp.ranks, lp.top_ids if lp.k else [], lp.top_logprobs if lp.k else [])
    if t.logprobs is None:
        return p.TokenDelta(t.request_id, t.position, [t.token], t.finish_reason, worker_id,
                            cached_tokens=t.cached_tokens, prompt_logprobs=prompt)
    top = t.logprobs.top
    return p.TokenDelta(t.request_id, t.position, [t.token], t.finish_reason, worker_id,
                        logprobs=[t.logprobs.logprob], top_token_ids=[[i for i, _ in top]] if top else [],
                        top_logprobs=[[v for _, v in top]] if top else [], cached_tokens=t.cached_tokens,
                        prompt_logprobs=prompt)


def _check_token_ids(params: TextParams, engine: PrefillEngine | DecodeEngine) -> None:
    """``ValueError`` for a token id of the logits processors outside the model's vocabulary (the
    gateway checks too; a worker never indexes the logits out of range)."""
    if params.max_token_id >= 0:
        params.check_vocab(engine.runner.config.vocab_size)


def _speech_mode(params: RequestParams) -> str:
    """What prefill does for speech out: "" none, "reply" (decode's reply is spoken), "prompt"
    (``/v1/audio/speech``: the prompt's teacher-forced tail is spoken). See ``omnirelay.speech_params``."""
    speech = speech_of(params)
    if speech is None:
        return ""
    return "prompt" if speech.reply_start >= 0 else "reply"


def _speech_inputs(params: RequestParams, kv: KVHandoff) -> SpeechHandoff | None:
    """Prefill's prompt states, which a speech request's decode passes on; None for text only."""
    if speech_of(params) is None:
        return None
    speech = kv.speech_prompt()
    if speech is None:
        raise ValueError("a speech request's KV hand-off holds no prompt states")
    return speech
