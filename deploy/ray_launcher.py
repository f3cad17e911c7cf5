"""``omni-serve MODEL --ray-address ADDR``: the same daemons as ``omni-serve``, placed on a Ray cluster.

Ray places and supervises; the bus stays ZeroMQ. Each daemon (broker, gateway, every worker) is a
child process of one Ray actor, :class:`DaemonActor`:

* the broker and the gateway run on the head node (pinned with a node-affinity strategy);
* each worker asks for ``num_gpus`` = its GPU group size (tensor × pipeline parallel size) when the
  cluster has GPUs, 0 on a CPU cluster, plus ``--ray-worker-cpus`` CPUs, and workers are spread
  over the nodes; Ray sets ``CUDA_VISIBLE_DEVICES`` for the group;
* an actor whose daemon exits on its own exits too, so Ray restarts it (at most
  :data:`MAX_RESTARTS` times) and the restarted actor starts the daemon again; a worker re-registers
  with the broker and the broker is stateless for the rest, exactly as under ``omni-serve``.

Before any actor starts, :func:`plan_placement` checks the cluster's resources: every worker group
must fit on one node, and all of them together on the cluster; if not, start-up fails with a message
naming the worker and what it needs.

The broker binds the head node's address. Off loopback the bus needs CURVE: ``--curve-keys DIR``
(an ``omni-keygen DIR broker gateway worker`` directory, read by the driver) is shipped to each
actor, which writes the files it needs into a private 0700 directory. Model directories and the
stage-pipeline file must exist at the same path on every node (a missing one fails that actor's
start with a message naming the node).

Shutdown (SIGINT/SIGTERM to ``omni-serve``): gateway, workers (SIGTERM: they drain), broker, then
the actors are killed. Actors are owned by the driver, so Ray also removes them if ``omni-serve``
dies; each daemon gets SIGKILL from the kernel if its actor process dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from omnirelay.tracing import tracing_argv

MAX_RESTARTS = 5
HEAD_RESOURCE = "node:__internal_head__"


class RayLaunchError(RuntimeError):
    """``omni-serve --ray-address`` cannot start; the message says why."""


class ClusterResourcesError(RayLaunchError):
    """The Ray cluster cannot hold the requested daemons; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class DaemonSpec:
    """One daemon to place. ``argv`` follows ``python -m``; in it ``{dir}`` becomes the actor's
    private directory and ``{node_ip}`` the address of the node it landed on. ``files`` (relative
    path → bytes) are written under ``{dir}`` with mode 0600 before the daemon starts."""

    name: str
    argv: tuple[str, ...]
    on_head: bool = False
    num_gpus: int = 0
    num_cpus: float = 0.0
    files: tuple[tuple[str, bytes], ...] = ()
    required_paths: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    is_head: bool

    @classmethod
    def from_ray(cls, entry: dict) -> "NodeInfo":
        resources = entry.get("Resources", {})
        return cls(node_id=entry["NodeID"], ip=entry["NodeManagerAddress"], cpus=resources.get("CPU", 0.0),
                   gpus=resources.get("GPU", 0.0), is_head=HEAD_RESOURCE in resources)


def plan_placement(nodes: list[NodeInfo], specs: list[DaemonSpec]) -> dict[str, str]:
    """Check that ``specs`` fit on ``nodes`` (first fit, largest groups first) and return a
    feasible assignment name → node id. Raises :class:`ClusterResourcesError` otherwise. Ray makes
    the real placement; this only refuses a cluster on which it could not succeed."""
    if not nodes:
        raise ClusterResourcesError("the Ray cluster has no live node")
    heads = [n for n in nodes if n.is_head]
    if not heads:
        raise ClusterResourcesError("the Ray cluster reports no head node")
    total_cpus, total_gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
    need_cpus, need_gpus = sum(s.num_cpus for s in specs), sum(s.num_gpus for s in specs)
    if need_gpus > total_gpus:
        raise ClusterResourcesError(f"the workers need {need_gpus} GPUs in all, the cluster has {total_gpus:g}")
    if need_cpus > total_cpus:
        raise ClusterResourcesError(f"the daemons need {need_cpus:g} CPUs in all, the cluster has {total_cpus:g}")
    free = {n.node_id: [n.cpus, n.gpus] for n in nodes}
    largest_gpus = max(n.gpus for n in nodes)
    assignment: dict[str, str] = {}
    for spec in sorted(specs, key=lambda s: (not s.on_head, -s.num_gpus, -s.num_cpus)):
        if spec.num_gpus > largest_gpus:
            raise ClusterResourcesError(
                f"{spec.name} needs {spec.num_gpus} GPUs on one node (its GPU group: tensor × pipeline "
                f"parallel size) but the largest node has {largest_gpus:g}")
        candidates = heads if spec.on_head else nodes
        for node in candidates:
            cpus, gpus = free[node.node_id]
            if cpus >= spec.num_cpus and gpus >= spec.num_gpus:
                free[node.node_id] = [cpus - spec.num_cpus, gpus - spec.num_gpus]
                assignment[spec.name] = node.node_id
                break
        else:
            where = "the head node" if spec.on_head else "any node"
            raise ClusterResourcesError(
                f"{spec.name} ({spec.num_cpus:g} CPU, {spec.num_gpus} GPU) does not fit on {where} next to "
                f"the daemons placed before it (free per node: "
                + ", ".join(f"{n.ip}: {free[n.node_id][0]:g} CPU/{free[n.node_id][1]:g} GPU" for n in candidates)
                + ")")
    return assignment


