"""What a bus field that names an endpoint may hold: the one check, shared by the broker (where the
field enters) and the workers (where it is used).

A gateway's ``reply_to`` (``Submit.reply_to``, copied into ``Task.reply_to``) is an endpoint every
worker of the request connects a PUSH socket to. Any peer admitted to the bus can send one, so it is
checked before anyone connects: ``tcp://HOST:PORT`` (a host name, an IPv4 address or a bracketed
IPv6 one; a port 1 to 65535) or ``ipc://PATH``. Anything else — another transport, a wildcard, a
port that is not a number, ZeroMQ's ``source;destination`` form, control characters — is refused
with a reason, so ``connect()`` is never asked to parse what it would raise on. An empty endpoint
means "nobody to answer" and is left to the caller (workers send nothing there).
"""

from __future__ import annotations

import ipaddress
import re

MAX_ENDPOINT_CHARS = 256
# A DNS name or an interface name: letters, digits, '-', '_' and '.'.
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def endpoint_error(endpoint: str) -> str:
    """Why ``endpoint`` is not one a worker may connect to; "" when it is (or is empty)."""
    if not endpoint:
        return ""
    if len(endpoint) > MAX_ENDPOINT_CHARS:
        return f"endpoint longer than {MAX_ENDPOINT_CHARS} characters"
    if not endpoint.isprintable() or any(c in endpoint for c in " ;,"):
        return f"endpoint {endpoint[:64]!r} holds spaces, separators or control characters"
    if endpoint.startswith("ipc://"):
        return "" if len(endpoint) > len("ipc://") else "ipc endpoint without a path"
    if not endpoint.startswith("tcp://"):
        return f"endpoint {endpoint[:64]!r} is neither tcp://host:port nor ipc://path"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not port.isascii() or not 1 <= int(port) <= 65535:
        return f"endpoint {endpoint[:64]!r} has no port 1-65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"endpoint {endpoint[:64]!r} has a malformed IPv6 address"
        return ""
    if not _HOST_NAME.fullmatch(host):
        return f"endpoint {endpoint[:64]!r} has no host name or address"
    return ""
