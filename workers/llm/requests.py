"""The LLM engines' request record: one :class:`Request` per request, in prefill and in decode,
whose :class:`Status` says where it is and so what a cancel must undo; the engine's
:class:`Registry` finds it by request id in one lookup.

Statuses a request passes (``engine`` names which engine uses one)::

    WAITING ──(a remote input to get)──▶ WAITING_FOR_REMOTE ──admit──▶ RUNNING
    RUNNING ──blocks ran out (decode)──▶ PREEMPTED ──re-admit──▶ RUNNING
    RUNNING ──done, its hand-off on a transfer thread──▶ SENDING_HANDOFF ──▶ FINISHED / FAILED
    RUNNING ──done, nothing to send──▶ FINISHED            any ──▶ FAILED (reported as RequestFailure)
    SENDING_HANDOFF ──cancel──▶ CANCELLED (the send runs out; what it put is deleted when it returns)

The registry holds the requests that are not over: an engine takes a request out when it ends
(FINISHED, FAILED, cancelled). What the engine's ordered containers hold (its waiting queue, its
running batch, its hand-off jobs) is the scheduling order; the status is the one place that says
what a request is doing.

Per-request state that extensions need lives here, on the record: the LoRA adapter a request runs
under (:attr:`Request.lora`, which picks its slot in every forward), its waiting-queue priority
(:attr:`Request.priority`), its streamed spoken reply (:attr:`Request.stream`, decode's
``reply_stream.py`` writer). A new per-request attribute belongs on the record too, never in an
engine's side dict keyed by request id.

What a step reports is one :class:`EngineStep` for both engines: its :class:`TokenOut` list (a
token for the gateway and, when ``done``, the stage's end for the broker with the hand-off), its
failures and decode's streamed spoken replies announced.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterator

from omnirelay.handoffs import Handoff, SpeechHandoff
from omnirelay.workers.llm.logits_processors import TokenHistory
from omnirelay.workers.llm.prompt_logprobs import PromptLogprobs
from omnirelay.workers.llm.sampling import TokenLogprobs
from omnirelay.workers.runtime.engine import RequestFailure


class Status(enum.Enum):
    WAITING = "waiting"                        # queued, holding nothing of the engine's
    WAITING_FOR_REMOTE = "waiting_for_remote"  # queued, its remote input's get on a transfer thread
    #   (``Request.fetch``): decode, the prefilled KV; prefill, a media prompt's encoder outputs
    RUNNING = "running"                        # in the batch, holding blocks
    PREEMPTED = "preempted"                    # decode: back in the queue, blocks released; its KV
    #   is recomputed on re-admission (a media one's comes back from host memory, ``swapped``)
    SENDING_HANDOFF = "sending_handoff"        # computed, blocks given back (a layerwise export's
    #   held by its job); its hand-off on a transfer thread, its output (``pending``) waits for it
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"                    # cancelled while SENDING_HANDOFF


@dataclasses.dataclass
class TokenOut:
    """What a step reports of one request: ``token`` at ``position`` (to the gateway at
    ``reply_to``, unless ``token_sent``: prefill reported its first token ahead of its hand-off)
    and, when ``done``, the end of this stage (the role's StageDone, with ``outputs`` for the next
    stage; ``speech_next``: a speech stage follows although the text finished)."""

    request_id: str
    reply_to: str
    position: int
    token: int
    finish_reason: str = ""
    outputs: Handoff | None = None
    logprobs: TokenLogprobs | None = None   # the request asked for logprobs (TextParams.logprobs)
    cached_tokens: int = 0   # prefill's first token: prompt tokens taken from its prefix cache
    prompt_logprobs: PromptLogprobs | None = None   # prefill's first token, when the request asked
    done: bool = False
    token_sent: bool = False
    speech_next: bool = False
    pooled: bytes | None = None   # prefill, a pooling request: its vector (little-endian float32), in place of a token



@dataclasses.dataclass
class EngineStep:
    """One step of either engine."""

    tokens: list[TokenOut] = dataclasses.field(default_factory=list)
    failed: list[RequestFailure] = dataclasses.field(default_factory=list)
    # Decode: spoken replies whose first chunk is out: the generate stage may start on this hand-off now.
    streams: list[tuple[str, SpeechHandoff]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)   # compared by identity: the containers take out this very record
class Request:
    """One request in an LLM engine. ``task`` is the engine's (PrefillTask, DecodeTask); the
    fields below it are the engine's state of the request, grouped by who uses them."""

    task: Any
    status: Status = Status.WAITING
    # The KV in the pool.
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0       # tokens whose KV is in ``blocks``
    generated: list[int] = dataclasses.field(default_factory=list)   # decode: output tokens, first one prefill's
    fetch: Any = None           # Transfer of the remote input (WAITING_FOR_REMOTE); owns its key once started
    hidden: list = dataclasses.field(default_factory=list)   # speech: captured hidden states
    pending: TokenOut | None = None   # SENDING_HANDOFF: the output reported once the hand-off is out
    send: Any = None            # SENDING_HANDOFF, decode: the spoken reply's put (Transfer) on its way
    # Prefill.
    hashes: list[bytes] = dataclasses.field(default_factory=list)   # prefix-cache names of its full blocks
    named: int = 0              # leading blocks already registered under their hash
    cached_tokens: int = 0      # prompt tokens found in the prefix cache at admission (not computed)
    media: Any = None           # PlacedMedia: its embeddings, placed at admission
    prompt_lp: PromptLogprobs | None = None   # the prompt's logprobs so far, when the request asked
    pool: Any = None            # PoolAccumulator: a pooling request's vector so far (workers/llm/pooling.py)
    grammar_ended: bool = False   # its grammar completed with the token just sampled
    kv_key: str = ""            # SENDING_HANDOFF: where its KV goes ("": no KV goes on)
    kv_layers: int = 0          # ... and its layout (KVHandoff.layers: 0 whole, else one piece per layer)
    rope_delta: int = 0         # ... its media prompt's M-RoPE delta (KVHandoff.rope_delta)
    has_media: bool = False     # ... it had media inputs (KVHandoff.has_media)
    # Decode.
    swapped: Any = None         # PREEMPTED media request: its KV tensor, kept in host memory
    stream: Any = None          # ReplyStreamWriter: its spoken reply, streamed to generate (reply_stream.py)

    def __post_init__(self) -> None:
        # What the logits processors see: prompt, the resumed output at its end, ``generated`` (shared).
        self.history = TokenHistory(self.task.prompt_token_ids, self.task.position_offset, self.generated)

    @property
    def request_id(self) -> str:
        return self.task.request_id

    @property
    def deadline(self) -> float:
        return self.task.deadline

    @property
    def priority(self) -> int:
        """The waiting queue's order (``Task.priority``, request_queue.py)."""
        return self.task.priority

    @property
    def lora(self) -> str:
        """The LoRA adapter it runs under ("": the base model); picks its slot in every forward."""
        return self.task.params.lora

    @property
    def total_len(self) -> int:
        return len(self.task.prompt_token_ids) + len(self.generated)


class Registry:
    """The engine's requests that are not over, by request id (one per id: the role adapter
    cancels a request it holds before adding it again)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._by_id.values()))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already held by this engine")
        self._by_id[request.request_id] = request

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def end(self, request: Request, status: Status) -> None:
        """``request`` is over (FINISHED, FAILED, CANCELLED): out of the registry."""
        request.status = status
        if self._by_id.get(request.request_id) is request:
            del self._by_id[request.request_id]

    def count(self, *statuses: Status) -> int:
        return sum(r.status in statuses for r in self._by_id.values())
