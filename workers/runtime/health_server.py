"""A worker's own health over HTTP (``omni-worker --health-port PORT``), for supervisors that probe
with HTTP and cannot speak the bus: Kubernetes' ``httpGet`` liveness and readiness probes.

``GET /live``  200 while the worker loop makes progress; 503 once one iteration (an engine step and
               the transfers inside it) has lasted ``wedged_after_s`` (the broker drops such a
               worker too, see ``broker_link.py``) or the broker link's thread died. A draining
               worker is live: killing it would cut its drain short.
``GET /ready`` 200 while the worker serves (registered, granting credits); 503 while it starts or
               drains, so a rolling update waits for the new worker before draining the old.

Both answer a small JSON body: ``{"state", "role", "worker_id", "step_age_s"}``, where ``state`` is
one of ``starting``, ``serving``, ``draining``, ``wedged``, ``link_down``.

Threads: :class:`HealthServer` runs one server thread; its owner (the daemon's main thread) calls
:meth:`HealthServer.start` and, on every way out, :meth:`HealthServer.close`, which stops and joins
it. The handler only calls ``probe()`` (the runtime's :meth:`~WorkerRuntime.health`), which reads
attributes the loop writes as single references, so it never waits for the loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("omnirelay.worker")

JOIN_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class WorkerHealth:
    """One reading of a worker's state, as its probes report it."""

    state: str          # starting | serving | draining | wedged | link_down
    role: str
    worker_id: str
    step_age_s: float   # how long the loop has been in its current iteration

    @property
    def live(self) -> bool:
        return self.state not in ("wedged", "link_down")

    @property
    def ready(self) -> bool:
        return self.state == "serving"


class HealthServer:
    """``GET /live`` and ``GET /ready`` on ``host:port`` (port 0: any free one, see :attr:`port`)."""

    def __init__(self, probe: Callable[[], WorkerHealth], host: str, port: int):
        self._probe = probe
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True   # a probe connection never holds up close()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-server", daemon=True)
        self._thread.start()
        log.info("health endpoint on %s:%d (/live, /ready)", *self._server.server_address[:2])

    def close(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(JOIN_TIMEOUT_S)
            self._thread = None
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        probe = self._probe

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:   # noqa: N802 (http.server's name)
                if self.path not in ("/live", "/ready"):
                    self._answer(404, {"error": f"no route {self.path}; try /live or /ready"})
                    return
                health = probe()
                ok = health.live if self.path == "/live" else health.ready
                self._answer(200 if ok else 503, {"state": health.state, "role": health.role,
                                                  "worker_id": health.worker_id,
                                                  "step_age_s": round(health.step_age_s, 3)})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args) -> None:   # probes every few seconds: not worth a line
                pass

        return Handler
