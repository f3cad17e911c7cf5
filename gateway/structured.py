"""Structured outputs and tools in a request body: parsed, checked, turned into one grammar spec.

Where a constraint can come from (at most one per request, else 400):

* OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``;
* vLLM ``structured_outputs``: exactly one of ``json`` (a schema, object or JSON text),
  ``json_object: true``, ``regex``, ``choice`` (a list of strings), ``grammar`` (xgrammar EBNF,
  root rule ``root``); the older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` mean the same; ``guided_decoding_backend`` may only name ``xgrammar``;
* ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name"}}`` (chat only): the
  answer is constrained to a call, see :class:`ToolsRequest`. A forced call wins over
  ``response_format`` (and a required one over ``structured_outputs``), as vLLM lets it: the
  answer is the call; a named one beside ``structured_outputs`` is a 400, as in vLLM.

Every spec is checked before anything is submitted: a JSON schema against its metaschema
(``jsonschema``) and then converted by xgrammar, a regex and an EBNF grammar parsed by xgrammar.
What xgrammar refuses is a 400 naming the param; the outcome is cached per spec text
(:func:`check_spec`), so a schema sent with every request is checked once. The full compilation
against a tokenizer happens on the sampling worker (workers/llm/structured_output.py), once per spec.
The result travels as ``TextParams.structured`` (omnirelay/request_params.py :class:`StructuredOutput`).

Tools (chat): ``tools`` is a list of ``{"type": "function", "function": {"name", "description"?,
"parameters"?}}``; they go to the chat template (``apply_chat_template(tools=…)``). ``tool_choice``:

* ``"none"``: no tool call is parsed (the default without tools);
* ``"auto"`` (the default with tools): the model may answer with Hermes/Qwen markup,
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, which gateway/tool_calls.py turns into
  ``message.tool_calls`` (``parallel_tool_calls: false`` keeps the first);
* ``"required"``: the answer is one call, constrained to ``{"name": <one of the tools>,
  "arguments": <that tool's parameters>}`` (their ``$defs`` hoisted to the root, :func:`_hoisted`);
* named: the answer is the arguments of that function, constrained to its ``parameters`` schema.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

from omnirelay.request_params import MAX_STRUCTURED_SPEC_CHARS, StructuredOutput
from omnirelay.errors import BadRequest, Unprocessable

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class ToolsRequest:
    """A chat request's tools. ``choice``: ``"none"`` | ``"auto"`` | ``"required"`` | ``"named"``
    (``name`` then says which); ``tools``: the function tools as the chat template takes them."""

    tools: tuple[dict, ...]
    choice: str
    name: str = ""
    parallel: bool = True

    def template_tools(self) -> list[dict] | None:
        return [dict(t) for t in self.tools] or None


@functools.lru_cache(maxsize=512)
def check_spec(kind: str, spec: str) -> str:
    """Why xgrammar cannot use ``spec`` ("" when it can). Cached per spec text."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except Exception as exc:   # xgrammar's parse errors (RuntimeError: "[time] file:line: message") and any other
        return (str(exc).split(": ", 1)[-1].strip().splitlines() or [type(exc).__name__])[0][:300]
    return ""


def _checked(kind: str, spec: str, param: str) -> StructuredOutput:
    if len(spec) > MAX_STRUCTURED_SPEC_CHARS:
        raise BadRequest(f"'{param}' is longer than {MAX_STRUCTURED_SPEC_CHARS} characters", param=param)
    error = check_spec(kind, spec)
    if error:
        raise BadRequest(f"'{param}' cannot be compiled: {error}", param=param)
    return StructuredOutput(kind, spec)


