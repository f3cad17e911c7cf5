"""``omni-serve --autoscale ROLE=MIN:MAX``: an autoscaler inside omni-serve, for workers beyond the
fixed ``--num-ROLE`` fleet.

omni-serve starts its fixed fleet as usual; once the gateway is ready, :func:`start` runs an
:class:`~omnirelay.fleet.autoscaler.Autoscaler` per served model on a thread of its own, whose
local-process actuator starts extra workers with the same command line omni-serve gives that role
(:func:`omnirelay.deploy.serve.worker_commands`) and drains them when load falls. MIN and MAX bound
the *extra* workers (usually 0:N). :meth:`AutoscaleHandle.close` (omni-serve's shutdown) stops the
threads, each of which drains its extra workers, before omni-serve stops its own children.
"""

from __future__ import annotations

import argparse
import threading

from .actuators import LocalProcessActuator
from .autoscaler import Autoscaler, RolePolicy, parse_role_bounds
from .signals import GatewayProbe


class AutoscaleHandle:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.actuators: list[LocalProcessActuator] = []

    def close(self) -> None:
        """Stop the loops; each drains its workers on its own thread before it ends (see _serve)."""
        self.stop.set()
        for thread in self.threads:
            thread.join(90)


def _serve(scaler: Autoscaler, actuator: LocalProcessActuator, stop: threading.Event) -> None:
    """The autoscaler's thread. Its workers get PR_SET_PDEATHSIG, which Linux fires when the *thread*
    that started them ends: so this thread drains them (actuator.close) before it returns."""
    try:
        scaler.ensure_minimum()
        scaler.run(stop)
    finally:
        actuator.close()


def start(args: argparse.Namespace, plans: list, broker: str, url: str) -> AutoscaleHandle:
    from omnirelay.deploy.serve import _die_with_parent, worker_commands

    bounds = [parse_role_bounds(text) for text in args.autoscale]
    handle = AutoscaleHandle()
    commands = worker_commands(args, plans, broker)
    for number, plan in enumerate(plans):
        templates = {}
        for command in commands:
            role, model_index = command.name.split("-", 1)[0], int(command.name.split("-", 1)[1].split(".")[0])
            if model_index == number:
                templates.setdefault(role, command.argv)
        policies = {role: RolePolicy(min_workers=low, max_workers=high) for role, low, high in bounds
                    if role in templates}
        if not policies:
            continue
        # Like omni-serve's own children, an extra worker dies with omni-serve (PR_SET_PDEATHSIG).
        actuator = LocalProcessActuator(lambda role, index, t=templates: list(t[role]), preexec_fn=_die_with_parent)
        scaler = Autoscaler(plan.name, policies, actuator, GatewayProbe(url, args.api_key))
        thread = threading.Thread(target=_serve, args=(scaler, actuator, handle.stop), name=f"autoscale-{number}")
        thread.start()
        handle.threads.append(thread)
        handle.actuators.append(actuator)
    return handle
