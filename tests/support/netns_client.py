"""A client host of the multi-host test, run inside a network namespace (``ip netns exec NS python …``).

Subcommands (each prints one JSON line, or writes a JSON file):

* ``health URL TIMEOUT`` — wait until ``URL/health`` answers 200; exit 1 after TIMEOUT seconds.
* ``cluster URL`` — print ``URL/cluster``.
* ``media URL MODEL`` — one chat completion with a small PNG in it (a data: URL); prints
  ``{"status", "finish_reason", "text"}``.
* ``load URL MODEL OUT --concurrency N --max-requests M --max-seconds S --stop-file F`` — N threads
  send chat completions (every other one streamed) until F exists, M requests were sent, or S
  seconds passed; then write ``{"ok", "failed", "errors", "sent"}`` to OUT. Progress (the count of
  answered requests) goes to ``OUT.progress`` as it happens. Bounded in count and in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import requests


def _health(url: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            response = requests.get(url + "/health", timeout=2)
            if response.status_code == 200:
                print(json.dumps({"healthy": True}))
                return 0
            last = response.text[:300]
        except requests.RequestException as exc:
            last = str(exc)[:300]
        time.sleep(0.3)
    print(json.dumps({"healthy": False, "last": last}))
    return 1


def _one(url: str, model: str, n: int) -> str | None:
    """None on success, else a description of the failure."""
    body = {"model": model, "messages": [{"role": "user", "content": f"request {n}: tell me a story"}],
            "max_tokens": 16, "temperature": 0}
    stream = n % 2 == 1
    if stream:
        body["stream"] = True
    try:
        response = requests.post(url + "/v1/chat/completions", json=body, timeout=60, stream=stream)
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.text[:200]}"
        if not stream:
            choice = response.json()["choices"][0]
            return None if choice["finish_reason"] in ("length", "stop") else f"finish_reason {choice}"
        finished = False
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                return None if finished else "stream ended without a finish_reason"
            event = json.loads(data)
            if "error" in event:
                return f"stream error: {event['error']}"
            if any(choice.get("finish_reason") for choice in event.get("choices", [])):
                finished = True
        return "stream closed before [DONE]"
    except (requests.RequestException, ValueError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def _media(url: str, model: str) -> int:
    import base64
    import io

    from PIL import Image
    png = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 40, 40)).save(png, format="PNG")
    image = {"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]}
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    answer = response.json()
    choice = answer.get("choices", [{}])[0]
    print(json.dumps({"status": response.status_code, "finish_reason": choice.get("finish_reason"),
                      "text": choice.get("message", {}).get("content"), "error": answer.get("error")}))
    return 0 if response.status_code == 200 else 1


def _load(args: argparse.Namespace) -> int:
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0, "sent": 0}
    errors: list[str] = []
    deadline = time.monotonic() + args.max_seconds

    def running() -> bool:
        return time.monotonic() < deadline and not os.path.exists(args.stop_file)

    def worker() -> None:
        while running():
            with lock:
                if counts["sent"] >= args.max_requests:
                    return
                counts["sent"] += 1
                n = counts["sent"]
            error = _one(args.url, args.model, n)
            with lock:
                counts["failed" if error else "ok"] += 1
                if error:
                    errors.append(error)
                with open(args.out + ".progress.tmp", "w") as handle:
                    json.dump(counts, handle)
                os.replace(args.out + ".progress.tmp", args.out + ".progress")

    threads = [threading.Thread(target=worker, name=f"load-{i}") for i in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with open(args.out, "w") as handle:
        json.dump({**counts, "errors": errors[:20]}, handle)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    health = sub.add_parser("health")
    health.add_argument("url")
    health.add_argument("timeout", type=float)
    cluster = sub.add_parser("cluster")
    cluster.add_argument("url")
    media = sub.add_parser("media")
    media.add_argument("url")
    media.add_argument("model")
    load = sub.add_parser("load")
    load.add_argument("url")
    load.add_argument("model")
    load.add_argument("out")
    load.add_argument("--concurrency", type=int, default=3)
    load.add_argument("--max-requests", type=int, default=300)
    load.add_argument("--max-seconds", type=float, default=120)
    load.add_argument("--stop-file", required=True)
    args = parser.parse_args(argv)
    if args.command == "health":
        return _health(args.url, args.timeout)
    if args.command == "cluster":
        print(json.dumps(requests.get(args.url + "/cluster", timeout=10).json()))
        return 0
    if args.command == "media":
        return _media(args.url, args.model)
    return _load(args)


if __name__ == "__main__":
    sys.exit(main())
