"""Scheduling policies: the order in which waiting requests are served (vLLM's ``--scheduling-policy``).

``fcfs`` (the default): first come, first served; a request's ``priority`` must be 0 (the gateway
answers 400 otherwise, as vLLM does).

``priority``: a lower ``priority`` value goes first, first come first served among equal values.
So that nobody waits forever behind a steady stream of more urgent work, waiting ages a request:
its effective priority improves by 1 for every :data:`PRIORITY_AGING_S` seconds it has waited. Two
requests compare by ``priority + enqueued_at / PRIORITY_AGING_S`` (:func:`queue_key`), a number
fixed when the request joins the queue, so the order never has to be recomputed: a request of
priority ``p`` that joined at ``t`` is passed only by requests that joined before
``t + (p - p') * PRIORITY_AGING_S`` with a lower value ``p'`` — a bounded set, whatever arrives later.

The broker's per-(model, role) queues (broker/role_queue.py) and every engine's waiting queue
(workers/runtime/request_queue.py) order by this key; the priority travels in ``Submit.priority``
and ``Task.priority`` (0 when absent, and always 0 under ``fcfs``).
"""

from __future__ import annotations

POLICIES = ("fcfs", "priority")
# One priority step per this many seconds of waiting (see the module docstring).
PRIORITY_AGING_S = 1.0
# The bus carries it as a 64-bit integer.
PRIORITY_MIN, PRIORITY_MAX = -2**63, 2**63 - 1


def queue_key(priority: int, enqueued_at: float) -> float:
    """The order of a waiting request under ``priority``: lower first (ties: arrival order)."""
    return priority + enqueued_at / PRIORITY_AGING_S


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy
