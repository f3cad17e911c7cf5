"""The bus wire protocol: every message that crosses a ZeroMQ socket, typed, versioned, validated.

Framing. A message is three ZeroMQ frames ``[version, msg_type, body]``:

* ``version``  one byte, :data:`PROTOCOL_VERSION`;
* ``msg_type`` the ASCII tag of the message class (``Register.TAG`` …);
* ``body``     a msgpack map of the class's fields; a field at its default value is left out.

A ROUTER socket prepends the peer identity frame; :func:`decode` is given the three frames after it.
Decoding checks the version, looks the tag up in a closed registry and validates every field's type
(unknown fields are rejected too, so a typo never travels silently). Messages are msgspec structs:
msgspec's compiled msgpack decoder builds and type-checks them in one pass (strict: no coercion, a
``bool`` is not an ``int``; an ``int`` is accepted where a ``float`` is declared), which keeps the
broker's per-message cost in C. Anything malformed raises :class:`ProtocolError`; the receiver
counts it, answers with :class:`ErrorReply` where the sender has an identity, and carries on
serving. Nothing on this path unpickles: msgpack only, str map keys for every typed field, no
extension types, bounded sizes.

Compatibility: a field added later has a default, so old senders (which omit it) keep working, and
since fields at their default are not sent, a new sender talks to an old receiver as long as it
leaves the new field unused (the receiver rejects fields it does not know). The same holds for a new
message type (``TokenDeltas``): receivers are upgraded before senders — broker, then gateways,
then workers (README, "Upgrading").

Hand-offs. What a stage leaves for the next (``StageDone.outputs`` → ``Task.inputs``; the first
stage's in ``Submit.inputs``; ``CancelTask.inputs`` to release) is a typed hand-off of
:mod:`omnirelay.handoffs` (``KVHandoff``, ``EmbedsHandoff``, ``SpeechHandoff``, ``MediaInputs``),
a msgpack map tagged by its ``"handoff"`` key, validated here like every field; the broker passes it
on without looking inside.

Request parameters. What a request asks its stages for (``Submit.params``, copied into every
``Task.params``) is one struct of :mod:`omnirelay.request_params`, tagged by its kind (``text``,
``speech``, ``image``, ``video``) and validated here like every field, each struct's own range
checks included; the broker reads only its LoRA adapter, for routing.

Who sends what:

====================  ======================  ===================================================
message               direction               meaning
====================  ======================  ===================================================
Register              worker → broker         I serve (model, role) with this capacity
Credit                worker → broker         I can take ``credits`` more tasks (pull by credit)
Heartbeat             worker → broker         alive; my load and counters
StageDone             worker → broker         a stage finished; ``outputs``: its hand-off
StageStreaming        worker → broker         a stage still runs, its successor may start now on
                                              ``outputs`` (a streamed hand-off)
StageFailed           worker → broker         a stage failed with a structured error
Unregister            worker → broker         I am leaving (drain finished)
GatewayHello          gateway → broker        I own requests; also my liveness ping
HelloAck              broker → gateway        the broker's instance id (changes on restart) and
                                              the gateway's session (changes when given up)
Submit                gateway → broker        a new request: stages, prompt, params, deadline
Cancel                gateway → broker        drop a request everywhere (client went away, stop)
StatusQuery           gateway → broker        who is alive?
Task                  broker → worker         run one stage of one request
CancelTask            broker → worker         forget a request, free its KV and keys
Reregister            broker → worker/gw      I do not know you (broker restarted): register again
RequestFailed         broker → gateway        structured error for one request
StatusReply           broker → gateway        live workers per model and role, with their stats
ErrorReply            any → sender            your message was malformed
TokenDelta            worker → gateway        generated tokens at absolute positions (+ finish)
TokenDeltas           worker → gateway        one engine step's TokenDeltas for one gateway
MediaResult           worker → gateway        one finished media item (a PNG image …), base64
PooledResult          worker → gateway        a pooling request's vector (prefill only: no decode)
====================  ======================  ===================================================

Token deltas carry the absolute position of their first token, so a receiver can drop duplicates
and detect gaps: a stage that is replayed elsewhere may resend positions the client already has.
A :class:`TokenDeltas` is only a batch of such deltas (one per request of a prefill or decode step,
all bound for the same gateway): the receiver handles each as if it had come alone.

Log-probabilities. A request whose ``TextParams.logprobs`` is k >= 0 gets, from the worker that
samples each token, ``TokenDelta.logprobs`` (one float per token id) and, for k > 0,
``TokenDelta.top_token_ids`` and ``TokenDelta.top_logprobs`` (per token id, the k most likely ids
and their logprobs, most likely first): raw logprobs, ``log_softmax`` of the logits before
temperature, top-k and top-p. Both stay empty, and so off the wire, for a request that did not ask.

Version 2 (2026-12-06) replaced version 1's untyped ``sampling`` map by ``params`` and dropped the
decoding of untagged hand-offs; a version-1 peer is refused at its first message.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import msgspec

from omnirelay.handoffs import Handoff, MediaInputs
from omnirelay.request_params import RequestParams

PROTOCOL_VERSION = 2
VERSION_FRAME = bytes([PROTOCOL_VERSION])
MAX_BODY_BYTES = 8 * 1024 * 1024   # a 1M-token prompt fits; bulk data goes through connectors


class ProtocolError(ValueError):
    """A frame sequence that is not a valid message of this protocol version."""


_REGISTRY: dict[bytes, type["Message"]] = {}
_DECODERS: dict[bytes, tuple[type["Message"], msgspec.msgpack.Decoder]] = {}


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """Base of every bus message: a frozen msgspec struct (typed fields, validated by msgspec's C
    decoder, so the broker's hot path runs no per-field Python). Subclasses set ``TAG``, declare
    typed fields and are decorated with :func:`_register`, which enters them in the registry and
    builds their decoder. ``_checks`` lists ``(name, annotation, required)`` per field.

    ``gc=False``: a message holds plain data only (strings, numbers, lists and maps of them) and is
    frozen, so it can never be part of a reference cycle; leaving it out of the cycle collector's
    books saves the broker a collector pass over every request it holds."""

    TAG: ClassVar[bytes] = b""
    _checks: ClassVar[tuple] = ()


def _reject_ext(code: int, data: memoryview) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not part of the protocol")


def _register(cls):
    """Class decorator: enter ``cls`` in the registry and build its typed decoder once."""
    if not cls.TAG or cls.TAG in _REGISTRY:
        raise TypeError(f"missing or duplicate message tag {cls.TAG!r}")
    _REGISTRY[cls.TAG] = cls
    # strict: no str → int coercion and no bool where an int is declared; int is accepted for float.
    _DECODERS[cls.TAG] = (cls, msgspec.msgpack.Decoder(cls, strict=True, ext_hook=_reject_ext))
    cls._checks = tuple((f.name, f.type, f.required) for f in msgspec.structs.fields(cls))
    return cls


_ENCODER = msgspec.msgpack.Encoder()
# msgspec's messages, turned into this protocol's wording ("Submit.deadline: expected float, …").
# A nested struct (TokenDeltas.deltas, Submit.params) adds where in the body: "… - at `$.deltas[3]`".
_AT_FIELD = re.compile(r"^(?P<what>.*?) - at `(?:key` in `)?\$\.(?P<field>\w+(?:\[\d+\])*(?:\.\w+(?:\[\d+\])*)*)")
_NESTED = r"(?: - at `\$(?P<at>\.\w+\[\d+\])`)?$"
_MISSING = re.compile(r"^Object missing required field `(?P<field>\w+)`" + _NESTED)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>.*?)`" + _NESTED, re.S)


def _explain(cls: type[Message], error: str) -> str:
    if m := _MISSING.match(error):
        return f"{cls.__name__}{m['at'] or ''}: missing field {m['field']!r}"
    if m := _UNKNOWN.match(error):
        return f"{cls.__name__}{m['at'] or ''}: unknown fields [{m['field'][:64]!r}]"
    if m := _AT_FIELD.match(error):
        return f"{cls.__name__}.{m['field']}: {m['what'].replace('`', '')}"
    if error.startswith("Expected `object`"):
        return "body must be a map"
    return f"{cls.__name__}: {error[:200]}"


class _NamesARequest(msgspec.Struct):
    request_id: str = ""


def submitted_request_id(frames: list[bytes]) -> str:
    """The ``request_id`` of ``frames`` when they are a :class:`Submit` whose body decodes at least
    that far (a refused one: some other field is malformed); "" for anything else."""
    if len(frames) != 3 or bytes(frames[1]) != Submit.TAG or len(frames[2]) > MAX_BODY_BYTES:
        return ""
    try:
        return msgspec.msgpack.decode(frames[2], type=_NamesARequest, ext_hook=_reject_ext).request_id[:256]
    except Exception:   # noqa: BLE001 - garbage: no request to name
        return ""


def encode(msg: Message) -> list[bytes]:
    """Frames ``[version, tag, body]`` for ``msg`` (fields at their default left out)."""
    return [VERSION_FRAME, msg.TAG, _ENCODER.encode(msg)]


# The body frame alone, for a sender that writes the frames itself: [VERSION_FRAME, msg.TAG, encode_body(msg)].
encode_body = _ENCODER.encode


def decode(frames: list[bytes]) -> Message:
    """Validate and decode ``[version, tag, body]``; raise :class:`ProtocolError` on anything else."""
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames, got {len(frames)}")
    version, tag, body = frames
    if version != VERSION_FRAME:
        raise ProtocolError(f"unsupported protocol version {bytes(version)[:4]!r}")
    if type(tag) is not bytes:   # a memoryview or bytearray from an unusual caller
        tag = bytes(tag)
    entry = _DECODERS.get(tag)
    if entry is None:
        raise ProtocolError(f"unknown message type {bytes(tag)[:32]!r}")
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError("message body too large")
    cls, decoder = entry
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_explain(cls, str(exc))) from None
    except ProtocolError:
        raise
    except Exception as exc:  # DecodeError on garbage; RecursionError on absurd nesting
        raise ProtocolError(f"body is not valid msgpack: {type(exc).__name__}") from None


# --------------------------------------------------------------------------------------------
# worker → broker


@_register
class Register(Message):
    """``block_size`` > 0: the worker keeps a prefix cache of KV blocks of that many tokens and
    reports it in heartbeats (prefix-aware routing, :mod:`omnirelay.broker.prefix_index`)."""

    TAG = b"REG"
    worker_id: str
    role: str
    model: str
    capacity: int
    pid: int = 0
    host: str = ""
    held: list[str] = msgspec.field(default_factory=list)   # requests still held (re-registration)
    block_size: int = 0
    reports: int = 0    # stage reports sent so far (Heartbeat.reports): the broker counts on from here
    received: int = 0   # Tasks and CancelTasks received so far (Heartbeat.received), likewise
    loras: list[str] | None = None   # LoRA adapters held (Heartbeat.loras); None: LoRA off


@_register
class Credit(Message):
    TAG = b"CRD"
    worker_id: str
    credits: int


@_register
class Heartbeat(Message):
    """Liveness and load. A worker with a prefix cache adds the route keys (first 8 bytes of the
    block names, :func:`~omnirelay.broker.prefix_index.route_keys`) of blocks it cached
    (``prefix_added``) and evicted (``prefix_evicted``) since its last heartbeat — or, with
    ``prefix_full``, its whole set in ``prefix_added`` (after registering, when the deltas overflow,
    and now and then), which replaces the broker's copy. The broker keeps a bounded number per worker.

    ``reports`` and ``received``: how many stage reports (StageDone, StageFailed, StageStreaming)
    the worker had sent, and Tasks and CancelTasks it had handled, when it read ``stats``, counted
    over its life (its ``Register`` says where both stood). The broker counts the reports it
    received and the messages it sent; when both agree and the worker holds and runs nothing,
    ``stats`` include every request it finished or dropped — the worker is *settled*
    (``StatusReply.unsettled``). Messages both ways keep their order on the one connection, and a
    worker re-registers only after handling all the broker sent before its ``Reregister``."""

    TAG = b"HB"
    worker_id: str
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = -1
    stats: dict[str, int | float] = msgspec.field(default_factory=dict)
    prefix_added: list[int] = msgspec.field(default_factory=list)
    prefix_evicted: list[int] = msgspec.field(default_factory=list)
    prefix_full: bool = False
    reports: int = 0
    received: int = 0
    # A worker with --enable-lora: every adapter it holds now (the whole list; None: no report, as in
    # a keepalive), for adapter affinity (omnirelay.broker.lora_affinity).
    loras: list[str] | None = None


@_register
class StageDone(Message):
    """``outputs``: the hand-off the next stage reads (connector handles, :mod:`omnirelay.handoffs`;
    None: nothing); ``finished`` ends the request."""

    TAG = b"DONE"
    worker_id: str
    request_id: str
    stage: str
    outputs: Handoff | None = None
    finished: bool = False
    attempt: int = 0            # echoes Task.attempt, so a late report of an earlier attempt is ignored


@_register
class StageStreaming(Message):
    """The stage ``stage`` of ``request_id`` still runs, and its successor may start now on
    ``outputs``, a hand-off whose data the sender keeps writing (``omnirelay.handoffs.ChunkStream``).
    The broker dispatches the next stage at once and keeps the sender as the request's producer
    until its own StageDone (then ``outputs`` None, ``finished`` False) or StageFailed; a producer or
    consumer lost meanwhile fails the request as resumable (the consumer read chunks nobody else
    has, so neither side can be replayed alone)."""

    TAG = b"STRM"
    worker_id: str
    request_id: str
    stage: str
    outputs: Handoff
    attempt: int = 0


@_register
class StageFailed(Message):
    TAG = b"FAIL"
    worker_id: str
    request_id: str
    stage: str
    error_type: str
    message: str
    attempt: int = 0


@_register
class Unregister(Message):
    TAG = b"UNREG"
    worker_id: str


# --------------------------------------------------------------------------------------------
# gateway → broker


@_register
class GatewayHello(Message):
    TAG = b"GWHI"
    gateway_id: str


@_register
class Submit(Message):
    """A new request. ``deadline`` is wall-clock seconds since the epoch; ``reply_to`` is the
    endpoint where workers push :class:`TokenDelta` for it. ``position_offset`` is the absolute
    position of the first token to generate (non-zero when a stream is resumed elsewhere).
    ``prefix_hashes`` are the route keys of the prompt's leading blocks of ``prefix_block_size``
    tokens (:func:`~omnirelay.broker.prefix_index.prompt_route_keys`): the broker sends the request
    to the worker that caches the longest prefix of them. Empty: least-loaded routing."""

    TAG = b"SUB"
    request_id: str
    model: str
    stages: list[str]
    prompt_token_ids: list[int]
    params: RequestParams
    deadline: float
    reply_to: str
    position_offset: int = 0
    reply_key: str = ""        # CURVE public key (z85) of the reply_to socket; empty on loopback
    # The first stage's inputs, inline (an omni request's media bytes for encode); bounded by
    # MAX_BODY_BYTES with the rest of the message. Later stages get the previous stage's outputs.
    inputs: MediaInputs | None = None
    prefix_hashes: list[int] = msgspec.field(default_factory=list)
    prefix_block_size: int = 0
    traceparent: str = ""      # W3C trace context of the gateway's span (omnirelay/tracing.py); "" untraced
    # Lower first under --scheduling-policy priority (omnirelay/scheduling.py); 0 under fcfs.
    priority: int = 0


@_register
class Cancel(Message):
    TAG = b"CAN"
    request_id: str
    reason: str = "cancelled"


@_register
class StatusQuery(Message):
    TAG = b"STQ"
    query_id: int


# --------------------------------------------------------------------------------------------
# broker → worker / gateway


@_register
class Task(Message):
    TAG = b"TASK"
    request_id: str
    stage: str
    model: str
    prompt_token_ids: list[int]
    params: RequestParams
    inputs: Handoff | None      # Submit.inputs for the first stage, else the previous stage's outputs
    reply_to: str
    deadline: float
    attempt: int = 0
    position_offset: int = 0
    reply_key: str = ""
    traceparent: str = ""      # the broker's span of this stage (omnirelay/tracing.py); "" untraced
    priority: int = 0          # the Submit's under the priority policy, else 0: the engine's queue order


@_register
class CancelTask(Message):
    """Drop a request. ``inputs`` (the hand-off a finished stage produced, sent to a worker of the
    consuming role, or back to its producer when its report came too late) are sent when the
    request dies between stages: the receiver releases it (``Handoff.release``), so a cancelled
    request's data does not wait for its TTL."""

    TAG = b"CTSK"
    request_id: str
    inputs: Handoff | None = None
    # Only stop writing the streamed hand-off of this request (its consumer finished first, e.g. a
    # talker that stopped before its thinker) and delete what is unread; the request goes on.
    streams_only: bool = False


@_register
class Reregister(Message):
    TAG = b"RREG"
    reason: str = ""


@_register
class HelloAck(Message):
    """Answer to GatewayHello. ``broker_id`` changes when the broker restarts, and ``session`` when
    the broker gave this gateway up (silent past its liveness: stopped, or cut off) and took it back:
    either tells the gateway that requests it submitted before are gone from the broker and must be
    resumed. 0: a broker older than sessions."""

    TAG = b"HACK"
    broker_id: str
    session: int = 0


@_register
class RequestFailed(Message):
    """Structured failure of one request. ``retry_after`` > 0 marks an overload the client may
    retry; ``resumable`` tells the gateway it may resubmit the rest of a stream elsewhere."""

    TAG = b"RFAIL"
    request_id: str
    stage: str
    error_type: str
    message: str
    retry_after: float = 0.0
    resumable: bool = False


@_register
class StatusReply(Message):
    """``requests``: requests in flight at the broker; ``unsettled``: live workers that are not
    settled (each worker's ``settled`` in ``workers``: it runs and holds nothing, and its last
    heartbeat counted every stage report the broker received from it, so its ``stats`` are final).
    Both 0: the cluster is idle and its figures fresh — what tests wait on instead of sleeping
    across heartbeats."""

    TAG = b"STR"
    query_id: int
    workers: list[dict[str, Any]]
    queued: dict[str, int] = msgspec.field(default_factory=dict)
    counters: dict[str, int] = msgspec.field(default_factory=dict)
    requests: int = 0
    unsettled: int = 0


@_register
class ErrorReply(Message):
    """The sender's message was malformed. ``request_id``: the request a refused :class:`Submit`
    named (read from its body when that much of it decodes; :func:`submitted_request_id`), so its
    gateway fails that request at once instead of at its deadline; "" otherwise."""

    TAG = b"ERR"
    error_type: str
    message: str
    request_id: str = ""


# --------------------------------------------------------------------------------------------
# worker → gateway


class PromptLogprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The logprobs of a prompt's tokens 1 … n-1 (token 0 has none), in order: ``logprobs[i]`` and
    ``ranks[i]`` (1 = the likeliest) of prompt token ``i + 1``; ``top_token_ids[i]`` and
    ``top_logprobs[i]`` the position's k likeliest (both empty lists for k = 0). Raw, as the sampled
    tokens' (workers/llm/prompt_logprobs.py)."""

    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    top_logprobs: list[list[float]] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.ranks) != len(self.logprobs) or len(self.top_token_ids) != len(self.top_logprobs) \
                or (self.top_token_ids and len(self.top_token_ids) != len(self.logprobs)) \
                or any(len(ids) != len(values) for ids, values in zip(self.top_token_ids, self.top_logprobs)):
            raise ValueError("prompt logprobs, ranks and top lists must line up")


