"""Tests for omnirelay.broker.protocol: the typed, versioned msgpack messages on the bus.

Every registered message class must survive ``encode`` → ``decode``; every malformed frame
sequence must raise :class:`ProtocolError` (and nothing else); and no module of the project may
reach for pickle-family deserialisers (the "ShadowMQ" class of bugs).
"""

from __future__ import annotations

import ast
import random
import types
import typing

import msgpack
import msgspec
import pytest

from omnirelay.broker import protocol as p
from omnirelay.request_params import RequestParams, StructuredOutput, TextParams
from omnirelay.speech_params import SpeechParams
from repo_paths import REPO_ROOT

REPO = REPO_ROOT
MESSAGE_CLASSES = sorted(p._REGISTRY.values(), key=lambda cls: cls.__name__)


# ------------------------------------------------------------------------------------ helpers


def _sample(hint: typing.Any) -> typing.Any:
    """A representative (non-default) value for a field annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return {"nested": [1, "two", 3.5, None, True, b"\x00raw"]}
    if hint == RequestParams:   # range-checked structs: a valid sample with every part set
        return TextParams(max_tokens=7, temperature=0.5, seed=3, logprobs=2, logit_bias=((4, -1.5),),
                          structured=StructuredOutput("regex", "a+"), lora="a1", speech=SpeechParams("Ethan", stream=True))
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):   # nested: TokenDeltas, a hand-off
        return sample_message(hint)
    if origin in (typing.Union, types.UnionType):
        return _sample([a for a in args if a is not type(None)][-1])
    if origin is list:
        return [_sample(args[0]), _sample(args[0])]
    if origin is dict:
        return {"k1": _sample(args[1]), "k2": _sample(args[1])}
    return {str: "sample-é", int: 7, float: 2.5, bool: True, bytes: b"\x00raw"}[hint]


def sample_message(cls: type[msgspec.Struct]) -> msgspec.Struct:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name]) for f in msgspec.structs.fields(cls)})


def frames_with(cls: type[p.Message], drop: tuple[str, ...] = (), **override) -> list[bytes]:
    """Frames of a valid sample of ``cls`` with body fields dropped or replaced."""
    version, tag, body = p.encode(sample_message(cls))
    fields = msgpack.unpackb(body, raw=False)
    for name in drop:
        del fields[name]
    fields.update(override)
    return [version, tag, msgpack.packb(fields, use_bin_type=True)]


def decode_or_protocol_error(frames: list[bytes]) -> p.Message | None:
    """``decode`` must return a Message or raise ProtocolError; any other outcome fails the test."""
    try:
        msg = p.decode(frames)
    except p.ProtocolError:
        return None
    assert isinstance(msg, p.Message)
    return msg


# ------------------------------------------------------------------------------------ round trip


def test_registry_holds_every_message_the_design_names():
    names = {cls.__name__ for cls in MESSAGE_CLASSES}
    assert names >= {"Register", "Credit", "Heartbeat", "StageDone", "StageFailed", "Unregister",
                     "GatewayHello", "Submit", "Cancel", "StatusQuery", "Task", "CancelTask",
                     "Reregister", "RequestFailed", "StatusReply", "ErrorReply", "TokenDelta", "TokenDeltas"}
    assert all(tag == cls.TAG for tag, cls in p._REGISTRY.items())


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
def test_every_message_class_round_trips(cls):
    msg = sample_message(cls)
    frames = p.encode(msg)
    assert len(frames) == 3 and frames[0] == bytes([p.PROTOCOL_VERSION]) and frames[1] == cls.TAG
    assert all(isinstance(frame, bytes) for frame in frames)
    assert p.decode(frames) == msg


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
def test_optional_fields_may_be_omitted_and_take_their_defaults(cls):
    optional = [f for f in msgspec.structs.fields(cls) if not f.required]
    decoded = p.decode(frames_with(cls, drop=tuple(f.name for f in optional)))
    for f in optional:
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        assert getattr(decoded, f.name) == default


def test_messages_are_frozen():
    msg = p.Credit("w1", 2)
    with pytest.raises(AttributeError):
        msg.credits = 3
    assert msg.credits == 2


def test_int_is_accepted_where_float_is_declared():
    msg = p.decode(frames_with(p.Submit, deadline=5))
    assert msg.deadline == 5


# ------------------------------------------------------------------------------------ framing errors


@pytest.mark.parametrize("frames", [
    [],
    [p.VERSION_FRAME],
    [p.VERSION_FRAME, b"STQ"],
    [p.VERSION_FRAME, b"STQ", msgpack.packb({"query_id": 1}), b""],
], ids=["zero", "one", "two", "four"])
def test_wrong_frame_count_is_rejected(frames):
    with pytest.raises(p.ProtocolError, match="frames"):
        p.decode(frames)


@pytest.mark.parametrize("version", [b"", b"\x00", b"\x01", b"\x03", b"\x02\x00", b"2", b"\xff" * 1000])
def test_wrong_version_is_rejected(version):
    with pytest.raises(p.ProtocolError, match="version"):
        p.decode([version, b"STQ", msgpack.packb({"query_id": 1})])


@pytest.mark.parametrize("tag", [b"", b"stq", b"NOPE", b"STQ\x00", b"T" * 100_000])
def test_unknown_tag_is_rejected(tag):
    with pytest.raises(p.ProtocolError, match="unknown message type") as info:
        p.decode([p.VERSION_FRAME, tag, msgpack.packb({"query_id": 1})])
    assert len(str(info.value)) < 200  # a huge tag is not echoed back in full


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x81", b"\x92\x01", b"\xa3ab", b"\xa2\xff\xfe",
                                  b"\x81\x01\x02", b"\x81\x91\x01\x02", b"\x91" * 5000 + b"\x00"],
                         ids=["empty", "reserved-byte", "truncated-map", "truncated-array",
                              "truncated-str", "invalid-utf8", "int-key", "list-key", "too-deep"])
def test_garbage_body_is_rejected(body):
    with pytest.raises(p.ProtocolError):
        p.decode([p.VERSION_FRAME, b"STQ", body])


@pytest.mark.parametrize("value", [[1, 2], "query", 1, None, b"raw", True])
def test_non_map_body_is_rejected(value):
    with pytest.raises(p.ProtocolError, match="map"):
        p.decode([p.VERSION_FRAME, b"STQ", msgpack.packb(value, use_bin_type=True)])


def test_body_over_the_size_bound_is_rejected(monkeypatch):
    monkeypatch.setattr(p, "MAX_BODY_BYTES", 16)
    with pytest.raises(p.ProtocolError, match="too large"):
        p.decode([p.VERSION_FRAME, b"STQ", msgpack.packb({"query_id": 1, "pad": "x" * 32})])


def test_trailing_bytes_after_the_body_are_rejected():
    version, tag, body = p.encode(p.StatusQuery(1))
    with pytest.raises(p.ProtocolError):
        p.decode([version, tag, body + b"\x00"])


# ------------------------------------------------------------------------------------ field errors


@pytest.mark.parametrize("cls, field", [
    (cls, f.name) for cls in MESSAGE_CLASSES for f in msgspec.structs.fields(cls) if f.required
], ids=lambda x: x.__name__ if isinstance(x, type) else x)
def test_missing_required_field_is_rejected(cls, field):
    with pytest.raises(p.ProtocolError, match=f"missing field '{field}'"):
        p.decode(frames_with(cls, drop=(field,)))


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
def test_unknown_field_is_rejected(cls):
    with pytest.raises(p.ProtocolError, match="unknown fields"):
        p.decode(frames_with(cls, surprise=1))


def test_field_name_given_as_bytes_is_an_unknown_field():
    body = msgpack.packb({b"query_id": 1}, use_bin_type=True)
    with pytest.raises(p.ProtocolError):
        p.decode([p.VERSION_FRAME, b"STQ", body])


@pytest.mark.parametrize("cls, field, bad", [
    (p.Credit, "credits", True),                       # bool where int
    (p.Credit, "credits", 1.0),                        # float where int
    (p.Credit, "credits", "3"),                        # str where int
    (p.StatusQuery, "query_id", None),                 # nil where int
    (p.Register, "worker_id", b"w1"),                  # bytes where str
    (p.Register, "capacity", [4]),                     # list where int
    (p.Submit, "prompt_token_ids", "1 2 3"),           # str where list[int]
    (p.Submit, "prompt_token_ids", [1, "2"]),          # wrong item type
    (p.Submit, "prompt_token_ids", [1, True]),         # bool item where int
    (p.Submit, "prompt_token_ids", [1.5]),             # float item where int
    (p.Submit, "prompt_token_ids", {"0": 1}),          # map where list
    (p.Submit, "stages", ["prefill", 2]),              # int item where str
    (p.Submit, "deadline", "soon"),                    # str where float
    (p.Submit, "deadline", False),                     # bool where float
    (p.Submit, "params", [["temperature", 0.5]]),      # list where a params struct
    (p.Submit, "params", {"temperature": 0.5}),        # untagged: version 1's sampling map
    (p.Submit, "params", {"type": "text", "top_p": 2}),   # out of range
    (p.Task, "params", {"type": "sound", "voice": "v"}),  # no such kind
    (p.StageDone, "finished", 1),                      # int where bool
    (p.StageDone, "outputs", "kv://handle"),           # str where a hand-off
    (p.StageDone, "outputs", {"handoff": "kv", "kv_key": "k", "kv_handle": {}}),   # a field missing
    (p.StageDone, "outputs", {"handoff": "tea", "kv_key": "k"}),                   # no such hand-off
    (p.Task, "inputs", {"kv_key": "k", "kv_handle": {}, "first_token": 1}),        # untagged (version 1)
    (p.Heartbeat, "stats", {"tokens": "many"}),        # str value where int | float
    (p.Heartbeat, "stats", {"ok": True}),              # bool value where int | float
    (p.Heartbeat, "stats", {b"tokens": 1}),            # bytes key where str
    (p.TokenDelta, "token_ids", [[1, 2]]),             # nested list where list[int]
    (p.TokenDeltas, "deltas", {"r1": [1]}),            # map where list
    (p.TokenDeltas, "deltas", [["r1", 0, [1]]]),       # array where a delta (a map) belongs
    (p.RequestFailed, "retry_after", "1s"),            # str where float
    (p.StatusReply, "workers", [["w1"]]),              # list item where dict
    (p.StatusReply, "queued", {"m/prefill": 1.5}),     # float value where int
])
def test_wrong_field_type_is_rejected(cls, field, bad):
    with pytest.raises(p.ProtocolError, match=f"{cls.__name__}.{field}"):
        p.decode(frames_with(cls, **{field: bad}))


# ------------------------------------------------------------------------------------ batched token deltas


def test_token_deltas_round_trip_keeps_each_delta_whole():
    deltas = [p.TokenDelta("req-a", 17, [101]), p.TokenDelta("req-b", 3, [7], "stop"),
              p.TokenDelta("req-c", 0, [5, 6], "length")]
    msg = p.TokenDeltas(deltas, worker_id="dec-1")
    decoded = p.decode(p.encode(msg))
    assert decoded == msg and type(decoded) is p.TokenDeltas
    assert all(type(d) is p.TokenDelta for d in decoded.deltas)
    assert [(d.request_id, d.start, d.token_ids, d.finish_reason) for d in decoded.deltas] == \
        [("req-a", 17, [101], ""), ("req-b", 3, [7], "stop"), ("req-c", 0, [5, 6], "length")]
    # The inner deltas' defaults travel as omitted fields too: no per-delta worker id on the wire.
    body = msgpack.unpackb(p.encode(msg)[2], raw=False)
    assert body["deltas"][0] == {"request_id": "req-a", "start": 17, "token_ids": [101]}


def _token_deltas_frames(*deltas: dict) -> list[bytes]:
    return [p.VERSION_FRAME, p.TokenDeltas.TAG, msgpack.packb({"deltas": list(deltas)}, use_bin_type=True)]


GOOD_DELTA = {"request_id": "r1", "start": 0, "token_ids": [1]}


@pytest.mark.parametrize("bad, expected", [
    ({**GOOD_DELTA, "start": "0"}, r"TokenDeltas.deltas\[1\].start: Expected int, got str"),
    ({**GOOD_DELTA, "start": True}, r"TokenDeltas.deltas\[1\].start: Expected int, got bool"),
    ({**GOOD_DELTA, "token_ids": [1, 2.5]}, r"TokenDeltas.deltas\[1\].token_ids\[1\]: Expected int"),
    ({**GOOD_DELTA, "finish_reason": None}, r"TokenDeltas.deltas\[1\].finish_reason: Expected str"),
    ({"request_id": "r1", "token_ids": [1]}, r"TokenDeltas.deltas\[1\]: missing field 'start'"),
    ({**GOOD_DELTA, "surprise": 1}, r"TokenDeltas.deltas\[1\]: unknown fields \['surprise'\]"),
    ({**GOOD_DELTA, "a`b": 1}, r"TokenDeltas.deltas\[1\]: unknown fields \['a`b'\]"),
    ("r1", r"TokenDeltas.deltas\[1\]: Expected object, got str"),
], ids=["str-start", "bool-start", "float-token", "nil-finish", "missing-start", "unknown-field",
        "backtick-field", "not-a-map"])
def test_malformed_nested_delta_rejects_the_whole_message(bad, expected):
    """A bad delta behind a good one: validation reaches inside the list, strict as for a lone
    TokenDelta, and names where the fault is; nothing of the message is delivered."""
    with pytest.raises(p.ProtocolError, match=expected):
        p.decode(_token_deltas_frames(GOOD_DELTA, bad))


def test_token_deltas_with_no_deltas_field_is_rejected():
    with pytest.raises(p.ProtocolError, match="TokenDeltas: missing field 'deltas'"):
        p.decode([p.VERSION_FRAME, p.TokenDeltas.TAG, msgpack.packb({"worker_id": "w"})])


# ------------------------------------------------------------------------------------ fuzzing


def _random_value(rng: random.Random, depth: int = 0) -> typing.Any:
    kinds = ["nil", "bool", "int", "float", "str", "bin"] + (["list", "map"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "nil":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2**31, -(2**63), 2**64 - 1, rng.randint(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.0, -1.5, float("inf"), float("nan"), rng.random()])
    if kind == "str":
        return "".join(rng.choice("ab\u00e9\u4e2d\x00") for _ in range(rng.randint(0, 4)))
    if kind == "bin":
        return rng.randbytes(rng.randint(0, 4))
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "", "query_id", "worker_id"]): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def test_decode_of_arbitrary_frames_returns_a_message_or_raises_protocol_error():
    # hypothesis is not installed here; a seeded loop keeps the test deterministic.
    rng = random.Random(20240601)
    tags = list(p._REGISTRY)
    for _ in range(2000):
        count = rng.choice([0, 1, 2, 3, 3, 3, 4])
        frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(count)]
        if count >= 2 and rng.random() < 0.6:
            frames[0] = p.VERSION_FRAME
            frames[1] = rng.choice(tags)
        if count == 3 and rng.random() < 0.3:
            frames[2] = msgpack.packb(_random_value(rng), use_bin_type=True)
        decode_or_protocol_error(frames)


def test_decode_of_mutated_valid_messages_never_escapes_protocol_error():
    """Structure-aware fuzzing: valid messages with fields dropped, replaced, added, or bytes flipped.
    Whatever decodes must encode again to the same frames (the validator lets nothing through that
    the sender side could not produce)."""
    rng = random.Random(7)
    for _ in range(2000):
        cls = rng.choice(MESSAGE_CLASSES)
        version, tag, body = p.encode(sample_message(cls))
        fields = msgpack.unpackb(body, raw=False)
        names = list(fields)
        action = rng.choice(["drop", "replace", "add", "flip"])
        if action == "drop":
            del fields[rng.choice(names)]
        elif action == "replace":
            fields[rng.choice(names)] = _random_value(rng)
        elif action == "add":
            fields[rng.choice(["x", "", "TAG"])] = _random_value(rng)
        if action == "flip":
            mutated = bytearray(body)
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
            body = bytes(mutated)
        else:
            body = msgpack.packb(fields, use_bin_type=True)
        msg = decode_or_protocol_error([version, tag, body])
        if msg is not None:
            assert p.decode(p.encode(msg)).TAG == tag
            assert p.encode(p.decode(p.encode(msg))) == p.encode(msg)


# ------------------------------------------------------------------------------------ no pickle

SCANNED_PACKAGES = ("broker", "workers", "connectors", "gateway", "deploy", "omnirelay")
FORBIDDEN_MODULES = {"pickle", "_pickle", "cloudpickle", "dill", "marshal"}
FORBIDDEN_LOADERS = {("pickle", "loads"), ("pickle", "load"), ("marshal", "loads"), ("marshal", "load"),
                     ("torch", "load"), ("cloudpickle", "loads"), ("dill", "loads")}


def forbidden_deserialisers(source: str) -> list[str]:
    """Uses of pickle-family deserialisers in ``source`` (code only; comments and docstrings that
    merely mention pickle do not count)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (node.value.id, node.attr) in FORBIDDEN_LOADERS:
            found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_MODULES:
            found.append(node.id)
        elif isinstance(node, ast.Call) and any(
                isinstance(a, ast.Constant) and a.value in FORBIDDEN_MODULES for a in node.args):
            found.append(f"dynamic import of {[a.value for a in node.args if isinstance(a, ast.Constant)]}")
    return found