def _schema(value: Any, param: str) -> StructuredOutput:
    """A JSON schema (an object, or its JSON text) → a checked json_schema spec."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRequest(f"'{param}' is not valid JSON", param=param) from None
    if isinstance(value, bool) or not isinstance(value, dict):
        raise BadRequest(f"'{param}' must be a JSON schema object", param=param)
    import jsonschema

    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as exc:
        raise BadRequest(f"'{param}' is not a valid JSON schema: {exc.message}", param=param) from None
    except Exception as exc:   # a metaschema it cannot resolve, …: not a schema this server can use
        raise BadRequest(f"'{param}' is not a usable JSON schema: {exc}"[:400], param=param) from None
    # Key order kept: xgrammar emits the properties in the schema's order.
    return _checked("json_schema", json.dumps(value, separators=(",", ":")), param)


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{param}' must be a non-empty string", param=param)
    return value


def _choice(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise BadRequest(f"'{param}' must be a non-empty list of non-empty strings", param=param)
    # JSON string literals are valid EBNF literals (xgrammar reads \" \\ \n \uXXXX alike).
    return _checked("grammar", "root ::= " + " | ".join(json.dumps(c) for c in dict.fromkeys(value)), param)


def _vllm_spec(key: str, value: Any, param: str) -> StructuredOutput:
    if key == "json":
        return _schema(value, param)
    if key == "json_object":
        if value is not True:
            raise BadRequest(f"'{param}' must be true", param=param)
        return StructuredOutput("json_object")
    if key == "choice":
        return _choice(value, param)
    return _checked(key, _string(value, param), param)


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequest("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequest("response_format json_schema needs 'json_schema': {\"name\", \"schema\"}",
                             param="response_format.json_schema")
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or not _TOOL_NAME.match(name)):
            raise BadRequest("'response_format.json_schema.name' must match [A-Za-z0-9_-]{1,64}",
                             param="response_format.json_schema.name")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise Unprocessable(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                        param="response_format.type")


def _structured_outputs(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise BadRequest("'structured_outputs' must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise Unprocessable(f"structured_outputs.{unknown[0]} is not supported", param=f"structured_outputs.{unknown[0]}")
    given = [k for k in _STRUCTURED_KEYS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise BadRequest(f"'structured_outputs' takes exactly one of {', '.join(_STRUCTURED_KEYS)}",
                         param="structured_outputs")
    return _vllm_spec(given[0], value[given[0]], f"structured_outputs.{given[0]}")


MAX_TOOLS = 128   # functions per request, OpenAI's bound; checked before any is parsed


def parse_tools(body: dict, kind: str) -> ToolsRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if kind != "chat":
        raise Unprocessable("tools are a chat parameter", param="tools")
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    if len(tools) > MAX_TOOLS:   # before any is parsed: each costs a schema check and template text
        raise BadRequest(f"'tools' holds {len(tools)} functions; at most {MAX_TOOLS} per request", param="tools")
    parsed, seen = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{…}}}}", param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}",
                             param=f"tools[{i}].function.name")
        if name in seen:
            raise BadRequest(f"tools[{i}]: a second function named {name!r}", param=f"tools[{i}].function.name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"tools[{i}].function.description must be a string",
                             param=f"tools[{i}].function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            _schema(parameters, f"tools[{i}].function.parameters")
        parsed.append({"type": "function", "function": {
            "name": name, **({"description": description} if description else {}),
            "parameters": parameters if parameters is not None else _ANY_OBJECT}})
    names = [t["function"]["name"] for t in parsed]
    if choice is None or choice in ("auto", "none", "required"):
        return ToolsRequest(tuple(parsed), choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise BadRequest(f"tool_choice names {name!r}, which is not in 'tools' ({', '.join(names)})",
                             param="tool_choice")
        return ToolsRequest(tuple(parsed), "named", name, parallel)
    raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": …}}", param="tool_choice")


def tool_spec(tools: ToolsRequest) -> StructuredOutput | None:
    """The grammar a ``required`` or named tool choice puts on the answer (None for auto/none)."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools.tools}
    if tools.choice == "named":
        return _schema(by_name[tools.name], "tool_choice")
    if tools.choice != "required":
        return None
    definitions: dict = {}
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               "arguments": _hoisted(parameters, f"t{i}_", definitions)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for i, (name, parameters) in enumerate(by_name.items())]
    root = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return _schema({**root, "$defs": definitions} if definitions else root, "tools")


_DEFINITION_KEYS = ("$defs", "definitions")


def _hoisted(parameters: dict, prefix: str, definitions: dict) -> dict:
    """A tool's parameters nested under ``arguments`` of the required call's schema: their local
    definitions (``$defs``/``definitions``) move to the root's ``$defs`` under ``prefix`` and every
    ``$ref`` to them is rewritten, since a ``$ref`` resolves from the document's root; a ``$ref`` to
    the parameters' own root (``#``) points at ``$defs/<prefix>root``."""
    moved = {key: f"#/$defs/{prefix}" for key in _DEFINITION_KEYS if isinstance(parameters.get(key), dict)}

    def rewrite(node):
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    out[key] = _rewritten_ref(value, prefix)
                else:
                    out[key] = rewrite(value)
            return out
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    body = rewrite({k: v for k, v in parameters.items() if k not in moved})
    for key in moved:
        for name, definition in parameters[key].items():
            definitions[prefix + name] = rewrite(definition)
    if _refers_to_root(parameters):
        definitions[prefix + "root"] = body
    return body


def _rewritten_ref(ref: str, prefix: str) -> str:
    if ref == "#":
        return f"#/$defs/{prefix}root"
    for key in _DEFINITION_KEYS:
        if ref.startswith(f"#/{key}/"):
            return f"#/$defs/{prefix}" + ref[len(key) + 3:]
    return ref


def _refers_to_root(node) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == "#" or any(_refers_to_root(v) for v in node.values())
    return isinstance(node, list) and any(_refers_to_root(v) for v in node)


def parse_structured(body: dict, kind: str) -> tuple[StructuredOutput | None, ToolsRequest | None]:
    """The request's one grammar spec (None: free text) and its tools (None: none); 400/422 as
    the module docstring says."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("xgrammar", "auto"):
        raise Unprocessable(f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
                            param="guided_decoding_backend")
    specs: list[tuple[str, StructuredOutput | None]] = []
    if body.get("response_format") is not None:
        specs.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        specs.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for alias, key in GUIDED_ALIASES.items():
        if body.get(alias) is not None:
            specs.append((alias, _vllm_spec(key, body[alias], alias)))
    tools = parse_tools(body, kind)
    specs = [(name, spec) for name, spec in specs if spec is not None]
    if len(specs) > 1:
        raise BadRequest(f"'{specs[1][0]}' and '{specs[0][0]}' both constrain the answer; give one",
                         param=specs[1][0])
    if tools is not None and tools.choice in ("required", "named"):
        # A forced call wins over response_format (as vLLM: the answer is the call); vLLM refuses a
        # named choice beside structured_outputs, and so do we.
        if tools.choice == "named" and specs and specs[0][0] != "response_format":
            raise BadRequest(f"'{specs[0][0]}' and a named 'tool_choice' both constrain the answer; give one",
                             param=specs[0][0])
        return tool_spec(tools), tools
    return (specs[0][1] if specs else None), tools
