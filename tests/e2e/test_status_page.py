"""The live status page in a real headless Chromium, driven over the DevTools protocol: a worker
that joins appears on the open page, and disappears when it dies — without a reload."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time

import aiohttp
import pytest

from cluster import Cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")]


class DevTools:
    """Just enough of the Chrome DevTools protocol: open a page, evaluate JavaScript in it."""

    def __init__(self, ws):
        self._ws = ws
        self._next_id = 0

    async def call(self, method: str, session: str | None = None, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        await self._ws.send_str(json.dumps(message))
        while True:
            reply = json.loads((await asyncio.wait_for(self._ws.receive(), 30)).data)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(reply["error"])
                return reply["result"]


def _start_chromium(profile: str, log_path: str) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w")
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"DevTools listening on (ws://\S+)", open(log_path).read())
        if match:
            return proc, match.group(1)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("chromium did not start:\n" + open(log_path).read()[-2000:])


async def _page_text(devtools: DevTools, session: str) -> str:
    result = await devtools.call("Runtime.evaluate", session, expression="document.body.innerText",
                                 returnByValue=True)
    return result["result"].get("value", "")


async def _wait_for(devtools, session, predicate, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = await _page_text(devtools, session)
        if predicate(text):
            return text
        await asyncio.sleep(0.5)
    raise AssertionError(f"page never reached the expected state; it shows:\n{text}")


def test_status_page_follows_workers_live(tiny_model, tmp_path):
    cluster = Cluster(model=tiny_model, log_dir=str(tmp_path))
    chromium = None
    try:
        cluster.start_llm()
        chromium, browser_ws = _start_chromium(str(tmp_path / "profile"), str(tmp_path / "chromium.log"))

        async def scenario() -> None:
            async with aiohttp.ClientSession() as http, http.ws_connect(browser_ws, max_msg_size=0) as ws:
                devtools = DevTools(ws)
                target = await devtools.call("Target.createTarget", url=cluster.url + "/status")
                session = (await devtools.call("Target.attachToTarget", targetId=target["targetId"],
                                               flatten=True))["sessionId"]
                first = {w["worker_id"] for w in cluster.workers()}
                await _wait_for(devtools, session, lambda t: all(w in t for w in first) and "broker reachable" in t, 30)

                newcomer = cluster.start_worker("decode")
                deadline = time.monotonic() + 60
                joined = None
                while joined is None and time.monotonic() < deadline:
                    joined = next((w["worker_id"] for w in cluster.workers() if w["pid"] == newcomer.pid), None)
                    await asyncio.sleep(0.3)
                assert joined, "the new worker never registered"
                await _wait_for(devtools, session, lambda t: joined in t, 15)

                newcomer.kill9()   # dies without unregistering: the broker must notice by itself
                await _wait_for(devtools, session, lambda t: joined not in t and all(w in t for w in first), 20)

        asyncio.run(scenario())
    finally:
        if chromium is not None:
            os.killpg(chromium.pid, signal.SIGKILL)
            chromium.wait(10)
        cluster.stop()
