"""``omni-serve --ray-address``: the daemons placed as Ray actors on a real two-node Ray cluster.

The cluster runs on loopback only: the head on 127.0.0.1 (started with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which makes Ray bind 127.0.0.1), a second CPU node on
127.0.0.2. Ray refuses to join a node in that mode, so the second node alone runs with the variable
at 1; it then rewrites "127.0.0.1" to the machine's public address, so it is given the head as the
IPv4-mapped ``[::ffff:127.0.0.1]`` and its own address as 127.0.0.2, both loopback. Every Ray port is
chosen free, the temp dir is private, and both ``ray start --block`` processes are stopped by the PIDs
this module started (then any descendant still alive is killed by PID) — never ``ray stop``, which
would stop other people's clusters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import requests

from conftest import ServeProcess, child_pids, pid_alive

from omnirelay.deploy.ray_launcher import ClusterResourcesError, DaemonSpec, NodeInfo, plan_placement

RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_env(cluster_mode: bool) -> dict:
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if cluster_mode else "0",
            "RAY_USAGE_STATS_ENABLED": "0"}


class RayCluster:
    """A head on 127.0.0.1 and a node on 127.0.0.2, each a ``ray start --block`` process we own."""

    def __init__(self) -> None:
        # Short path: Ray's unix sockets live under it (108-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []

    def _start(self, name: str, args: list[str], env: dict) -> None:
        log = os.path.join(self.temp_dir, f"{name}.log")
        self.logs.append(log)
        with open(log, "w") as handle:
            self.procs.append(subprocess.Popen([RAY_BIN, "start", *args, "--block", "--disable-usage-stats",
                                                "--num-gpus", "0", "--object-store-memory", str(80 * 2**20),
                                                "--dashboard-agent-listen-port", str(_free_port())],
                                               stdout=handle, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True, stdin=subprocess.DEVNULL))

    def start(self, timeout: float = 120.0) -> None:
        self._start("head", ["--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
                             "--num-cpus", "2", "--include-dashboard", "false",
                             "--dashboard-port", str(_free_port()), "--temp-dir", self.temp_dir],
                    _ray_env(cluster_mode=False))
        self._wait_nodes(1, timeout)
        self._start("node2", ["--address", f"[::ffff:127.0.0.1]:{self.port}", "--node-ip-address", "127.0.0.2",
                              "--num-cpus", "2"], _ray_env(cluster_mode=True))
        self._wait_nodes(2, timeout)

    def _wait_nodes(self, count: int, timeout: float) -> None:
        probe = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
                 "print('NODES', sum(1 for n in ray.nodes() if n['Alive'])); ray.shutdown()" % self.address)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                                    env=_ray_env(cluster_mode=False))
            if f"NODES {count}" in result.stdout:
                return
            time.sleep(1)
        raise RuntimeError(f"Ray cluster did not reach {count} node(s):\n" + self.output())

    def output(self) -> str:
        text = []
        for log in self.logs:
            with open(log) as handle:
                text.append(handle.read()[-3000:])
        return "\n".join(text)

    def stop(self) -> None:
        """SIGTERM the ``ray start --block`` processes (they stop their raylets, GCS and workers),
        then SIGKILL by PID whatever of their descendants is left."""
        descendants = set()
        for proc in self.procs:
            descendants |= child_pids(proc.pid)
        for proc in self.procs[::-1]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pid in descendants:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'omnirelay[ray]' (the ray extra)")
    cluster = RayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _placement(serve: ServeProcess) -> dict:
    match = re.search(r"omni-serve placement: (\{.*\})", serve.output())
    assert match, serve.output()[-3000:]
    return json.loads(match.group(1))


def _complete(url: str) -> dict:
    response = requests.post(url + "/v1/completions", json={"model": "tiny-llm", "prompt": "Hello", "max_tokens": 4,
                                                           "temperature": 0, "ignore_eos": True},
                             timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_omni_serve_places_daemons_as_ray_actors(ray_cluster, tiny_model, tmp_path):
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--ray-address", ray_cluster.address,
                         "--num-decode", "2", "--stage-init-timeout", "150", "--drain-timeout", "2",
                         log_path=str(tmp_path / "serve.log"), timeout=180, env=_ray_env(cluster_mode=False))
    daemon_pids: set[int] = set()
    try:
        placement = _placement(serve)
        daemon_pids |= {entry["pid"] for entry in placement.values()}
        assert set(placement) == {"broker", "gateway", "prefill-0.0", "decode-0.0", "decode-0.1"}
        # Broker and gateway on the head; workers spread over both nodes.
        assert placement["broker"]["node_ip"] == placement["gateway"]["node_ip"] == "127.0.0.1"
        workers = {name: entry for name, entry in placement.items() if name not in ("broker", "gateway")}
        assert {entry["node_ip"] for entry in workers.values()} == {"127.0.0.1", "127.0.0.2"}
        assert _complete(serve.url)["usage"]["completion_tokens"] == 4

        # Ray supervises: a worker daemon killed on the second node comes back (its actor restarts).
        victim_name, victim = next((n, e) for n, e in sorted(workers.items()) if e["node_ip"] == "127.0.0.2")
        role = victim_name.split("-")[0]
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        replaced = False
        while time.monotonic() < deadline and not replaced:
            time.sleep(1)
            cluster = requests.get(serve.url + "/cluster", timeout=10).json()
            pids = {w.get("pid") for w in cluster["workers"] if w.get("role") == role}
            ids = [w["worker_id"] for w in cluster["workers"] if w.get("role") == role]
            replaced = (len(ids) == sum(1 for n in workers if n.startswith(role))
                        and not any(str(victim["pid"]) in worker_id for worker_id in ids))
            daemon_pids |= {pid for pid in pids if isinstance(pid, int)}
        assert replaced, f"{victim_name} was not restarted by Ray:\n{serve.output()[-3000:]}"
        _complete(serve.url)
        for worker_id in ids:   # the restarted daemon's pid, to check it is gone at the end
            match = re.search(r"-(\d+)-[0-9a-f]+$", worker_id)
            if match:
                daemon_pids.add(int(match.group(1)))
    finally:
        code = serve.stop(timeout=90)
    assert code == 0, serve.output()[-3000:]
    time.sleep(1)
    assert not [pid for pid in daemon_pids if pid_alive(pid)], "daemons outlived omni-serve"


def test_omni_serve_refuses_a_cluster_too_small(ray_cluster, tiny_model):
    result = subprocess.run(
        [sys.executable, "-m", "omnirelay.deploy.serve", tiny_model, "--ray-address", ray_cluster.address,
         "--port", "0", "--ray-worker-cpus", "3"],
        capture_output=True, text=True, timeout=120, env=_ray_env(cluster_mode=False))
    assert result.returncode == 1, result.stdout + result.stderr
    # Checked before any actor starts: two workers × 3 CPUs, on two nodes of 2 CPUs each.
    assert "the daemons need 6 CPUs in all, the cluster has 4" in result.stderr, result.stderr[-2000:]


# ------------------------------------------------------------------ the resource check alone (no cluster)

HEAD = NodeInfo("h", "10.0.0.1", cpus=8, gpus=2, is_head=True)
NODE = NodeInfo("n", "10.0.0.2", cpus=8, gpus=4, is_head=False)


def _worker(name: str, gpus: int, cpus: float = 1) -> DaemonSpec:
    return DaemonSpec(name, ("omnirelay.workers.daemon",), num_gpus=gpus, num_cpus=cpus)


def test_placement_fits_groups_on_nodes():
    specs = [DaemonSpec("broker", (), on_head=True), DaemonSpec("gateway", (), on_head=True),
             _worker("prefill-0.0", 4), _worker("decode-0.0", 2)]
    assignment = plan_placement([HEAD, NODE], specs)
    assert assignment["broker"] == assignment["gateway"] == "h"
    assert assignment["prefill-0.0"] == "n" and assignment["decode-0.0"] == "h"


@pytest.mark.parametrize("specs, message", [
    ([_worker("decode-0.0", 8)], "the workers need 8 GPUs in all, the cluster has 6"),
    ([_worker("prefill-0.0", 3), _worker("decode-0.0", 3)], "decode-0.0 (1 CPU, 3 GPU) does not fit on any node"),
    ([_worker("decode-0.0", 0, cpus=20)], "need 20 CPUs in all"),
])
def test_placement_refusals_name_the_worker(specs, message):
    with pytest.raises(ClusterResourcesError, match=re.escape(message)):
        plan_placement([HEAD, NODE], specs)


def test_placement_needs_a_head():
    with pytest.raises(ClusterResourcesError, match="no head node"):
        plan_placement([NODE], [DaemonSpec("broker", (), on_head=True)])


def _serve_args(**overrides):
    """omni-serve's own parser, so a flag added there reaches the launcher in this test too."""
    from omnirelay.deploy.serve import build_parser
    args = build_parser().parse_args(["/srv/m", "--num-decode", "2", "--host", "0.0.0.0", "--kv-cache-bytes",
                                      str(1 << 20), "--ray-address", "10.0.0.1:6379", "--log-level", "INFO",
                                      "--allowed-local-media-path", "/srv/media", "--read-timeout", "7.5"])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_off_loopback_head_needs_curve_keys_and_ships_them(tmp_path):
    from omnirelay.deploy.ray_launcher import RayLaunchError, build_specs
    from omnirelay.security import keygen_main
    from omnirelay.pipeline import default_llm_pipeline
    from omnirelay.deploy.served_models import ModelPlan
    plans = [ModelPlan(path="/srv/m", name="m", kind="llm", pipeline=default_llm_pipeline(), pipeline_file=None,
                       groups={"prefill": (1, 1), "decode": (2, 1)})]
    with pytest.raises(RayLaunchError, match="off loopback: the bus needs CURVE keys, give --curve-keys DIR"):
        build_specs(_serve_args(), plans, "tcp://10.0.0.1:5555", has_gpus=True)
    keys = tmp_path / "keys"
    assert keygen_main([str(keys), "broker", "gateway", "worker"]) == 0
    specs = {s.name: s for s in build_specs(_serve_args(curve_keys=str(keys)), plans,
                                            "tcp://10.0.0.1:5555", has_gpus=True)}
    assert set(specs) == {"broker", "prefill-0.0", "decode-0.0", "decode-0.1", "gateway"}
    assert specs["broker"].on_head and specs["gateway"].on_head and not specs["decode-0.1"].on_head
    assert specs["decode-0.0"].num_gpus == 2 and specs["prefill-0.0"].num_gpus == 1   # GPU group sizes
    broker_files = dict(specs["broker"].files)
    assert set(broker_files) == {"keys/broker.key_secret", "keys/authorized/broker.key",
                                 "keys/authorized/gateway.key", "keys/authorized/worker.key"}
    worker_files = dict(specs["decode-0.0"].files)
    assert set(worker_files) == {"keys/worker.key_secret", "keys/broker.key"}   # never the broker's secret
    assert "{dir}/keys/worker.key_secret" in specs["decode-0.0"].argv
    gateway_argv = specs["gateway"].argv
    assert gateway_argv[gateway_argv.index("--reply-host") + 1] == "{node_ip}"
    # The gateway's media directory and limits reach it on the Ray node as they do on one host.
    assert gateway_argv[gateway_argv.index("--allowed-local-media-path") + 1] == "/srv/media"
    assert gateway_argv[gateway_argv.index("--read-timeout") + 1] == "7.5"
    # Ray hands each actor its GPUs (CUDA_VISIBLE_DEVICES): the worker's default placement, no --devices.
    on_ray = {s.name: s for s in build_specs(_serve_args(curve_keys=str(keys), devices="0,1"), plans,
                                             "tcp://10.0.0.1:5555", has_gpus=True)}
    assert "--devices" not in on_ray["decode-0.0"].argv and "--gpu-memory-utilization" in on_ray["decode-0.0"].argv
    # On a CPU cluster the workers ask for no GPU.
    cpu = build_specs(_serve_args(curve_keys=str(keys)), plans, "tcp://10.0.0.1:5555",
                      has_gpus=False)
    assert all(s.num_gpus == 0 for s in cpu)
