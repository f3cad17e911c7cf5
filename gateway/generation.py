"""One generation from the gateway's point of view: tokenize → submit → ordered tokens → text.

Life of a request through the gateway::

    validated GenerationRequest ──tokenize (chat template)──▶ length checks (400 if the prompt fills the
        context; max_tokens clamped to the room it leaves, as vLLM does)
        ──▶ Submit to the broker (stages of the model's pipeline, deadline, reply_to)
        ──▶ TokenDelta stream, reordered and de-duplicated by RequestStream
        ──▶ incremental detokenizer + stop strings ──▶ TextChunk events to the HTTP renderer
        ──▶ finish: last chunk carries finish_reason; a stop string cancels the rest upstream

A decode worker that dies mid-stream is reported ``resumable``: the gateway resubmits the prompt
plus the tokens the client already has, at the next position, so the client's stream continues
with no duplicated or missing token (the resubmission policy: ``resubmit.Submissions``). Leaving
early (client gone, error) always cancels upstream.

Logprobs: a request that asks (``GenerationRequest.logprobs`` >= 0) sends ``TextParams.logprobs``
with every submission, a resumed one too, so each token's chunk carries its position's logprobs
(:class:`~omnirelay.gateway.bus.PositionLogprobs`); positions delivered before a resume keep the
ones they came with. A token that arrives without them (a worker older than the field ignores it)
fails the request rather than answer with holes. :func:`token_text` is the text a renderer shows
for a token id.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from typing import AsyncIterator

import msgspec

from omnirelay.broker import protocol as p
from omnirelay.errors import BadRequest, OmniError, Unprocessable
from omnirelay.handoffs import MediaInputs, MediaItem
from omnirelay.request_params import StructuredOutput, TextParams

from .bus import BusClient, PositionLogprobs
from .detokenizer import IncrementalDetokenizer
from .models import ModelRuntime
from .reasoning import END as REASONING_END
from .reasoning import ReasoningMode, closed_in_prompt
from .resubmit import Submissions
from .sampling_options import check_vocab, submission_min_tokens, wire_options
from . import prompt_logprobs
from .output_options import truncate_prompt
from .schema import GenerationRequest, check_priority


@dataclasses.dataclass
class TextChunk:
    text: str
    token_ids: list[int]
    finish_reason: str = ""
    logprobs: list[PositionLogprobs] = dataclasses.field(default_factory=list)   # per token id, when asked


@dataclasses.dataclass
class Generation:
    request_id: str
    model: ModelRuntime
    request: GenerationRequest
    prompt_token_ids: list[int]
    max_tokens: int
    completion_tokens: int = 0
    resumes: int = 0
    stages: tuple[str, ...] = ()
    inputs: MediaInputs | None = None   # the first stage's (media for encode)
    sampling_options: dict = dataclasses.field(default_factory=dict)   # TextParams fields: sampling_options.wire_options
    reasoning: ReasoningMode | None = None   # chat on a thinking model: how its output splits (reasoning.py)
    structured: StructuredOutput | None = None   # request.structured, gated after the reasoning (prepare)
    cached_tokens: int = 0   # prompt tokens prefill took from its prefix cache (the first submission's)
    prompt_k: int = -1       # prefill scores the prompt with the top k (gateway/prompt_logprobs.py); -1: not
    prompt_logprobs: p.PromptLogprobs | None = None   # what it sent, when asked

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def prepare(model: ModelRuntime, request: GenerationRequest, prefix: str) -> Generation:
    """Tokenize and check the request against the model's context (400 when the prompt leaves no room
    for one token; ``max_tokens`` beyond the room is clamped to it, as vLLM does). CPU work
    that grows with the request: routes run it on the gateway's CPU pool (gateway/cpu_work.py), after
    :func:`check_size` has refused what cannot fit without doing it."""
    check_size(model, request)
    check_priority(request.priority, model.scheduling_policy)
    stages, inputs, reasoning = tuple(model.stages), None, None
    if request.kind == "chat":
        messages = request.messages
        media_param = next((f"messages[{i}].content" for i, m in enumerate(messages) if not isinstance(m["content"], str)),
                           None)
        if media_param is not None and model.media is None:
            kind = next(part["type"] for m in messages if not isinstance(m["content"], str)
                        for part in m["content"] if part["type"] != "text")
            raise Unprocessable(f"{media_param}: unsupported part {kind!r} (this model takes text)", param=media_param)
        items = []
        if media_param is not None:
            messages, items = model.media.extract(messages)
        prompt_ids, prompt_text = model.encode_chat_prompt(
            messages, request.tools.template_tools() if request.tools else None, request.template)
        reasoning = reasoning_mode(model, request, prompt_text)
        if items:
            prompt_ids = model.media.expand(prompt_ids, items)
            inputs = MediaInputs([MediaItem(m.kind, m.data) for m in items])
        else:   # nothing to encode: the request starts at prefill
            stages = tuple(s for s in stages if s != "encode")
    elif request.prompt is not None:
        prompt_ids = model.encode_text(request.prompt, request.template.add_special_tokens)
    else:
        prompt_ids = list(request.prompt_token_ids)
        check_vocab(prompt_ids, model.vocab_size, "prompt")
    if request.output.truncate_prompt_tokens is not None:
        if inputs is not None:
            raise Unprocessable("truncate_prompt_tokens is not served with media parts (a cut could split an "
                                "item's placeholder tokens)", param="truncate_prompt_tokens")
        prompt_ids = truncate_prompt(prompt_ids, request.output.truncate_prompt_tokens, model.max_model_len)
    if not prompt_ids:
        raise BadRequest("the prompt is empty after tokenization", param="prompt")
    check_vocab(list(request.stop_token_ids), model.vocab_size, "stop_token_ids")
    check_vocab(list(request.logprob_token_ids), model.vocab_size, "logprob_token_ids")
    room = model.max_model_len - len(prompt_ids)
    if room < 1:   # vLLM's words, which its clients match ("maximum context length")
        raise BadRequest(f"This model's maximum context length is {model.max_model_len} tokens. However, your "
                         f"request has {len(prompt_ids)} input tokens, which leaves no room for an answer. Please "
                         "reduce the length of the input.", param="messages" if request.kind == "chat" else "prompt")
    # vLLM's rule: max_tokens beyond the room the prompt leaves is clamped to it (absent: all of it).
    max_tokens = room if request.max_tokens is None else min(request.max_tokens, room)
    if request.kind != "chat":
        stages = tuple(s for s in stages if s != "encode")
    options = wire_options(request.options, vocab_size=model.vocab_size, tokenizer=model.tokenizer,
                           max_tokens=max_tokens)
    prompt_k = prompt_logprobs.asked(request)
    prompt_logprobs.check_size(prompt_k, len(prompt_ids), "prompt_logprobs" if request.prompt_logprobs >= 0 else "logprobs")
    return Generation(request_id=f"{prefix}-{uuid.uuid4().hex}", model=model, request=request,
                      prompt_token_ids=prompt_ids, max_tokens=max_tokens, stages=stages, inputs=inputs,
                      sampling_options=options, reasoning=reasoning,
                      structured=_answer_grammar(model, request.structured, reasoning), prompt_k=prompt_k)


def _answer_grammar(model: ModelRuntime, spec: StructuredOutput | None,
                    reasoning: ReasoningMode | None) -> StructuredOutput | None:
    """The request's grammar, applied after the reasoning when the model thinks first (vLLM's rule):
    unless the prompt closed the reasoning, the reasoning is not returned (include_reasoning false)
    or the server applies grammars to the reasoning too (--structured-outputs-in-reasoning)."""
    if spec is None or reasoning is None or reasoning.closed_in_prompt or not reasoning.include \
            or model.structured_outputs_in_reasoning:
        return spec
    return StructuredOutput(spec.kind, spec.spec, tuple(model.encode_text(REASONING_END)))


def reasoning_mode(model: ModelRuntime, request: GenerationRequest, prompt_text: str) -> ReasoningMode | None:
    """How a chat's output splits into reasoning and answer (None: the model has no reasoning parser)."""
    if model.reasoning_parser is None:
        return None
    variables = model.chat_variables(request.template, request.tools.template_tools() if request.tools else None)
    return ReasoningMode(model.reasoning_parser, closed_in_prompt(prompt_text),
                         thinking_off=variables.get("enable_thinking", True) is False,
                         include=request.include_reasoning)


