"""Bus security: ZeroMQ CURVE (authentication + encryption) for every socket that leaves loopback.

Keys are ZeroMQ certificate files written by ``omni-keygen``: ``NAME.key`` holds the public key,
``NAME.key_secret`` the public and secret key. Who holds what:

* the broker: its own secret certificate, and a directory of authorised *public* certificates —
  only peers whose public key is there may talk to it (ZAP handler, per process);
* a worker or gateway: its own secret certificate and the broker's public certificate;
* the gateway's token socket (where workers push tokens) is a CURVE server too, with the gateway's
  own key; its public key travels with each request (``Submit.reply_key`` → ``Task.reply_key``),
  and it admits the same authorised keys.

The rule: a socket that binds or connects to anything but loopback (``tcp://127.*``, ``localhost``,
``::1``) or a local ``ipc://`` path must use CURVE; :func:`require_curve_off_loopback` refuses to
start otherwise, with a message naming the endpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth


class SecurityError(ValueError):
    """Missing or unusable keys, or an off-loopback endpoint without CURVE."""


def is_loopback(endpoint: str) -> bool:
    if "," in endpoint:   # an active broker and its standby (``--broker A,B``): loopback only if both are
        return all(is_loopback(part) for part in endpoint.split(","))
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a hostname or "*": assume it is reachable from elsewhere


def _load(path: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not os.path.isfile(path):
        raise SecurityError(f"CURVE key file {path!r} does not exist (create keys with omni-keygen)")
    public, secret = zmq.auth.load_certificate(path)
    if need_secret and not secret:
        raise SecurityError(f"{path!r} has no secret key (use the .key_secret file)")
    return public, secret


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """A process's CURVE material. ``server_key`` (clients) is the peer's public key;
    ``authorized_dir`` (servers) holds the public certificates of admitted peers."""

    public: bytes
    secret: bytes
    server_key: bytes | None = None
    authorized_dir: str | None = None

    @classmethod
    def load(cls, secret_key_file: str, server_key_file: str | None = None,
             authorized_dir: str | None = None) -> "CurveKeys":
        public, secret = _load(secret_key_file, need_secret=True)
        server = _load(server_key_file, need_secret=False)[0] if server_key_file else None
        if authorized_dir is not None and not os.path.isdir(authorized_dir):
            raise SecurityError(f"authorised keys directory {authorized_dir!r} does not exist")
        return cls(public=public, secret=secret, server_key=server, authorized_dir=authorized_dir)

    def make_server(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def make_client(self, sock: zmq.Socket, server_key: bytes | None = None) -> None:
        server = server_key or self.server_key
        if server is None:
            raise SecurityError("no server public key to connect with CURVE")
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = server


def start_authenticator(ctx: zmq.Context, keys: CurveKeys):
    """Start the ZAP handler of ``ctx`` admitting the public keys in ``keys.authorized_dir``.
    Returns the authenticator; its owner calls ``.stop()`` before terminating the context."""
    if not keys.authorized_dir:
        raise SecurityError("a CURVE server needs an authorised keys directory")
    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator
        auth = AsyncioAuthenticator(ctx)
    else:
        from zmq.auth.thread import ThreadAuthenticator
        auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.authorized_dir)
    return auth


def require_curve_off_loopback(keys: CurveKeys | None, *endpoints: str) -> None:
    for endpoint in endpoints:
        if keys is None and not is_loopback(endpoint):
            raise SecurityError(f"{endpoint} is not loopback: CURVE keys are required "
                                "(--curve-secret-key and --curve-server-key / --curve-authorized-keys)")


def add_curve_arguments(parser: argparse.ArgumentParser, server: bool, client: bool) -> None:
    group = parser.add_argument_group("bus security (ZeroMQ CURVE)")
    group.add_argument("--curve-secret-key", default=None, help="this process's .key_secret certificate")
    if client:
        group.add_argument("--curve-server-key", default=None, help="the broker's public .key certificate")
    if server:
        group.add_argument("--curve-authorized-keys", default=None,
                           help="directory of public .key certificates of admitted peers")


def keys_from_args(args: argparse.Namespace) -> CurveKeys | None:
    if not args.curve_secret_key:
        return None
    return CurveKeys.load(args.curve_secret_key, getattr(args, "curve_server_key", None),
                          getattr(args, "curve_authorized_keys", None))


def keygen_main(argv: list[str] | None = None) -> int:
    """``omni-keygen DIR NAME…``: write ``DIR/NAME.key`` and ``DIR/NAME.key_secret`` per name, and
    copy the public halves into ``DIR/authorized/`` (hand that directory to the broker and gateways)."""
    parser = argparse.ArgumentParser(prog="omni-keygen", description="write CURVE certificates for the bus")
    parser.add_argument("directory")
    parser.add_argument("names", nargs="+", help="e.g. broker gateway worker")
    args = parser.parse_args(argv)
    root = Path(args.directory)
    authorized = root / "authorized"
    authorized.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    for name in args.names:
        if (root / f"{name}.key_secret").exists():
            print(f"{root / name}.key_secret exists; keeping it")
        else:
            public_file, secret_file = zmq.auth.create_certificates(str(root), name)
            os.chmod(secret_file, 0o600)
        (authorized / f"{name}.key").write_bytes((root / f"{name}.key").read_bytes())
        print(f"{root / name}.key, {root / name}.key_secret")
    return 0