@_register
class TokenDelta(Message):
    """Tokens ``token_ids`` at absolute positions ``start`` … of the generated sequence.
    ``finish_reason`` is ``"stop"``/``"length"`` on the last delta, else empty.

    ``logprobs``, ``top_token_ids``, ``top_logprobs``: empty unless the request's ``TextParams.logprobs`` asked
    for logprobs (see the module docstring); else aligned with ``token_ids``: ``logprobs[i]`` is the
    raw logprob of ``token_ids[i]``; ``top_token_ids[i]`` and ``top_logprobs[i]`` are the most likely
    ids of that position and their logprobs, most likely first (both lists empty for
    ``"logprobs": 0``). Two flat lists rather than pairs keep every element strictly typed. Checked on
    decode: lengths that do not line up make the message malformed.

    ``cached_tokens``: on the delta of a submission's first token (from prefill), how many of its
    prompt tokens prefill took from its prefix cache instead of computing (the answer's
    ``usage.prompt_tokens_details.cached_tokens``); 0, and so off the wire, everywhere else.
    ``prompt_logprobs``: on the same delta, when the request asked for them, its prompt's."""

    TAG = b"TOK"
    request_id: str
    start: int
    token_ids: list[int]
    finish_reason: str = ""
    worker_id: str = ""
    logprobs: list[float] = msgspec.field(default_factory=list)
    top_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    top_logprobs: list[list[float]] = msgspec.field(default_factory=list)
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    def __post_init__(self) -> None:
        if self.cached_tokens < 0:
            raise ValueError("cached_tokens must be >= 0")
        if not self.logprobs and not self.top_token_ids and not self.top_logprobs:
            return   # the common case: nobody asked
        if len(self.logprobs) != len(self.token_ids) or len(self.top_token_ids) != len(self.top_logprobs) \
                or (self.top_logprobs and len(self.top_logprobs) != len(self.token_ids)) \
                or any(len(ids) != len(values) for ids, values in zip(self.top_token_ids, self.top_logprobs)):
            raise ValueError("logprobs, top_token_ids and top_logprobs must be empty or line up with token_ids")


@_register
class MediaResult(Message):
    """One finished media item of a request (an image today; audio and video later), pushed by a
    generate worker straight to the gateway's ``reply_to``. ``data`` is the encoded file (``mime``,
    e.g. ``image/png``) in base64: the HTTP answer carries base64 (``b64_json``), so the worker
    encodes once and the gateway copies the string through. ``index`` is the item's place among the
    request's outputs (image ``k`` of ``n``): a receiver keeps the first copy of each index, since a
    stage retried elsewhere resends them. ``finish`` marks the last item the stage sends for the
    request. One message stays under :data:`MAX_BODY_BYTES`; larger media belongs in a connector."""

    TAG = b"MEDIA"
    request_id: str
    index: int
    mime: str
    data: str
    finish: bool = False
    worker_id: str = ""


@_register
class PooledResult(Message):
    """A pooling request's result (``PoolingParams``: ``/v1/embeddings``), pushed by the prefill
    worker straight to the gateway's ``reply_to`` in place of a first token and a KV hand-off: the
    request ends at prefill. ``data``: the vector as little-endian float32 (what the answer's
    ``encoding_format: base64`` holds). At most a model's hidden size (a few thousand floats): far
    under :data:`MAX_BODY_BYTES`."""

    TAG = b"POOL"
    request_id: str
    data: bytes
    worker_id: str = ""

    def __post_init__(self) -> None:
        if not self.data or len(self.data) % 4:
            raise ValueError("data must be one or more float32 values")


@_register
class TokenDeltas(Message):
    """The token deltas of one engine step (prefill: first tokens; decode: next tokens) that go to
    one gateway, in one message instead of one each: a worker decoding for many streams would
    otherwise send (and the gateway receive and decode) a message per stream per step. Each delta is a complete :class:`TokenDelta` of its own
    request with its own absolute ``start``, so a receiver dispatches them one by one exactly as it
    would single ones (de-duplication and gap filling unchanged); their ``worker_id`` is left empty,
    this message's says who sent them all. Order within the list carries no meaning across
    requests. Size: a step yields at most one delta per running sequence (``max_num_seqs``, a few
    hundred at most) of about a hundred bytes each, tens of kilobytes, far under
    :data:`MAX_BODY_BYTES`. :class:`TokenDelta` stays for a step with a single delta for a gateway
    (wrapping it would save no send)."""

    TAG = b"TOKS"
    deltas: list[TokenDelta]
    worker_id: str = ""
