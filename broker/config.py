"""Configuration of the broker daemon (one frozen object, validated on construction)."""

from __future__ import annotations

import dataclasses

from omnirelay.scheduling import check_policy


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """
    endpoint:            ZeroMQ endpoint the ROUTER socket binds (``tcp://127.0.0.1:5555``, ``ipc://…``).
    heartbeat_interval_s: how often workers are expected to heartbeat; also the broker's tick.
    liveness_s:          a worker silent for this long is dropped and its stages re-dispatched.
    expect_back_s:       … and expected back for this long (broker/expected.py): a role whose only
                         workers are expected back holds its requests in its queue (bounded,
                         failed at their deadline) instead of failing them as unavailable, and
                         dispatches them when a worker of the role registers. 0: never expected.
    max_queue_per_role:  bound of each (model, role) queue; beyond it submissions are rejected.
    max_attempts:        how many times one request may be (re)started after worker loss.
    retry_after_s:       the Retry-After hint sent with overload/unavailable rejections (and, at least,
                         with a transfer failure that used up ``max_attempts``).
    retry_backoff_s:     the wait before restarting a request after a failed transfer; it doubles with
                         each further attempt. 0 restarts at once. Kept to within half a heartbeat
                         interval (the daemon's tick) or the next message the broker handles.
    retry_backoff_max_s: the cap of that wait.
    max_workers:         bound of the registry (registrations beyond it are refused).
    prefix_keys_per_worker: bound of the prefix-cache block keys kept per worker (prefix-aware
                         routing; ~100 bytes each), least recently touched dropped first.
    prefix_load_slack:   a worker with a longer cached prefix wins only while it has at most this
                         many more assigned tasks than the least-loaded worker of its role.
    lora_load_slack:     a worker holding a request's LoRA adapter wins only while it has at most this
                         many more assigned tasks than the least-loaded worker of its role (beyond
                         it the adapter goes to a cold worker too: broker/lora_affinity.py).
    scheduling_policy:   ``fcfs`` (FIFO queues) or ``priority`` (lowest ``Submit.priority`` first, aged
                         by the wait: omnirelay/scheduling.py).
    """

    endpoint: str = "tcp://127.0.0.1:5555"
    heartbeat_interval_s: float = 1.0
    liveness_s: float = 3.5
    expect_back_s: float = 60.0
    max_queue_per_role: int = 1024
    max_attempts: int = 3
    retry_after_s: float = 1.0
    retry_backoff_s: float = 0.25
    retry_backoff_max_s: float = 4.0
    max_workers: int = 10_000
    prefix_keys_per_worker: int = 16_384
    prefix_load_slack: int = 4
    lora_load_slack: int = 4
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if "://" not in self.endpoint:
            raise ValueError(f"broker endpoint must look like tcp://host:port or ipc://path, got {self.endpoint!r}")
        if self.heartbeat_interval_s <= 0 or self.liveness_s <= self.heartbeat_interval_s:
            raise ValueError("liveness_s must exceed heartbeat_interval_s > 0")
        if not 0 <= self.expect_back_s < float("inf"):
            raise ValueError("expect_back_s must be finite and >= 0")
        if self.max_queue_per_role < 1 or self.max_attempts < 1:
            raise ValueError("max_queue_per_role and max_attempts must be >= 1")
        if not 0 <= self.retry_backoff_s <= self.retry_backoff_max_s < float("inf"):
            raise ValueError("need 0 <= retry_backoff_s <= retry_backoff_max_s, both finite")
        if self.prefix_keys_per_worker < 0 or self.prefix_load_slack < 0 or self.lora_load_slack < 0:
            raise ValueError("prefix_keys_per_worker, prefix_load_slack and lora_load_slack must be >= 0")
        check_policy(self.scheduling_policy)
