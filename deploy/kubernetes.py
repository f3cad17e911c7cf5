"""``omni-serve [MODEL …] --emit kubernetes DIR``: the Kubernetes manifests of the deployment that
``omni-serve`` would start on one host, written to ``DIR`` for ``kubectl apply -f DIR``.

What is written (``docs/KUBERNETES.md`` walks through applying it; no cluster runs on the machines
this project is built on, so the tests validate every object against Kubernetes' published schemas
instead of applying them):

=====================  ========================================================================
``pipelines.yaml``     ConfigMap ``omnirelay-pipelines``: each model's stage YAML
``broker.yaml``        the broker pair (``broker/standby.py``): two Deployments, ``a`` and ``b``,
                       each naming the other with ``--standby-of``, each behind its own Service
                       (``publishNotReadyAddresses``: a standby binds nothing until it takes over,
                       and clients must reach it the moment it does); ``b`` waits in an init
                       container until ``a`` is bound, because two brokers started cold in the same
                       liveness period would both bind; one PodDisruptionBudget over the pair
``gateway.yaml``       the gateway Deployment behind Service ``omnirelay-gateway``, its PDB
``workers-NAME.yaml``  per model: one Deployment per role (``--num-ROLE`` replicas, each asking for
                       its GPU group), or, for roles joined by a ``shared_memory`` edge, one pod
                       holding all of them (see below); a PDB per Deployment
=====================  ========================================================================

Probes. Gateway: ready while ``/health`` answers 200 (every role of every model has a live worker),
live while its port accepts. Worker: ``omni-worker --health-port`` (``workers/runtime/health_server.py``):
``/ready`` while it serves, ``/live`` until its loop wedges; a startup probe covers model loading
(``--stage-init-timeout``). Brokers have no probe: a standby listens on nothing, and a crashed broker
exits, which the kubelet restarts.

Termination drains. SIGTERM makes a worker stop taking work and finish what it holds within
``--drain-timeout``, so its ``terminationGracePeriodSeconds`` is the drain plus :data:`CLOSE_MARGIN_S`
for unregistering and closing its connector. The gateway first sleeps in ``preStop`` while the
Service drops it, then aiohttp finishes open requests.

Connectors. A ``shared_memory`` edge needs both ends to see one tmpfs: its roles become containers
of one pod (replicas 1, ``Recreate``: two such pods would hand work across pods), sharing an
``emptyDir`` with ``medium: Memory`` at ``/dev/shm`` and one process namespace (segment names carry
the owner's PID, which must be unique among the writers). Redis, Mooncake and Yuanrong edges cross
pods: each role gets its own Deployment; a Mooncake worker is told its pod IP as ``local_hostname``.
A Yuanrong worker without an ``address`` option is told ``--yuanrong-address``, else its node's
datasystem worker at ``$(HOST_IP):``:data:`YUANRONG_PORT` (the datasystem runs as a DaemonSet on the
host network, as its own ``dscli generate_helm_chart`` deploys it; these manifests do not include it).

Keys. CURVE certificates come from Secrets made from an ``omni-keygen`` directory: ``omnirelay-curve``
(``broker.key_secret``, ``gateway.key_secret``, ``worker.key_secret``, ``broker.key``) and
``omnirelay-curve-authorized`` (the public keys); each pod mounts only its own files. The API key
comes from Secret ``omnirelay-api-key`` (key ``api-key``), never from the command line.

Models. Without MODEL arguments, the embedded tiny models are built in each pod by an init container
(``omni-make-model``, seed 0: every pod builds the same weights). With MODEL directories, the pods
mount PersistentVolumeClaim ``--k8s-models-claim`` at ``/models``, which must hold each directory
under its own name (``/srv/models/tiny-llm`` → ``/models/tiny-llm``), served under that name unless
``--served-model-name`` says otherwise.

Image. Every container runs what the top-level ``Dockerfile`` builds (:data:`CUDA_IMAGE`, or
:data:`CPU_IMAGE` on a CPU cluster, unless ``--k8s-image``): uid :data:`UID`, the commands on PATH, and
nothing written outside the volumes mounted here (``/cache``, ``/tmp``, ``/models``; the root file
system is read-only). ``tests/deploy/test_dockerfile.py`` checks the Dockerfile against these constants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from pathlib import Path

import yaml

from omnirelay import __version__
from omnirelay.deploy.served_models import BUNDLED, ModelPlan, bundled_pipeline, plan_models
from omnirelay.model_kind import ModelKind
from omnirelay.pipeline import PipelineError, default_llm_pipeline, load_pipeline
from omnirelay.tracing import tracing_argv

BROKER_PORT = 5555
HTTP_PORT = 8091
REPLY_PORT = 5556
HEALTH_PORT = 8081          # a worker container's /live and /ready; the n-th container of a pod: + n
CLOSE_MARGIN_S = 30         # after the drain: unregister, close the connector and the group's ranks
GATEWAY_PRESTOP_S = 5       # the Service's endpoints drop the pod before the gateway stops listening
GATEWAY_SHUTDOWN_S = 60     # aiohttp's wait for open requests on shutdown
UID = 10001                 # the pods' user and group; the image (top-level Dockerfile) runs as it too
MODELS_DIR = "/models"
PIPELINES_DIR = "/etc/omnirelay/pipelines"
KEYS_DIR = "/etc/omnirelay/keys"
AUTHORIZED_DIR = "/etc/omnirelay/authorized"
CACHE_DIR = "/cache"        # a writable emptyDir: the root file system is read-only
TMP_DIR = "/tmp"            # a writable emptyDir: tempfile's default (omni-serve's run directory, torch's caches)
# Where every cache goes (tokenizers, torch, triton, the embedded models): the Dockerfile sets the same.
CACHE_ENV = (("HOME", CACHE_DIR), ("XDG_CACHE_HOME", CACHE_DIR), ("HF_HOME", f"{CACHE_DIR}/huggingface"))
# The images the top-level Dockerfile builds (docs/KUBERNETES.md): `docker build -t omnirelay:VERSION .`
# (CPU) and `docker build --build-arg FLAVOR=cuda -t omnirelay:VERSION-cuda .` (CUDA).
IMAGE = "omnirelay"
CPU_IMAGE = f"{IMAGE}:{__version__}"
CUDA_IMAGE = f"{IMAGE}:{__version__}-cuda"
NETWORK_CONNECTORS = ("redis", "mooncake_transfer_engine", "mooncake_store", "yuanrong")
YUANRONG_PORT = 31501       # a node's datasystem worker (the datasystem's default worker port)
# The embedded default's models as `omni-make-model` names them, and their kinds (tests check the
# names against omnirelay.deploy.embedded.TINY_MODELS).
EMBEDDED = (("tiny-llm", ModelKind.LLM), ("tiny-omni", ModelKind.OMNI),
            ("tiny-sd", ModelKind.TEXT_TO_IMAGE), ("tiny-video", ModelKind.TEXT_TO_VIDEO))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Kubernetes manifests (--emit kubernetes DIR; docs/KUBERNETES.md)")
    group.add_argument("--emit", nargs=2, metavar=("FORMAT", "DIR"), default=None,
                       help="write the deployment's manifests instead of serving; FORMAT: kubernetes")
    group.add_argument("--k8s-image", default=None,
                       help=f"container image with omnirelay installed (default: {CUDA_IMAGE}, or {CPU_IMAGE} "
                            "with --k8s-gpu-resource '': what the top-level Dockerfile builds)")
    group.add_argument("--k8s-namespace", default=None, help="namespace of every object (default: kubectl's)")
    group.add_argument("--k8s-gateway-replicas", type=int, default=2)
    group.add_argument("--k8s-gpu-resource", default="nvidia.com/gpu",
                       help="extended resource a worker asks for per device of its group ('' on a CPU cluster)")
    group.add_argument("--k8s-models-claim", default="omnirelay-models",
                       help="PersistentVolumeClaim holding the MODEL directories (mounted at /models)")


def default_image(gpu_resource: str) -> str:
    """The image the manifests run without ``--k8s-image``: the Dockerfile's CUDA build where workers ask
    for GPUs, its CPU build on a CPU cluster (``--k8s-gpu-resource ''``)."""
    return CUDA_IMAGE if gpu_resource else CPU_IMAGE


class EmitError(ValueError):
    """Settings the manifests cannot express; the message names the flag."""


def emit(args: argparse.Namespace, check_parallel) -> list[str]:
    """Write the manifests for ``args`` (omni-serve's parsed flags) under ``args.emit[1]``; returns
    the files written. ``check_parallel`` is omni-serve's check of the parallel sizes per plan."""
    kind, out_dir = args.emit
    if kind != "kubernetes":
        raise EmitError(f"--emit {kind}: the only format is kubernetes")
    if args.api_key:
        raise EmitError("--api-key would be written into the manifests: put it in Secret omnirelay-api-key "
                        "(key api-key) instead, see docs/KUBERNETES.md")
    if args.protect_probes:
        raise EmitError("--protect-probes: the kubelet probes /health without a key; leave it out")
    if args.ray_address or args.broker or args.curve_keys or args.autoscale:
        raise EmitError("--ray-address, --broker, --curve-keys and --autoscale are for serving; the manifests "
                        "place the brokers themselves and take the keys from Secrets")
    if args.k8s_gateway_replicas < 1:
        raise EmitError("--k8s-gateway-replicas must be at least 1")
    plans = [dataclasses.replace(plan, groups=check_parallel(args, plan)) for plan in _plans(args)]
    check_plans_known(plans)
    objects = Manifests(args, plans).build()
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, docs in objects.items():
        path = os.path.join(out_dir, name)
        with open(path, "w") as handle:
            handle.write("# Generated by omni-serve --emit kubernetes; see docs/KUBERNETES.md\n")
            yaml.safe_dump_all(docs, handle, sort_keys=False)
        written.append(path)
    return written


def _plans(args: argparse.Namespace) -> list[ModelPlan]:
    """The served models as the pods see them: paths under /models."""
    if args.models:
        names = args.served_model_name or []
        basenames = [os.path.basename(os.path.normpath(path)) for path in args.models]
        # Unnamed models are served as their directory's name: the path here means nothing in a pod.
        models = [(path, names[i] if i < len(names) else basenames[i]) for i, path in enumerate(args.models)]
        plans = plan_models(models, args.stage_configs_path, args.connector)
        if len(set(basenames)) != len(basenames):
            raise EmitError(f"models {basenames}: two directories share a name, but each is mounted as "
                            "/models/<its name>")
        return [dataclasses.replace(plan, path=f"{MODELS_DIR}/{base}") for plan, base in zip(plans, basenames)]
    if args.served_model_name:
        raise EmitError("--served-model-name needs MODEL directories; the embedded default names its own")
    files = [os.path.abspath(f) for f in args.stage_configs_path or []]
    if len(files) not in (0, 1, len(EMBEDDED)):
        raise EmitError(f"{len(files)} --stage-configs-path for the {len(EMBEDDED)} embedded models")
    plans = []
    for i, (name, kind) in enumerate(EMBEDDED):
        chosen = files[i] if len(files) == len(EMBEDDED) else (files[0] if files else bundled_pipeline(kind))
        pipeline = load_pipeline(chosen) if chosen else default_llm_pipeline(args.connector)
        plans.append(ModelPlan(path=f"{MODELS_DIR}/{name}", name=name, kind=kind, pipeline=pipeline,
                               pipeline_file=chosen))
    return plans


def slug(text: str) -> str:
    """A DNS-1123 label piece from a served model name (``Qwen/Qwen3-Omni`` → ``qwen-qwen3-omni``)."""
    cleaned = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return cleaned[:40].strip("-") or "model"


def colocated_groups(plan: ModelPlan) -> list[tuple[str, ...]]:
    """The model's roles split into the pods they need: roles joined (directly or through others)
    by a ``shared_memory`` edge share one pod; every other role is a group of its own."""
    role_of = {stage.name: stage.role for stage in plan.pipeline.stages}
    parent = {role: role for role in plan.roles}

    def root(role: str) -> str:
        while parent[role] != role:
            role = parent[role]
        return role

    for edge in plan.pipeline.edges:
        if plan.pipeline.connectors[edge.connector].type == "shared_memory":
            parent[root(role_of[edge.source])] = root(role_of[edge.target])
    groups: dict[str, list[str]] = {}
    for role in plan.roles:
        groups.setdefault(root(role), []).append(role)
    return [tuple(group) for group in groups.values()]


class Manifests:
    """The objects of one deployment, by file name. Pure: reads ``args`` and the plans only."""

    def __init__(self, args: argparse.Namespace, plans: list[ModelPlan]):
        self.args = args
        self.plans = plans
        self.slugs = [slug(plan.name) for plan in plans]
        if len(set(self.slugs)) != len(self.slugs):
            raise EmitError(f"served model names {[p.name for p in plans]} give the same object name "
                            f"{self.slugs}; pick --served-model-name values that differ in letters or digits")
        self.brokers = ",".join(f"tcp://omnirelay-broker-{half}:{BROKER_PORT}" for half in "ab")
        self.embedded = not args.models
        self.image = args.k8s_image or default_image(args.k8s_gpu_resource)

    def build(self) -> dict[str, list[dict]]:
        files = {"pipelines.yaml": [self._pipelines()], "broker.yaml": self._brokers(),
                 "gateway.yaml": self._gateway()}
        for plan, name in zip(self.plans, self.slugs):
            files[f"workers-{name}.yaml"] = self._workers(plan, name)
        return files

    # ------------------------------------------------------------------ shared pieces

    def _meta(self, name: str, component: str, **labels: str) -> dict:
        meta = {"name": name, "labels": {"app.kubernetes.io/name": "omnirelay",
                                         "app.kubernetes.io/component": component, **labels}}
        if self.args.k8s_namespace:
            meta["namespace"] = self.args.k8s_namespace
        return meta

    def _pipeline_file(self, index: int) -> str:
        return f"{PIPELINES_DIR}/{self.slugs[index]}.yaml"

    def _pipelines(self) -> dict:
        data = {}
        for plan, name in zip(self.plans, self.slugs):
            # A causal LM without a file: its workers build the pipeline around --connector; the
            # gateway reads only the roles, which the bundled LM file names.
            source = plan.pipeline_file or str(BUNDLED / "llm.yaml")
            data[f"{name}.yaml"] = Path(source).read_text()
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": self._meta("omnirelay-pipelines", "config"), "data": data}

    def _keys_volume(self, *files: str) -> dict:
        return {"name": "curve", "secret": {"secretName": "omnirelay-curve", "defaultMode": 0o440,
                                            "items": [{"key": f, "path": f} for f in files]}}

    def _volumes(self, *key_files: str, authorized: bool = False) -> list[dict]:
        volumes = [self._keys_volume(*key_files),
                   {"name": "pipelines", "configMap": {"name": "omnirelay-pipelines"}},
                   {"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
        if authorized:
            volumes.append({"name": "authorized", "secret": {"secretName": "omnirelay-curve-authorized",
                                                             "defaultMode": 0o440}})
        if self.embedded:
            volumes.append({"name": "models", "emptyDir": {}})
        else:
            volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": self.args.k8s_models_claim,
                                                                        "readOnly": True}})
        return volumes

    def _mounts(self, authorized: bool = False) -> list[dict]:
        mounts = [{"name": "curve", "mountPath": KEYS_DIR, "readOnly": True},
                  {"name": "pipelines", "mountPath": PIPELINES_DIR, "readOnly": True},
                  {"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": TMP_DIR},
                  {"name": "models", "mountPath": MODELS_DIR, "readOnly": not self.embedded}]
        if authorized:
            mounts.append({"name": "authorized", "mountPath": AUTHORIZED_DIR, "readOnly": True})
        return mounts

    def _model_builders(self, model_indexes: list[int]) -> list[dict]:
        """Init containers that build the embedded models into the pod's /models (none for MODEL dirs)."""
        if not self.embedded:
            return []
        return [self._container(f"make-{self.slugs[i]}",
                                ["omni-make-model", self.plans[i].name, self.plans[i].path, "--seed", "0"],
                                mounts=[{"name": "models", "mountPath": MODELS_DIR},
                                        {"name": "tmp", "mountPath": TMP_DIR}])
                for i in model_indexes]

    def _container(self, name: str, command: list[str], mounts: list[dict], **extra) -> dict:
        env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
               {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
               {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
               # The root file system is read-only: every cache (tokenizers, torch, triton) goes to /cache.
               *({"name": key, "value": value} for key, value in CACHE_ENV),
               {"name": "HF_HUB_OFFLINE", "value": "1"}, *extra.pop("env", [])]
        return {"name": name, "image": self.image, "command": command, "env": env,
                "volumeMounts": mounts,
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}, **extra}

    def _pod_spec(self, containers: list[dict], volumes: list[dict], grace_s: int, **extra) -> dict:
        return {"securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID},
                "terminationGracePeriodSeconds": grace_s, "containers": containers, "volumes": volumes, **extra}

    def _deployment(self, name: str, component: str, labels: dict, replicas: int, pod: dict,
                    strategy: dict) -> dict:
        selector = {"app.kubernetes.io/name": "omnirelay", "app.kubernetes.io/instance": name}
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": self._meta(name, component, **labels),
                "spec": {"replicas": replicas, "selector": {"matchLabels": selector}, "strategy": strategy,
                         "template": {"metadata": {"labels": {**selector, "app.kubernetes.io/component": component,
                                                              **labels}},
                                      "spec": pod}}}

    def _pdb(self, name: str, component: str, match: dict, labels: dict | None = None) -> dict:
        # One pod of the set at a time: each drains (workers), fails over (brokers) or is dropped by
        # its Service first (gateways). Not-ready pods (still loading) may always be evicted.
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": self._meta(name, component, **(labels or {})),
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": match},
                         "unhealthyPodEvictionPolicy": "AlwaysAllow"}}

    def _startup_failures(self, period_s: int) -> int:
        return max(1, math.ceil(self.args.stage_init_timeout / period_s))

    # ------------------------------------------------------------------ brokers

    def _brokers(self) -> list[dict]:
        objects = []
        for half, other in (("a", "b"), ("b", "a")):
            name = f"omnirelay-broker-{half}"
            command = ["omni-broker", "--endpoint", f"tcp://0.0.0.0:{BROKER_PORT}",
                       "--scheduling-policy", getattr(self.args, "scheduling_policy", "fcfs"),
                       "--standby-of", f"tcp://omnirelay-broker-{other}:{BROKER_PORT}",
                       "--curve-secret-key", f"{KEYS_DIR}/broker.key_secret",
                       "--curve-authorized-keys", AUTHORIZED_DIR,
                       "--log-level", self.args.log_level, "--log-format", "json", *tracing_argv(self.args)]
            container = self._container("broker", command, self._mounts(authorized=True),
                                        ports=[{"name": "bus", "containerPort": BROKER_PORT}])
            container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "models"]
            volumes = [v for v in self._volumes("broker.key_secret", authorized=True) if v["name"] != "models"]
            init = []
            if half == "b":   # a cold start of both halves at once would bind both: b waits for a
                init = [self._container("wait-for-broker-a", ["python", "-c", _WAIT_FOR_TCP,
                                                              "omnirelay-broker-a", str(BROKER_PORT)], [])]
            affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100, "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "omnirelay",
                                                      "app.kubernetes.io/component": "broker"}}}}]}}
            pod = self._pod_spec([container], volumes, grace_s=30, affinity=affinity,
                                 **({"initContainers": init} if init else {}))
            objects.append(self._deployment(name, "broker", {"omnirelay/broker": half}, 1, pod,
                                            {"type": "Recreate"}))
            objects.append({"apiVersion": "v1", "kind": "Service", "metadata": self._meta(name, "broker"),
                            "spec": {"selector": {"app.kubernetes.io/instance": name},
                                     "publishNotReadyAddresses": True,
                                     "ports": [{"name": "bus", "port": BROKER_PORT, "targetPort": "bus"}]}})
        objects.append(self._pdb("omnirelay-broker", "broker",
                                 {"app.kubernetes.io/name": "omnirelay", "app.kubernetes.io/component": "broker"}))
        return objects

    # ------------------------------------------------------------------ gateway

    def _gateway(self) -> list[dict]:
        # omni-serve's own gateway command line (every flag it forwards, now and later), pointed at
        # the pods' paths: the ConfigMap's pipeline files, all interfaces, the token socket at the pod IP.
        from omnirelay.deploy.serve import gateway_command
        args = self.args
        plans = [dataclasses.replace(plan, pipeline_file=self._pipeline_file(i)) for i, plan in enumerate(self.plans)]
        served = argparse.Namespace(**{**vars(args), "host": "0.0.0.0", "port": HTTP_PORT})
        argv = gateway_command(served, plans, self.brokers, "/tmp/gateway.url", reply_host="$(POD_IP)")
        command = ["omni-gateway", *argv[1:], "--reply-port", str(REPLY_PORT),
                   "--curve-secret-key", f"{KEYS_DIR}/gateway.key_secret",
                   "--curve-server-key", f"{KEYS_DIR}/broker.key", "--curve-authorized-keys", AUTHORIZED_DIR,
                   "--log-level", args.log_level, "--log-format", "json", *tracing_argv(args)]
        api_key = {"name": "OMNIRELAY_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": "omnirelay-api-key", "key": "api-key", "optional": True}}}
        http = {"port": "http"}
        container = self._container(
            "gateway", command, self._mounts(authorized=True), env=[api_key],
            ports=[{"name": "http", "containerPort": HTTP_PORT}, {"name": "tokens", "containerPort": REPLY_PORT}],
            startupProbe={"tcpSocket": http, "periodSeconds": 5, "failureThreshold": self._startup_failures(5)},
            readinessProbe={"httpGet": {"path": "/health", **http}, "periodSeconds": 5, "failureThreshold": 2},
            livenessProbe={"tcpSocket": http, "periodSeconds": 10, "failureThreshold": 3},
            lifecycle={"preStop": {"sleep": {"seconds": GATEWAY_PRESTOP_S}}})
        indexes = list(range(len(self.plans)))
        pod = self._pod_spec([container], self._volumes("gateway.key_secret", "broker.key", authorized=True),
                             grace_s=GATEWAY_PRESTOP_S + GATEWAY_SHUTDOWN_S + 5,
                             initContainers=self._model_builders(indexes))
        if not pod["initContainers"]:
            del pod["initContainers"]
        name = "omnirelay-gateway"
        return [self._deployment(name, "gateway", {}, args.k8s_gateway_replicas, pod,
                                 {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
                {"apiVersion": "v1", "kind": "Service", "metadata": self._meta(name, "gateway"),
                 "spec": {"selector": {"app.kubernetes.io/instance": name},
                          "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}]}},
                self._pdb(name, "gateway", {"app.kubernetes.io/instance": name})]

    # ------------------------------------------------------------------ workers

    def _worker_command(self, plan: ModelPlan, index: int, role: str, worker_id: str, health_port: int) -> list[str]:
        args = self.args
        tp, pp = plan.groups.get(role, (1, 1))
        stage = plan.pipeline.stage_for_role(role)
        command = ["omni-worker", "--role", role, "--model", plan.path, "--served-model-name", plan.name,
                   "--broker", self.brokers, "--worker-id", worker_id,
                   "--max-model-len", str(args.max_model_len), "--kv-cache-bytes", str(args.kv_cache_bytes),
                   "--dtype", args.dtype, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                   "--gpu-memory-utilization", f"{args.gpu_memory_utilization:.4g}",
                   "--drain-timeout", f"{args.drain_timeout:g}",
                   "--health-port", str(health_port), "--health-host", "0.0.0.0"]
        if plan.pipeline_file:
            command += ["--stage-configs-path", self._pipeline_file(index)]
        else:
            command += ["--connector", args.connector]
        if stage.sequence_parallel_size > 1:
            command += ["--sequence-parallel-size", str(stage.sequence_parallel_size)]
        if args.enable_expert_parallel and role in ("prefill", "decode"):
            command.append("--enable-expert-parallel")
        spec = plan.pipeline.connector_for(role) if plan.pipeline.edges else None
        if spec is not None and spec.type.startswith("mooncake"):
            command += ["--connector-options", json.dumps({"local_hostname": "$(POD_IP)"})]
        elif spec is not None and spec.type == "yuanrong" and "address" not in spec.options:
            address = args.yuanrong_address or f"$(HOST_IP):{YUANRONG_PORT}"
            command += ["--connector-options", json.dumps({"address": address})]
        return command + ["--curve-secret-key", f"{KEYS_DIR}/worker.key_secret",
                          "--curve-server-key", f"{KEYS_DIR}/broker.key",
                          "--log-level", args.log_level, "--log-format", "json", *tracing_argv(args)]

    def _worker_container(self, plan: ModelPlan, index: int, role: str, name: str, worker_id: str,
                          health_port: int, extra_mounts: list[dict]) -> dict:
        tp, pp = plan.groups.get(role, (1, 1))
        devices = tp * pp * plan.pipeline.stage_for_role(role).sequence_parallel_size
        resources = {"limits": {self.args.k8s_gpu_resource: devices}} if self.args.k8s_gpu_resource else {}
        probe = {"port": health_port}
        return self._container(
            name, self._worker_command(plan, index, role, worker_id, health_port),
            [*self._mounts(), *extra_mounts], resources=resources,
            ports=[{"name": f"health-{health_port - HEALTH_PORT}", "containerPort": health_port}],
            startupProbe={"httpGet": {"path": "/live", **probe}, "periodSeconds": 5,
                          "failureThreshold": self._startup_failures(5)},
            readinessProbe={"httpGet": {"path": "/ready", **probe}, "periodSeconds": 5, "failureThreshold": 2},
            livenessProbe={"httpGet": {"path": "/live", **probe}, "periodSeconds": 10, "failureThreshold": 3})

    def _workers(self, plan: ModelPlan, model_slug: str) -> list[dict]:
        index = self.plans.index(plan)
        counts = {"prefill": self.args.num_prefill, "decode": self.args.num_decode,
                  "encode": self.args.num_encode, "generate": self.args.num_generate}
        grace_s = math.ceil(self.args.drain_timeout) + CLOSE_MARGIN_S
        volumes = self._volumes("worker.key_secret", "broker.key")
        objects = []
        for group in colocated_groups(plan):
            labels = {"omnirelay/model": model_slug, "omnirelay/roles": "-".join(group)}
            if len(group) == 1:
                role = group[0]
                name = f"omnirelay-{model_slug}-{role}"
                containers = [self._worker_container(plan, index, role, "worker", "$(POD_NAME)", HEALTH_PORT, [])]
                pod = self._pod_spec(containers, volumes, grace_s)
                # A new worker serves before an old one drains.
                strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
                replicas = counts[role]
            else:
                # Roles joined by shared memory: one pod, one tmpfs, one process namespace.
                name = f"omnirelay-{model_slug}-{group[0]}-shm"   # groups share no role: names differ
                shm = [{"name": "shm", "mountPath": "/dev/shm"}]
                containers, port = [], HEALTH_PORT
                for role in group:
                    for n in range(counts[role]):
                        containers.append(self._worker_container(plan, index, role, f"{role}-{n}",
                                                                 f"$(POD_NAME)-{role}-{n}", port, shm))
                        port += 1
                pod = self._pod_spec(containers, [*volumes, {"name": "shm", "emptyDir": {"medium": "Memory"}}],
                                     grace_s, shareProcessNamespace=True)
                strategy = {"type": "Recreate"}   # never two pods of one shared-memory pipeline
                replicas = 1
            init = self._model_builders([index])
            if init:
                pod["initContainers"] = init
            objects.append(self._deployment(name, "worker", labels, replicas, pod, strategy))
            objects.append(self._pdb(name, "worker", {"app.kubernetes.io/instance": name}, labels))
        return objects


# The wait of broker b's init container, run by the image's python: until a TCP connection to
# HOST:PORT succeeds (broker a bound), once a second; the pod stays in Init meanwhile.
_WAIT_FOR_TCP = (
    "import socket, sys, time\n"
    "while True:\n"
    "    try:\n"
    "        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
    "        break\n"
    "    except OSError as exc:\n"
    "        print(f'waiting for {sys.argv[1]}:{sys.argv[2]}: {exc}', flush=True)\n"
    "        time.sleep(1)\n")


def check_plans_known(plans: list[ModelPlan]) -> None:
    """Every edge's connector is one the manifests know how to wire."""
    for plan in plans:
        for edge in plan.pipeline.edges:
            kind = plan.pipeline.connectors[edge.connector].type
            if kind != "shared_memory" and kind not in NETWORK_CONNECTORS:
                raise PipelineError(f"model {plan.name!r}: edge {edge.source} → {edge.target} uses connector type "
                                    f"{kind!r}, which the Kubernetes manifests cannot wire")
