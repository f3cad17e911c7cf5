"""LoRA adapter affinity: send a request to a worker that already holds its adapter.

Life of an adapter hint::

    gateway: a request for adapter X ──Submit.params (TextParams.lora = X)──▶ broker
        (read by :func:`request_adapter`, the one place the broker looks inside ``params``)
    worker with --enable-lora: Register.loras / every Heartbeat.loras: the adapters it holds (in
        its slots, or named by a request it holds) — the whole list each time, a few names; a worker
        without LoRA leaves both out
    broker: :class:`AdapterHolders`, per (model, role) pool adapter → workers holding it
        ──pick──▶ Task to the least-loaded holder with credit, unless it is busier than the
        least-loaded worker by more than ``slack`` assigned tasks ──▶ that worker counts as a
        holder of X at once (it loads X to run the task)

The rule, which keeps cold workers fed: a holder wins only while its assigned tasks are at most
``least + slack`` (``BrokerConfig.lora_load_slack``); beyond that the request goes to the
least-loaded worker, which loads the adapter and becomes a holder too, so a popular adapter
spreads over more workers as its load grows instead of queueing on one. Requests for the base,
and pools whose workers report no adapters, are routed as before. A prefix hit (the prefix names
are salted by the adapter, :mod:`~omnirelay.broker.prefix_index`) goes first: such a worker ran
this adapter recently anyway.

A heartbeat's list replaces the broker's copy, except for adapters of tasks the heartbeat had not
yet seen (dispatched after the worker made it: ``Heartbeat.received`` counts the Tasks it had
handled). Those stay until a heartbeat that counts their Task, so a heartbeat crossing a dispatch
on the wire does not forget the adapter just sent. Hints only: a stale copy costs an adapter
load, never a wrong answer (the worker loads any adapter the request names).
"""

from __future__ import annotations

from typing import Any

from omnirelay.request_params import adapter_of

MAX_ADAPTERS_PER_WORKER = 64   # names kept per worker: a report beyond it is truncated
MAX_ADAPTER_NAME = 256


def request_adapter(spec) -> str:
    """The LoRA adapter the request of ``spec`` (a Submit) runs under; "" for the base, a request
    that is not a text answer, or a name too long to index."""
    name = adapter_of(spec.params)
    return name if len(name) <= MAX_ADAPTER_NAME else ""


class AdapterHolders:
    """Per (model, role) pool, which workers hold which adapter; each worker's own view is its
    ``loras`` set (None: a worker that serves no LoRA, never reported any) and ``lora_pending``
    (adapter → the Task count at which it was sent). The broker calls :meth:`report` on Register
    and Heartbeat (when they carry ``loras``), :meth:`dispatched` for every Task of an adapter,
    :meth:`drop` when the worker leaves its pool, and :meth:`pick` to route."""

    def __init__(self, slack: int):
        self.slack = slack
        self._holders: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}   # pool → adapter → {worker_id: worker}
        self._lora_workers: dict[tuple[str, str], int] = {}   # pool → workers that report adapters

    def active(self, key: tuple[str, str]) -> bool:
        """Whether the pool has LoRA workers (otherwise routing ignores adapters)."""
        return key in self._lora_workers

    def report(self, worker, names: list[str], received: int) -> None:
        """``worker`` says it holds ``names``, having handled ``received`` Tasks and CancelTasks."""
        if worker.loras is None:
            key = (worker.model, worker.role)
            self._lora_workers[key] = self._lora_workers.get(key, 0) + 1
            worker.loras = set()
        pending = {n: sent for n, sent in worker.lora_pending.items() if sent > received}
        worker.lora_pending = pending
        held = {n for n in names[:MAX_ADAPTERS_PER_WORKER] if n and len(n) <= MAX_ADAPTER_NAME}
        self._set(worker, held | pending.keys())

    def dispatched(self, worker, name: str) -> None:
        """A Task for adapter ``name`` was just sent to ``worker`` (its ``sent`` counts it)."""
        if worker.loras is None:
            return
        worker.lora_pending[name] = worker.sent
        if name not in worker.loras:
            self._set(worker, worker.loras | {name})

    def drop(self, worker) -> None:
        """``worker`` left its pool (dropped, unregistered, or replaced by its own re-registration)."""
        if worker.loras is None:
            return
        self._set(worker, set())
        key = (worker.model, worker.role)
        self._lora_workers[key] -= 1
        if not self._lora_workers[key]:
            del self._lora_workers[key]
        worker.loras = None

    def pick(self, key: tuple[str, str], name: str, least):
        """The least-loaded holder of ``name`` in pool ``key`` with credit, if it has at most
        ``slack`` more assigned tasks than ``least`` (the pool's least-loaded worker); else None."""
        holders = self._holders.get(key, {}).get(name)
        if not holders:
            return None
        bound = len(least.tasks) + self.slack
        best = None
        for worker in holders.values():
            if worker.credits > 0 and len(worker.tasks) <= bound and (best is None or _load(worker) < _load(best)):
                best = worker
        return best

    def _set(self, worker, names: set[str]) -> None:
        old = worker.loras
        if names == old:
            return
        key = (worker.model, worker.role)
        pool = self._holders.setdefault(key, {})
        for name in old - names:
            holders = pool.get(name)
            if holders is not None:
                holders.pop(worker.worker_id, None)
                if not holders:
                    del pool[name]
        for name in names - old:
            pool.setdefault(name, {})[worker.worker_id] = worker
        if not pool:
            del self._holders[key]
        worker.loras = names


def _load(worker) -> tuple[int, int, int]:
    """The broker's least-loaded order (prefix_index._load)."""
    return len(worker.tasks), -worker.credits, worker.dispatched