def check_size(model: ModelRuntime, request: GenerationRequest) -> None:
    """Refuse, before any rendering or tokenizing, a prompt that cannot fit the context whatever its
    tokens: more characters than ``model.max_prompt_chars``, or more chat messages than the context has
    tokens (every message renders to at least one). 400 naming ``messages`` or ``prompt``."""
    if request.kind == "chat":
        messages = request.messages
        if len(messages) > model.max_model_len:
            raise BadRequest(f"{len(messages)} messages cannot fit this model's context of {model.max_model_len} "
                             "tokens", param="messages")
        chars = sum(len(m["content"]) if isinstance(m["content"], str)
                    else sum(len(part.get("text") or "") for part in m["content"]) for m in messages)
        param = "messages"
    else:
        chars, param = len(request.prompt or ""), "prompt"
    if chars > model.max_prompt_chars:
        raise BadRequest(f"the prompt has {chars} characters; no text over {model.max_prompt_chars} characters fits "
                         f"this model's context of {model.max_model_len} tokens", param=param)


def text_params(gen: Generation, generated: int) -> TextParams:
    """What the LLM stages sample for ``gen``'s submission that starts after ``generated`` tokens.
    Without a seed, a sampled request gets one here: it keys every position's random draw, so a
    resumed stream samples the same way whichever worker continues it."""
    req = gen.request
    seed = req.seed
    if seed is None and req.temperature > 0:
        seed = random.getrandbits(63)
    return TextParams(max_tokens=gen.max_tokens - generated, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, seed=seed, ignore_eos=req.ignore_eos,
                      stop_token_ids=tuple(req.stop_token_ids), logprobs=req.logprobs,
                      min_tokens=submission_min_tokens(req.options, generated), structured=gen.structured,
                      lora=gen.model.lora, lora_path=gen.model.lora_path if gen.model.lora else "",
                      prompt_logprobs=gen.prompt_k if not generated else -1, cache_salt=req.cache_salt,
                      logprob_token_ids=req.logprob_token_ids,
                      **gen.sampling_options)


