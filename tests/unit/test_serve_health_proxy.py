"""omni-serve's readiness check reaches its own gateway directly, whatever proxy the environment names."""

from __future__ import annotations

import http.server
import threading

from omnirelay.deploy import serve


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def test_health_ignores_an_http_proxy(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")     # discard port: nothing answers there
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert serve._health(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()