# ------------------------------------------------------------------------------------ the actor


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


class DaemonActor:
    """Runs one daemon as its child process (wrapped with ``ray.remote`` by the launcher)."""

    def __init__(self, spec: DaemonSpec):
        import ray
        self.name = spec.name
        self.node_id = ray.get_runtime_context().get_node_id()
        # The address the node registered with (get_node_ip_address() may give another interface's).
        self.node_ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == self.node_id),
                            ray.util.get_node_ip_address())
        for path in spec.required_paths:
            if not os.path.exists(path):
                raise FileNotFoundError(f"{spec.name} on node {self.node_ip}: {path} does not exist there "
                                        "(model directories and pipeline files must exist on every node)")
        self.dir = tempfile.mkdtemp(prefix=f"omnirelay-{spec.name}-")
        for relative, data in spec.files:
            path = os.path.join(self.dir, relative)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
                handle.write(data)
        argv = [arg.replace("{dir}", self.dir).replace("{node_ip}", self.node_ip) for arg in spec.argv]
        self.stopping = False
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], preexec_fn=_die_with_parent,
                                     stdin=subprocess.DEVNULL)
        # The daemon exiting on its own ends this actor, so that Ray restarts it.
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{spec.name}", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self.stopping:
            print(f"omnirelay: {self.name} exited with code {code} on {self.node_ip}; its actor exits for Ray "
                  "to restart it", file=sys.stderr, flush=True)
            shutil.rmtree(self.dir, ignore_errors=True)
            os._exit(1)

    def info(self) -> dict:
        return {"name": self.name, "node_ip": self.node_ip, "node_id": self.node_id, "pid": self.proc.pid,
                "actor_pid": os.getpid(),
                "alive": self.proc.poll() is None}

    def read_file(self, relative: str) -> str | None:
        try:
            with open(os.path.join(self.dir, relative)) as handle:
                return handle.read().strip() or None
        except FileNotFoundError:
            return None

    def health(self, url: str) -> tuple[int, str]:
        """GET ``url``/health from this node (the gateway may listen on the head's loopback only)."""
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                return response.status, response.read().decode()[:500]
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")[:500]
        except (urllib.error.URLError, OSError) as exc:
            return 0, str(exc)

    def stop(self, grace_s: float) -> int:
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._watcher.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


def _free_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------ the launcher