async def run(bus: BusClient, gen: Generation, deadline: float) -> AsyncIterator[TextChunk]:
    """Yield text chunks until the generation finishes; cancels upstream if the caller stops early."""
    output = gen.request.output
    detok = IncrementalDetokenizer(gen.model.tokenizer, gen.request.stop, min_tokens=gen.request.options.min_tokens,
                                   include_stop=output.include_stop_str_in_output,
                                   skip_special=output.skip_special_tokens,
                                   spaces_between=output.spaces_between_special_tokens)
    stop_tokens = () if output.include_stop_str_in_output else (
        set(gen.model.eos_token_ids) | set(gen.request.stop_token_ids))
    generated: list[int] = []
    params = text_params(gen, 0)
    # A pause for a role briefly without workers (a restart in progress) is not a resume.
    async with Submissions(bus, gen.request_id, deadline, unavailable_spends_a_resubmit=False,
                           retry_note=lambda: f"resuming at position {len(generated)}") as submissions:
        while not submissions.done:
            async with submissions.attempt() as upstream_id:
                # A resumed stream replays prompt + tokens: media must be encoded again for its prefill.
                submit = p.Submit(request_id=upstream_id, model=gen.model.base_name,
                                  stages=list(gen.stages or gen.model.stages),
                                  prompt_token_ids=gen.prompt_token_ids + generated,
                                  params=msgspec.structs.replace(
                                      params, max_tokens=gen.max_tokens - len(generated),
                                      min_tokens=submission_min_tokens(gen.request.options, len(generated)),
                                      # the prompt's logprobs come from the first submission only
                                      prompt_logprobs=-1 if generated else params.prompt_logprobs),
                                  deadline=deadline, reply_to=bus.reply_to, reply_key=bus.reply_key,
                                  position_offset=len(generated), inputs=gen.inputs,
                                  priority=gen.request.priority)
                stream = await bus.submit(submit)
                async for event in stream.events():
                    if not submit.position_offset:   # a resumed stream's prompt holds the answer so far
                        gen.cached_tokens = stream.cached_tokens
                        if gen.prompt_k >= 0 and gen.prompt_logprobs is None:
                            gen.prompt_logprobs = prompt_logprobs.received(gen, stream.prompt_logprobs)
                    logprobs = _checked_logprobs(gen, event.tokens, event.logprobs)
                    text_tokens = event.tokens
                    if event.finish_reason == "stop" and text_tokens and text_tokens[-1] in stop_tokens:
                        # The worker stopped on it (EOS, stop_token_ids): not text, as vLLM answers,
                        # unless include_stop_str_in_output. It stays a token (usage, logprobs).
                        text_tokens = text_tokens[:-1]
                    taken = detok.add_until_stop(text_tokens, final=bool(event.finish_reason))
                    if not detok.stopped:
                        taken = len(event.tokens)
                    generated.extend(event.tokens[:taken])
                    gen.completion_tokens = len(generated)
                    if detok.stopped:
                        submissions.finish()
                        await bus.cancel(upstream_id, "stop string")
                        yield TextChunk(detok.take(final=True), event.tokens[:taken], "stop", logprobs[:taken])
                        return
                    if event.finish_reason:
                        submissions.finish()
                        yield TextChunk(detok.take(final=True), event.tokens, event.finish_reason, logprobs)
                        return
                    yield TextChunk(detok.take(), event.tokens, logprobs=logprobs)
            gen.resumes = submissions.resumes


def _checked_logprobs(gen: Generation, tokens: list[int],
                      logprobs: list[PositionLogprobs | None]) -> list[PositionLogprobs]:
    """The event's logprobs when the request asked (every token must have them), else []."""
    if gen.request.logprobs < 0:
        return []
    if len(logprobs) != len(tokens) or any(lp is None for lp in logprobs):
        raise OmniError("a worker sent tokens without the logprobs this request asked for "
                        "(is it older than the gateway?)", request_id=gen.request_id)
    return logprobs


def token_text(gen: Generation, token_id: int) -> str:
    """A token's text as the logprobs answer shows it: the id decoded on its own, as vLLM does
    (``convert_ids_to_tokens`` would give byte-level BPE symbols such as ``Ġthe``). A token that
    holds part of a multi-byte character decodes to U+FFFD. ``return_tokens_as_token_ids``:
    ``"token_id:N"`` instead (vLLM's form, for clients that read ids, not text)."""
    if gen.request.output.return_tokens_as_token_ids:
        return f"token_id:{token_id}"
    return gen.model.tokenizer.decode([token_id])


def now() -> int:
    return int(time.time())
