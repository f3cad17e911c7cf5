"""A live status page: ``GET /status`` (HTML, no external resources) and ``GET /status.json``.

:class:`StatusHistory` samples the cluster once a second — the broker's status (workers per role,
their load and health, queue depths) and the gateway's own totals — and keeps the last five
minutes, from which the page draws throughput and latency. Its sampling task is owned by the app
(started and cancelled in a cleanup context); the page polls ``/status.json`` every second.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from .bus import BusClient
from .metrics import GatewayMetrics

HISTORY_SECONDS = 300


class StatusHistory:
    def __init__(self, bus: BusClient, metrics: GatewayMetrics, interval_s: float = 1.0):
        self._bus = bus
        self._metrics = metrics
        self._interval_s = interval_s
        self.samples: collections.deque[dict] = collections.deque(maxlen=int(HISTORY_SECONDS / interval_s))
        self.latest: dict = {"workers": [], "queued": {}, "broker_reachable": False}
        self._previous: tuple[float, dict] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="status-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self._interval_s)

    async def sample(self) -> None:
        status = await self._bus.status(timeout=self._interval_s)
        now = time.time()
        if status is not None:
            self.latest = {"workers": status.workers, "queued": status.queued, "broker_reachable": True}
        else:
            self.latest = {**self.latest, "broker_reachable": False}
        totals = dict(self._metrics.totals)
        if self._previous is not None:
            then, before = self._previous
            span = max(now - then, 1e-6)
            delta = {k: totals.get(k, 0) - before.get(k, 0) for k in totals}
            ttft_n = delta.get("ttft_count", 0)
            self.samples.append({
                "t": round(now, 3),
                "requests_per_s": round(delta.get("requests", 0) / span, 3),
                "tokens_per_s": round(delta.get("generation_tokens", 0) / span, 3),
                "ttft_ms": round(1000 * delta.get("ttft_sum", 0) / ttft_n, 2) if ttft_n else None,
                "errors_per_s": round(delta.get("errors", 0) / span, 3),
                "live_workers": len(self.latest["workers"]),
                "queued": sum(self.latest["queued"].values()),
            })
        self._previous = (now, totals)

    def snapshot(self) -> dict:
        return {**self.latest, "history": list(self.samples), "now": time.time()}


STATUS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>omnirelay status</title>
<style>
 body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
 h1{font-size:1.3em} h2{font-size:1.05em;margin-top:1.4em}
 table{border-collapse:collapse} td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:left}
 .ok{color:#080} .bad{color:#b00} .charts{display:flex;gap:2em;flex-wrap:wrap}
 svg{border:1px solid #ccc;background:#fafafa} .muted{color:#777}
</style></head><body>
<h1>omnirelay <span id="broker" class="muted">connecting…</span></h1>
<h2>Workers</h2>
<table><thead><tr><th>role</th><th>worker</th><th>pid</th><th>running</th><th>waiting</th>
<th>credits</th><th>free KV blocks</th><th>last heartbeat</th></tr></thead><tbody id="workers"></tbody></table>
<h2>Queues</h2><div id="queues" class="muted">none</div>
<h2>Last minutes</h2>
<div class="charts">
 <div><div>output tokens/s <b id="tok"></b></div><svg id="c_tok" width="320" height="90"></svg></div>
 <div><div>requests/s <b id="req"></b></div><svg id="c_req" width="320" height="90"></svg></div>
 <div><div>TTFT ms <b id="ttft"></b></div><svg id="c_ttft" width="320" height="90"></svg></div>
</div>
<script>
function esc(s){return String(s).replace(/[&<>"]/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]))}
function chart(id,values){
  const svg=document.getElementById(id),w=320,h=90,v=values.map(x=>x==null?0:x);
  const max=Math.max(1e-9,...v);
  const pts=v.map((x,i)=>`${(i/Math.max(1,v.length-1))*w},${h-4-(x/max)*(h-8)}`).join(" ");
  svg.innerHTML=`<polyline fill="none" stroke="#36c" stroke-width="1.5" points="${pts}"/>`;
}
async function refresh(){
  try{
    const r=await fetch("status.json",{cache:"no-store"}); const s=await r.json();
    const b=document.getElementById("broker");
    b.textContent=s.broker_reachable?"broker reachable":"broker unreachable";
    b.className=s.broker_reachable?"ok":"bad";
    const rows=s.workers.slice().sort((a,c)=>(a.role+a.worker_id).localeCompare(c.role+c.worker_id));
    document.getElementById("workers").innerHTML=rows.map(w=>`<tr data-worker="${esc(w.worker_id)}">
      <td>${esc(w.role)}</td><td>${esc(w.worker_id)}</td><td>${w.pid}</td><td>${w.running}</td>
      <td>${w.waiting}</td><td>${w.credits}</td><td>${w.free_kv_blocks<0?"":w.free_kv_blocks}</td>
      <td class="${w.last_seen_s>2?"bad":"ok"}">${w.last_seen_s.toFixed(1)} s ago</td></tr>`).join("")
      ||'<tr><td colspan="8" class="bad">no live worker</td></tr>';
    const q=Object.entries(s.queued).map(([k,n])=>`${esc(k)}: ${n}`).join(" · ");
    document.getElementById("queues").textContent=q||"none";
    const h=s.history.slice(-120), last=h[h.length-1]||{};
    chart("c_tok",h.map(x=>x.tokens_per_s)); chart("c_req",h.map(x=>x.requests_per_s));
    chart("c_ttft",h.map(x=>x.ttft_ms));
    document.getElementById("tok").textContent=last.tokens_per_s??"";
    document.getElementById("req").textContent=last.requests_per_s??"";
    document.getElementById("ttft").textContent=last.ttft_ms??"";
  }catch(e){document.getElementById("broker").textContent="gateway unreachable";}
}
refresh(); setInterval(refresh,1000);
</script></body></html>
"""
