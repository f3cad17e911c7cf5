"""The markup a model writes a tool call in, one reader per ``--tool-call-parser`` (vLLM's names).

Both formats wrap each call in ``<tool_call>…</tool_call>``; gateway/tool_calls.py finds those
blocks in the (possibly streamed) answer and hands each block's body to :func:`parse_block` of the
model's format, which returns the block's calls, or None when it is not a call to one of the request's
tools (the block then stays content):

* ``hermes`` (Hermes, Qwen2.5, Qwen3): a JSON object ``{"name": …, "arguments": {…}}`` (``parameters``
  accepted for ``arguments``; arguments given as a JSON string are parsed).
* ``qwen3_coder`` (Qwen3-Coder): XML-like,
  ``<function=NAME><parameter=P>value</parameter>…</function>``, one or more functions per block.
  A value is text: one newline after the opening tag and one before the closing tag belong to the
  markup. Each value is converted by the type its tool's JSON schema gives the parameter, as vLLM's
  parser does: ``string`` (and no type, or a parameter the schema does not name) stays text;
  ``integer`` → int and ``number`` → float (int when whole), left as text when they do not parse;
  ``boolean`` → ``value.lower() == "true"``; ``object``/``array`` → JSON, else a Python literal, else
  text; the text ``null`` (any case) is null whatever the type. A type list (``["integer", "null"]``)
  tries its types in order. A missing ``</parameter>`` or ``</function>`` ends at the next tag or
  the block's end.

Arguments are returned as a JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")   # vLLM's --tool-call-parser names served here
DEFAULT_TOOL_CALL_PARSER = "hermes"

Call = tuple[str, str]   # (function name, arguments as a JSON string)


def parse_hermes(body: str, tools: dict[str, dict]) -> list[Call] | None:
    try:
        call = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):   # some templates emit the arguments already serialised
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return [(call["name"], json.dumps(arguments, ensure_ascii=False))]


_FUNCTION = re.compile(r"<function=(?P<name>[^>\n]*)>(?P<body>.*?)(?:</function>|(?=<function=)|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(?P<name>[^>\n]*)>(?P<value>.*?)"
                        r"(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)


def parse_qwen3_coder(body: str, tools: dict[str, dict]) -> list[Call] | None:
    functions = list(_FUNCTION.finditer(body))
    # Anything but whitespace outside the functions means this is not (only) call markup.
    if not functions or _FUNCTION.sub("", body).strip():
        return None
    calls = []
    for function in functions:
        name = function.group("name").strip()
        if name not in tools:
            return None
        properties = _properties(tools[name])
        arguments = {}
        for parameter in _PARAMETER.finditer(function.group("body")):
            value = parameter.group("value")
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = parameter.group("name").strip()
            arguments[key] = convert_value(value, properties.get(key))
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _properties(tool: dict) -> dict:
    parameters = tool.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}


def convert_value(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the JSON value its schema's type says (see the module doc)."""
    if text.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    for one in (kind if isinstance(kind, list) else [kind]):
        value = _as_type(text, str(one).strip().lower())
        if value is not _NO:
            return value
    return text


_NO = object()   # "not of this type"


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")   # json.loads would take NaN and Infinity


def _as_type(text: str, kind: str) -> Any:
    if kind in ("string", "str", "text", "enum"):
        return text
    if kind == "null":
        return _NO
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text.strip())
        except ValueError:
            return _NO
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(text.strip())
        except ValueError:
            return _NO
        if number != number or number in (float("inf"), float("-inf")):
            return _NO   # not a JSON number
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool"):
        return text.strip().lower() == "true"
    if kind in ("object", "array", "dict", "list"):
        try:
            return json.loads(text, parse_constant=_not_json)
        except ValueError:
            pass
    return _literal(text)


def _literal(text: str) -> Any:
    """A Python literal's value when JSON can carry it (``{'a': 1}``, ``True``), else :data:`_NO`."""
    try:
        return json.loads(json.dumps(ast.literal_eval(text.strip()), allow_nan=False))   # a tuple becomes a list
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO


PARSE_BLOCK = {"hermes": parse_hermes, "qwen3_coder": parse_qwen3_coder}