class RayLauncher:
    """Connects to the cluster, checks it, starts the actors, waits for health, supervises, stops."""

    def __init__(self, address: str):
        import ray
        self.ray = ray
        ray.init(address=address, namespace=f"omnirelay-{os.getpid()}", logging_level="WARNING",
                 configure_logging=True, log_to_driver=True)
        self.nodes = [NodeInfo.from_ray(n) for n in ray.nodes() if n.get("Alive")]
        self.actors: dict[str, object] = {}
        self._remote_actor = ray.remote(DaemonActor)

    @property
    def head(self) -> NodeInfo:
        heads = [n for n in self.nodes if n.is_head]
        if not heads:
            raise ClusterResourcesError("the Ray cluster reports no head node")
        return heads[0]

    @property
    def has_gpus(self) -> bool:
        return any(n.gpus > 0 for n in self.nodes)

    def broker_endpoint(self) -> str:
        """``tcp://HEAD:PORT`` with a port free on the head, chosen once (a restarted broker binds it again)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        pick = self.ray.remote(_free_port).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(self.head.node_id, soft=False))
        port = self.ray.get(pick.remote(self.head.ip), timeout=60)
        return f"tcp://{self.head.ip}:{port}"

    def start(self, specs: list[DaemonSpec]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        plan_placement(self.nodes, specs)
        for spec in specs:
            strategy = (NodeAffinitySchedulingStrategy(self.head.node_id, soft=False) if spec.on_head
                        else "SPREAD")
            self.actors[spec.name] = self._remote_actor.options(
                num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_restarts=MAX_RESTARTS, max_task_retries=0,
                scheduling_strategy=strategy).remote(spec)

    def placement(self) -> dict[str, dict]:
        return {name: self.ray.get(actor.info.remote(), timeout=60) for name, actor in self.actors.items()}

    def wait_ready(self, timeout_s: float, shutdown) -> str | None:
        """The gateway's URL once its /health answers 200; None (after printing why) otherwise."""
        deadline = time.monotonic() + timeout_s
        gateway = self.actors["gateway"]
        url, last = None, "the gateway to listen"
        while time.monotonic() < deadline and not shutdown.requested:
            dead = self._dead_actor()
            if dead:
                print(f"omni-serve: {dead[0]} failed during start-up: {dead[1]}", file=sys.stderr, flush=True)
                return None
            url = url or self.ray.get(gateway.read_file.remote("gateway.url"), timeout=60)
            if url:
                status, body = self.ray.get(gateway.health.remote(url), timeout=60)
                if status == 200:
                    return url
                last = body
            shutdown.event.wait(0.5)
        if not shutdown.requested:
            print(f"omni-serve: not ready after {timeout_s:.0f}s (--stage-init-timeout): {last}",
                  file=sys.stderr, flush=True)
        return None

    def _dead_actor(self) -> tuple[str, str] | None:
        for name, actor in self.actors.items():
            try:
                self.ray.get(actor.info.remote(), timeout=60)
            except self.ray.exceptions.ActorUnavailableError:   # restarting: Ray is on it
                continue
            except self.ray.exceptions.RayActorError as exc:
                return name, str(exc).strip().splitlines()[-1][:1000]
            except self.ray.exceptions.GetTimeoutError:
                continue
        return None

    def supervise(self, shutdown) -> int:
        """Ray restarts the actors; this only notices one that is gone for good."""
        while not shutdown.requested:
            dead = self._dead_actor()
            if dead:
                print(f"omni-serve: {dead[0]} is dead after {MAX_RESTARTS} restarts: {dead[1]}; stopping",
                      file=sys.stderr, flush=True)
                return 1
            shutdown.event.wait(2.0)
        return 0

    def stop(self, drain_s: float) -> None:
        names = list(self.actors)
        for group in ([n for n in names if n == "gateway"], [n for n in names if n not in ("gateway", "broker")],
                      [n for n in names if n == "broker"]):
            pending = [self.actors[n].stop.remote(drain_s + 5.0) for n in group]
            try:
                self.ray.get(pending, timeout=drain_s + 15.0)
            except self.ray.exceptions.RayError:   # an actor already dead or stuck: the kill below does
                pass
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.ray.shutdown()


# ------------------------------------------------------------------------------------ omni-serve --ray-address


def _curve_files(keys_dir: str, secret: str, server: bool, client: bool) -> tuple[tuple[str, bytes], ...]:
    """The key files one daemon needs, read from an omni-keygen directory (paths under ``keys/``)."""
    def read(name: str) -> bytes:
        path = os.path.join(keys_dir, name)
        if not os.path.isfile(path):
            raise RayLaunchError(f"--curve-keys {keys_dir}: {name} is missing "
                                        f"(omni-keygen {keys_dir} broker gateway worker)")
        with open(path, "rb") as handle:
            return handle.read()
    files = [(f"keys/{secret}.key_secret", read(f"{secret}.key_secret"))]
    if client:
        files.append(("keys/broker.key", read("broker.key")))
    if server:
        authorized = os.path.join(keys_dir, "authorized")
        names = sorted(n for n in os.listdir(authorized) if n.endswith(".key")) if os.path.isdir(authorized) else []
        if not names:
            raise RayLaunchError(f"--curve-keys {keys_dir}: authorized/ holds no public key")
        files += [(f"keys/authorized/{n}", read(f"authorized/{n}")) for n in names]
    return tuple(files)


