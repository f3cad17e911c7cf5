"""The broker's records: one per registered worker, one per request in flight.

Plain slotted dataclasses that only :class:`~omnirelay.broker.core.BrokerCore` mutates; ``describe``
is what ``GET /cluster`` shows of a worker.
"""

from __future__ import annotations

import dataclasses
import enum

from . import protocol as p
from .prefix_index import PrefixSet


class Phase(enum.Enum):
    QUEUED = "queued"
    BACKOFF = "backoff"     # restarting after a failed transfer, queued again once not_before passes
    RUNNING = "running"


# Python 3.11 finds an enum member through the metaclass (~0.1 µs a lookup, several per message):
# the handlers read these module globals instead.
QUEUED, BACKOFF, RUNNING = Phase.QUEUED, Phase.BACKOFF, Phase.RUNNING


@dataclasses.dataclass(slots=True)
class WorkerState:
    worker_id: str
    identity: bytes
    role: str
    model: str
    capacity: int
    pid: int
    host: str
    last_seen: float
    credits: int = 0
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = -1
    stats: dict = dataclasses.field(default_factory=dict)
    tasks: set[str] = dataclasses.field(default_factory=set)
    block_size: int = 0                 # > 0: reports its prefix cache (prefix-aware routing)
    prefix: PrefixSet | None = None
    dispatched: int = 0                 # tasks sent to it since it registered
    prefix_routed: int = 0              # … of which went to it for a cached prefix
    # LoRA adapters it holds (broker/lora_affinity.py), and those sent since: name → ``sent`` then.
    loras: set[str] | None = None       # None: it serves no LoRA
    lora_pending: dict[str, int] = dataclasses.field(default_factory=dict)
    lora_routed: int = 0                # tasks sent to it because it held their adapter
    # Freshness (p.Heartbeat.reports/received), each count on from where its Register said it stood:
    reports: int = 0                    # stage reports received from it
    sent: int = 0                       # Tasks and CancelTasks sent to it
    reported: int = -1                  # Heartbeat.reports of its last heartbeat (-1: none yet)
    handled: int = -1                   # Heartbeat.received of its last heartbeat

    @property
    def settled(self) -> bool:
        """It holds and runs nothing, and its last heartbeat was made after it had handled every
        message sent to it and counts every stage report received from it: its ``stats`` include
        each request it finished or dropped."""
        return (not self.tasks and self.running == 0 and self.waiting == 0
                and self.reported == self.reports and self.handled == self.sent)

    def describe(self, now: float) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "model": self.model, "pid": self.pid,
                "host": self.host, "capacity": self.capacity, "credits": self.credits,
                "assigned": len(self.tasks), "running": self.running, "waiting": self.waiting,
                "free_kv_blocks": self.free_kv_blocks, "stats": dict(self.stats),
                "last_seen_s": round(now - self.last_seen, 3), "dispatched": self.dispatched,
                "prefix_routed": self.prefix_routed, "block_size": self.block_size,
                "prefix_keys": len(self.prefix) if self.prefix is not None else 0,
                "loras": sorted(self.loras or ()), "lora_routed": self.lora_routed,
                "reports": self.reports, "settled": self.settled}


@dataclasses.dataclass(slots=True)
class RequestState:
    spec: p.Submit
    gateway: bytes
    stage_index: int = 0
    inputs: p.Handoff | None = None   # what this stage reads: carried, never looked inside
    phase: Phase = QUEUED
    worker_id: str | None = None
    attempts: int = 0
    dispatched_at: float = 0.0
    not_before: float = 0.0             # in BACKOFF: when it may be queued again
    # A stage streaming into the current one (StageStreaming): its worker, until its own report.
    producer_id: str | None = None
    former_producer: str | None = None  # … and once it reported: told when the consumer finishes
    streamed: bool = False              # the current stage reads a stream: it cannot be replayed alone
    stages_done: bool = False           # the last stage finished while its producer still ran

    @property
    def stage(self) -> str:
        return self.spec.stages[self.stage_index]
