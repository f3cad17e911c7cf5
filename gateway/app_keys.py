"""The typed keys the gateway's state hangs off the aiohttp app under.

A leaf: it imports nothing of the gateway at run time (the value types are named for the type
checker only), so app.py, the middleware and every route module can import it without a circle.
app.py fills them in :func:`~omnirelay.gateway.app.create_app` and the bus's cleanup context.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from omnirelay.security import CurveKeys
    from omnirelay.tracing import Tracing

    from .bus import BusClient
    from .config import GatewayConfig
    from .metrics import GatewayMetrics
    from .response_store import ResponseStore
    from .server_load import ServerLoad
    from .spoken_answers import SpokenAnswers
    from .status_page import StatusHistory

CONFIG: web.AppKey[GatewayConfig] = web.AppKey("config")
MODELS: web.AppKey[dict] = web.AppKey("models")             # name → ModelRuntime, ImageModel or VideoModel
BUS: web.AppKey[BusClient] = web.AppKey("bus")
KEYS: web.AppKey[CurveKeys | None] = web.AppKey("keys")      # CURVE material for the bus, or None
METRICS: web.AppKey[GatewayMetrics] = web.AppKey("metrics")
HISTORY: web.AppKey[StatusHistory] = web.AppKey("history")
STREAMS: web.AppKey[collections.Counter] = web.AppKey("streams_per_client")   # client address → open streams
RESPONSES: web.AppKey[ResponseStore] = web.AppKey("responses")   # stored Responses (routes/responses.py)
TRACING: web.AppKey[Tracing | None] = web.AppKey("tracing")   # request spans (omnirelay/tracing.py), or None
SPOKEN_ANSWERS: web.AppKey[SpokenAnswers] = web.AppKey("spoken_answers")   # transcripts by audio id
SERVER_LOAD: web.AppKey[ServerLoad] = web.AppKey("server_load")   # GET /load's count (gateway/server_load.py)
