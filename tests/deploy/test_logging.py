"""--log-format json: every log line of a daemon is one JSON object."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time


def test_broker_logs_json_lines(tmp_path):
    log_path = tmp_path / "broker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omnirelay.broker.daemon", "--endpoint",
                                 f"ipc://{tmp_path}/b.sock", "--log-format", "json", "--log-level", "INFO"],
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "listening" not in log_path.read_text():
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    assert lines and all({"ts", "level", "daemon", "pid", "message"} <= set(entry) for entry in lines)
    assert any("broker listening on ipc://" in entry["message"] for entry in lines)
