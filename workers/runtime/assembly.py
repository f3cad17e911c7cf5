"""What a role builder returns, and the pieces every builder uses to open and close its parts.

A role builder (one per role and model kind, looked up in :mod:`omnirelay.workers.role_table`) takes
the worker's config and its ``on_fatal(reason)`` callback and returns a :class:`BuiltRole`: the role
adapter, the heartbeat-stats function and what the runtime must close when it stops. A builder that
fails half-way closes what it had opened (:func:`closed_on_error`), so a worker that cannot start
leaves no rank, thread or shared memory behind.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from omnirelay.connectors import create_connector
from omnirelay.connectors.timing import TimedConnector

from omnirelay.workers.runtime.config import WorkerConfig
from omnirelay.workers.runtime.roles import RoleAdapter


@dataclass(frozen=True)
class BuiltRole:
    adapter: RoleAdapter
    stats: Callable[[], dict]   # the counters and load figures of each heartbeat
    owned: tuple = ()   # what the runtime closes when it stops, in this order, after the engine


class RoleBuilder(Protocol):
    def __call__(self, config: WorkerConfig, on_fatal: Callable[[str], None] | None = None) -> BuiltRole:
        """``on_fatal(reason)``: called once, from any thread, when the worker can no longer serve
        (a sequence-parallel group lost a rank); a builder whose parts cannot fail so ignores it."""
        ...


def open_connector(config: WorkerConfig) -> TimedConnector:
    """The connector the worker's pipeline edge names, timed for the heartbeat's figures."""
    return TimedConnector(create_connector(config.connector, config.connector_options))


def connector_stats(connector: TimedConnector) -> dict:
    """The connector's numeric health figures, as ``connector_*`` heartbeat stats."""
    return {f"connector_{k}": v for k, v in connector.health().items() if isinstance(v, (int, float))
            and not isinstance(v, bool)}


@contextmanager
def closed_on_error(*resources) -> Iterator[None]:
    """Close ``resources`` (the ones not None, in order) if the block raises, then re-raise."""
    try:
        yield
    except BaseException:
        for resource in resources:
            if resource is not None:
                resource.close()
        raise
