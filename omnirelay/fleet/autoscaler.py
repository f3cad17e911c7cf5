"""Per-role autoscaling: observe the broker's queues and the gateway's latency, add or drain workers.

Loop (``Autoscaler.run``, one thread owned by the caller; each pass is :meth:`Autoscaler.step`):
read ``/cluster`` (per role: live workers, capacity, assigned tasks, queue depth) and ``/metrics``
(TTFT and ITL p90 over the last interval) → :class:`RolePolicy` decides per role → the actuator
starts or drains one worker.

A role is **hot** when its queue holds more than ``up_queue_per_worker`` tasks per live worker, or
its utilisation (assigned / capacity) is at least ``up_utilisation``, or the latency it owns breaches
its SLO (TTFT p90 → prefill, ITL p90 → decode). It is **cold** when its queue is empty, its
utilisation is at most ``down_utilisation`` and its latency (if known) is within half the SLO.
Hysteresis: ``up_samples`` consecutive hot passes before adding one worker, ``down_samples``
consecutive cold passes before draining one; the gap between the two utilisation thresholds keeps a
load between them where nothing changes. Cool-downs: no change to a role within ``up_cooldown_s``
of the last add, nor ``down_cooldown_s`` of the last change of any kind. A role whose started
workers have not all registered yet (broker's live count < the actuator's) does not grow further:
the cool-down is not left to guess start-up time. Bounds per role: never below ``min`` nor above
``max`` workers the actuator owns (workers started by other means count for the load, not the bound).
Scale-down is always a drain (see :mod:`.actuators`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import threading
import time

from .actuators import Actuator, LocalProcessActuator, SystemdActuator
from .signals import ITL_METRIC, TTFT_METRIC, GatewayProbe, LatencyWindow, RoleLoad, role_loads

log = logging.getLogger("omnirelay.fleet")


@dataclasses.dataclass(frozen=True)
class RolePolicy:
    """Bounds, thresholds and timings of one role (see the module docstring)."""

    min_workers: int = 1
    max_workers: int = 4
    up_queue_per_worker: float = 1.0
    up_utilisation: float = 0.9
    down_utilisation: float = 0.35
    up_samples: int = 2
    down_samples: int = 4
    up_cooldown_s: float = 10.0
    down_cooldown_s: float = 20.0
    latency_slo_s: float | None = None     # prefill: TTFT p90; decode: ITL p90

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 0 <= min_workers <= max_workers, got {self.min_workers}..{self.max_workers}")
        if not 0 <= self.down_utilisation < self.up_utilisation:
            raise ValueError("down_utilisation must be below up_utilisation (the gap is the hysteresis)")
        if self.up_samples < 1 or self.down_samples < 1:
            raise ValueError("up_samples and down_samples must be >= 1")


@dataclasses.dataclass
class _RoleState:
    hot: int = 0
    cold: int = 0
    last_up: float = float("-inf")
    last_change: float = float("-inf")


@dataclasses.dataclass(frozen=True)
class Decision:
    role: str
    action: str          # "up", "down" or "hold"
    reason: str
    worker: str | None = None


class Autoscaler:
    """Decides per role from one observation at a time (:meth:`decide`, pure but for the hysteresis
    state) and acts through ``actuator`` (:meth:`step`)."""

    def __init__(self, model: str, policies: dict[str, RolePolicy], actuator: Actuator,
                 probe: GatewayProbe | None = None, interval_s: float = 2.0):
        self.model, self.policies, self.actuator, self.probe = model, policies, actuator, probe
        self.interval_s = interval_s
        self._state = {role: _RoleState() for role in policies}
        self._ttft = LatencyWindow(TTFT_METRIC, model)
        self._itl = LatencyWindow(ITL_METRIC, model)
        self.history: list[Decision] = []

    def ensure_minimum(self) -> None:
        """Start each role's ``min_workers`` (before the first step)."""
        for role, policy in self.policies.items():
            while self.actuator.active(role) < policy.min_workers:
                self.actuator.start(role)

    def decide(self, role: str, load: RoleLoad, latency_s: float | None, owned: int, now: float) -> Decision:
        policy, state = self.policies[role], self._state[role]
        slo = policy.latency_slo_s
        hot_why = []
        if load.queued > policy.up_queue_per_worker * max(1, load.workers):
            hot_why.append(f"queue {load.queued} > {policy.up_queue_per_worker:g}/worker")
        if load.capacity and load.utilisation >= policy.up_utilisation:
            hot_why.append(f"utilisation {load.utilisation:.2f} >= {policy.up_utilisation:g}")
        if slo is not None and latency_s is not None and latency_s > slo:
            hot_why.append(f"p90 {latency_s * 1e3:.0f} ms > SLO {slo * 1e3:.0f} ms")
        cold = (not hot_why and load.queued == 0 and load.utilisation <= policy.down_utilisation
                and (slo is None or latency_s is None or latency_s <= slo / 2))
        state.hot = state.hot + 1 if hot_why else 0
        state.cold = state.cold + 1 if cold else 0
        if owned < policy.min_workers:
            return Decision(role, "up", f"below min_workers {policy.min_workers}")
        if state.hot >= policy.up_samples:
            if owned >= policy.max_workers:
                return Decision(role, "hold", f"hot ({'; '.join(hot_why)}) but at max_workers {policy.max_workers}")
            if load.workers < owned:
                return Decision(role, "hold", f"hot, waiting for {owned - load.workers} started worker(s) to register")
            if now - state.last_up < policy.up_cooldown_s:
                return Decision(role, "hold", "hot, in the up cool-down")
            return Decision(role, "up", "; ".join(hot_why))
        if state.cold >= policy.down_samples:
            if owned <= policy.min_workers:
                return Decision(role, "hold", f"cold but at min_workers {policy.min_workers}")
            if now - state.last_change < policy.down_cooldown_s:
                return Decision(role, "hold", "cold, in the down cool-down")
            return Decision(role, "down", f"utilisation {load.utilisation:.2f} <= {policy.down_utilisation:g}, "
                                          f"queue empty for {state.cold} samples")
        return Decision(role, "hold", "; ".join(hot_why) or "within thresholds")

    def step(self, now: float | None = None) -> list[Decision]:
        """One pass: observe, decide per role, act. Errors reading the gateway skip the pass."""
        now = time.monotonic() if now is None else now
        self.actuator.poll()
        cluster, metrics = self.probe.cluster(), self.probe.metrics()
        loads = role_loads(cluster, self.model)
        latency = {"prefill": self._ttft.update(metrics, 0.9), "decode": self._itl.update(metrics, 0.9)}
        decisions = []
        for role in self.policies:
            load = loads.get(role, RoleLoad(role, 0, 0, 0, 0))
            decision = self.decide(role, load, latency.get(role), self.actuator.active(role), now)
            state = self._state[role]
            if decision.action == "up":
                decision = dataclasses.replace(decision, worker=self.actuator.start(role))
                state.last_up = state.last_change = now
                state.hot = 0
            elif decision.action == "down":
                worker = self.actuator.drain(role)
                decision = dataclasses.replace(decision, worker=worker)
                state.last_change = now
                state.cold = 0
            if decision.action != "hold":
                log.warning("autoscale %s %s: %s (%s)", role, decision.action, decision.worker, decision.reason)
                self.history.append(decision)
            decisions.append(decision)
        return decisions

    def run(self, stop: threading.Event) -> None:
        """Step every ``interval_s`` until ``stop`` is set; a failed pass is logged and retried."""
        while not stop.is_set():
            try:
                self.step()
            except (OSError, ValueError) as exc:   # the gateway restarting, a scrape timing out, a bad body
                log.warning("autoscaler pass skipped: %s", exc)
            stop.wait(self.interval_s)