def test_scanner_detects_each_forbidden_pattern():
    bad = ("import pickle\nimport cloudpickle as cp\nfrom dill import loads\nimport marshal\n"
           "x = pickle.loads(b'')\ny = torch.load('f.pt')\nz = marshal.loads(b'')\n"
           "m = importlib.import_module('pickle')\n")
    found = " | ".join(forbidden_deserialisers(bad))
    for needle in ("import pickle", "import cloudpickle", "from dill", "import marshal", "pickle.loads",
                   "torch.load", "marshal.loads", "dynamic import"):
        assert needle in found
    assert forbidden_deserialisers('"""No pickle, cloudpickle, dill or torch.load here."""\n# import pickle\n') == []


def test_no_module_uses_pickle_family_deserialisers():
    files = [f for pkg in SCANNED_PACKAGES for f in sorted((REPO / pkg).rglob("*.py"))]
    assert len(files) > 10, "the scan found too few files; did the layout change?"
    offenders = {}
    for path in files:
        source = path.read_text(encoding="utf-8")
        hits = forbidden_deserialisers(source)
        # Belt and braces: the literal patterns, in case the AST walk misses an unusual spelling.
        code_lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith("#")]
        hits += [pat for pat in ("import pickle", "import cloudpickle", "import dill", "pickle.loads(",
                                 "torch.load(", "marshal.loads(") if any(pat in ln for ln in code_lines)]
        if hits:
            offenders[str(path.relative_to(REPO))] = sorted(set(hits))
    assert offenders == {}
