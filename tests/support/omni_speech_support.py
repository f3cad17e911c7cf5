"""What the streamed-speech tests read from a running cluster: the generate workers' streamed-speech
counters (they travel in heartbeats: read once the cluster says they are final, :func:`settled_workers`)
and ``stream_format="sse"`` speech through the official client."""

from __future__ import annotations

import base64
import json

from cluster import settled_workers


def settled_speech_stream_stats(cluster) -> dict:
    """The generate workers' streamed-speech counters, summed, once every answered request is
    counted in them (:func:`settled_workers`)."""
    return _speech_stream_counters(settled_workers(cluster.url))


def _speech_stream_counters(workers: list[dict]) -> dict:
    out: dict = {}
    for worker in workers:
        if worker["role"] == "generate":
            for key, value in worker.get("stats", {}).items():
                if key.startswith("speech_stream_"):
                    out[key] = out.get(key, 0) + value
    return out


def speech_stream_stats_after(cluster, before: dict, requests: int) -> dict:
    """How the counters moved since ``before``, read once the cluster settled; exactly ``requests``
    more streamed requests must be counted (the answered ones are all in by then)."""
    stats = settled_speech_stream_stats(cluster)
    delta = {key: value - before.get(key, 0) for key, value in stats.items()}
    assert delta.get("speech_stream_requests", 0) == requests, delta
    return delta


def speech_events(client, **kwargs) -> tuple[list[bytes], dict]:
    """``stream_format="sse"`` through the official client: the decoded deltas and the done event
    (which must be the last event, after at least one delta)."""
    events = []
    with client.audio.speech.with_streaming_response.create(stream_format="sse", **kwargs) as response:
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(json.loads(line[len("data: "):]))
    *deltas, done = events
    assert deltas and all(set(e) == {"type", "audio"} and e["type"] == "speech.audio.delta" for e in deltas), events
    assert done["type"] == "speech.audio.done", done
    return [base64.b64decode(e["audio"]) for e in deltas], done