def parse_role_bounds(text: str) -> tuple[str, int, int]:
    """``decode=1:4`` → ("decode", 1, 4)."""
    role, _, bounds = text.partition("=")
    low, _, high = bounds.partition(":")
    if not role or not low.isdigit() or not high.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROLE=MIN:MAX, e.g. decode=1:4")
    return role, int(low), int(high)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-autoscale", description="add and drain workers per role "
                                     "from the broker's queues and the gateway's latency histograms")
    parser.add_argument("--gateway", required=True, help="gateway base URL (reads /cluster and /metrics)")
    parser.add_argument("--api-key", default=None, help="bearer token, for a gateway with --protect-probes")
    parser.add_argument("--model", required=True, help="served model name the workers serve")
    parser.add_argument("--role", action="append", type=parse_role_bounds, required=True, metavar="ROLE=MIN:MAX",
                        help="a role to scale and its bounds (repeat per role)")
    parser.add_argument("--actuator", choices=["local", "systemd", "ray"], default="local")
    parser.add_argument("--ray-address", default=None, help="ray: the cluster's head (host:port)")
    parser.add_argument("--worker-args", default="",
                        help="local, ray: arguments of omnirelay.workers.daemon besides --role (shell-quoted), e.g. "
                             "'--model DIR --served-model-name NAME --broker tcp://…'")
    parser.add_argument("--systemctl", default="systemctl", help="systemd: the systemctl command (may be 'sudo systemctl')")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--up-utilisation", type=float, default=RolePolicy.up_utilisation)
    parser.add_argument("--down-utilisation", type=float, default=RolePolicy.down_utilisation)
    parser.add_argument("--up-cooldown", type=float, default=RolePolicy.up_cooldown_s)
    parser.add_argument("--down-cooldown", type=float, default=RolePolicy.down_cooldown_s)
    parser.add_argument("--ttft-slo", type=float, default=None, help="TTFT p90 SLO in seconds (scales prefill)")
    parser.add_argument("--itl-slo", type=float, default=None, help="ITL p90 SLO in seconds (scales decode)")
    parser.add_argument("--log-dir", default=None, help="local: worker logs go here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    slos = {"prefill": args.ttft_slo, "decode": args.itl_slo}
    policies = {role: RolePolicy(min_workers=low, max_workers=high, up_utilisation=args.up_utilisation,
                                 down_utilisation=args.down_utilisation, up_cooldown_s=args.up_cooldown,
                                 down_cooldown_s=args.down_cooldown, latency_slo_s=slos.get(role))
                for role, low, high in args.role}
    extra = shlex.split(args.worker_args)
    argv = lambda role, index: ["omnirelay.workers.daemon", "--role", role, *extra]  # noqa: E731
    if args.actuator == "systemd":
        actuator: Actuator = SystemdActuator(systemctl=shlex.split(args.systemctl))
    elif args.actuator == "ray":
        import ray
        ray.init(address=args.ray_address)
        from .actuators import RayActuator
        actuator = RayActuator(argv)
    else:
        actuator = LocalProcessActuator(argv, log_dir=args.log_dir)
    from omnirelay.lifecycle import Shutdown
    shutdown = Shutdown().install()
    scaler = Autoscaler(args.model, policies, actuator, GatewayProbe(args.gateway, args.api_key), args.interval)
    try:
        scaler.ensure_minimum()
        scaler.run(shutdown.event)
    finally:
        actuator.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