def _curve_argv(server: bool, client: bool, secret: str) -> list[str]:
    argv = ["--curve-secret-key", f"{{dir}}/keys/{secret}.key_secret"]
    if client:
        argv += ["--curve-server-key", "{dir}/keys/broker.key"]
    if server:
        argv += ["--curve-authorized-keys", "{dir}/keys/authorized"]
    return argv


def build_specs(args, plans, broker: str, has_gpus: bool) -> list[DaemonSpec]:
    """The daemons of one ``omni-serve --ray-address`` run: broker, workers, gateway."""
    from omnirelay.security import is_loopback
    from omnirelay.deploy.serve import gateway_command, worker_commands
    curve = not is_loopback(broker)
    if curve and not args.curve_keys:
        raise RayLaunchError(
            f"the Ray head is at {broker}, off loopback: the bus needs CURVE keys, give --curve-keys DIR "
            "(made by omni-keygen DIR broker gateway worker)")
    log_args = ["--log-level", args.log_level, "--log-format", args.log_format, *tracing_argv(args)]
    paths = tuple(plan.path for plan in plans) + tuple(plan.pipeline_file for plan in plans if plan.pipeline_file)

    def keyed(secret: str, server: bool, client: bool) -> tuple[list[str], tuple]:
        if not curve:
            return [], ()
        return _curve_argv(server, client, secret), _curve_files(args.curve_keys, secret, server, client)

    argv, files = keyed("broker", server=True, client=False)
    specs = [DaemonSpec("broker", ("omnirelay.broker.daemon", "--endpoint", broker, *argv, *log_args,
                                   "--scheduling-policy", getattr(args, "scheduling_policy", "fcfs")),
                        on_head=True, files=files)]
    argv, files = keyed("worker", server=False, client=True)
    for command in worker_commands(args, plans, broker):
        specs.append(DaemonSpec(command.name, (*command.argv, *argv, *log_args),
                                num_gpus=command.group_size if has_gpus else 0,
                                num_cpus=args.ray_worker_cpus, files=files, required_paths=paths))
    argv, files = keyed("gateway", server=True, client=True)
    gateway = gateway_command(args, plans, broker, "{dir}/gateway.url", reply_host="{node_ip}")
    specs.append(DaemonSpec("gateway", (*gateway, *argv, *log_args), on_head=True, files=files,
                            required_paths=paths))
    return specs


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an address where nothing listens (ray.init would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return   # "auto" and friends: let Ray resolve them
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc})") from None


def serve_on_ray(args, plans) -> int:
    """``omni-serve --ray-address``: check, place, wait for health, supervise, stop. Exit code."""
    from omnirelay.lifecycle import Shutdown
    try:
        import ray  # noqa: F401
    except ImportError:
        print("omni-serve: --ray-address needs Ray: pip install 'omnirelay[ray]'", file=sys.stderr, flush=True)
        return 2
    try:
        _probe(args.ray_address)
        launcher = RayLauncher(args.ray_address)
    except ConnectionError as exc:
        print(f"omni-serve: cannot reach the Ray cluster at {args.ray_address}: {exc}", file=sys.stderr, flush=True)
        return 1
    shutdown = Shutdown().install()   # after ray.init, whose own SIGTERM handler would end the driver at once
    code = 1
    try:
        specs = build_specs(args, plans, launcher.broker_endpoint(),
                            launcher.has_gpus)
        launcher.start(specs)
        url = launcher.wait_ready(args.stage_init_timeout, shutdown)
        if url is None:
            code = 0 if shutdown.requested else 1
        else:
            placement = {name: {"node_ip": info["node_ip"], "node_id": info.get("node_id", ""), "pid": info["pid"]}
                         for name, info in launcher.placement().items()}
            print(f"omni-serve placement: {json.dumps(placement, sort_keys=True)}", flush=True)
            served = ", ".join(f"{plan.name!r} ({plan.path})" for plan in plans)
            print(f"omni-serve ready: {url} (models {served}; on Ray at {args.ray_address})", flush=True)
            code = launcher.supervise(shutdown)
    except RayLaunchError as exc:
        print(f"omni-serve: {exc}", file=sys.stderr, flush=True)
    finally:
        launcher.stop(args.drain_timeout)
    return code
