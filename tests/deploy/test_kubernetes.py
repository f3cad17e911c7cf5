"""``omni-serve --emit kubernetes DIR`` (deploy/kubernetes.py): every generated object is valid
against the Kubernetes API schemas that ``kubernetes-validate`` ships (the newest it knows, strict:
an unknown field fails), for the embedded pipeline and for a Qwen3-Omni pipeline with four roles,
over shared memory (one pod), Redis and Mooncake (a Deployment per role). No cluster runs on these
machines, so nothing is applied: the tests check the objects and how they are wired."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from omnirelay.deploy.builders.qwen3_omni import build_tiny_qwen3_omni
from omnirelay.deploy.embedded import TINY_MODELS
from omnirelay.deploy.kubernetes import EMBEDDED, HEALTH_PORT
from omnirelay.pipeline import parse_pipeline
from repo_paths import REPO_ROOT

QWEN3_OMNI_PIPELINE = os.path.join(REPO_ROOT, "deploy", "pipelines", "qwen3_omni.yaml")
ROLES = ("encode", "prefill", "decode", "generate")


def emit(out_dir, *args: str) -> dict[str, list[dict]]:
    """Run the real CLI; the objects of each written file, each checked against the schemas."""
    done = subprocess.run([sys.executable, "-m", "omnirelay.deploy.serve", *args, "--emit", "kubernetes",
                           str(out_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    version = kubernetes_validate.latest_version()
    files = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.yaml"))):
        with open(path) as handle:
            docs = [doc for doc in yaml.safe_load_all(handle) if doc is not None]
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)   # raises ValidationError naming the field
        files[os.path.basename(path)] = docs
    return files


def emit_fails(out_dir, *args: str, emit_format: str = "kubernetes") -> str:
    done = subprocess.run([sys.executable, "-m", "omnirelay.deploy.serve", *args, "--emit", emit_format,
                           str(out_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stderr


def objects(files: dict, kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for docs in files.values() for doc in docs if doc["kind"] == kind}


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(scope="module")
def qwen3_omni(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3-omni"
    build_tiny_qwen3_omni(path, seed=0)
    return str(path)


def network_pipeline(tmp_path, connector: dict) -> str:
    """The bundled Qwen3-Omni pipeline with its one connector replaced by ``connector``."""
    with open(QWEN3_OMNI_PIPELINE) as handle:
        raw = yaml.safe_load(handle)
    raw["connectors"]["data"] = connector
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_the_schema_check_rejects_what_a_cluster_would():
    """The validator the tests lean on fails an unknown field and a wrongly typed one."""
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}},
                           "template": {"metadata": {"labels": {"a": "b"}},
                                        "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(deployment, version, strict=True)
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, version, strict=True)
    deployment["spec"]["template"]["spec"]["containers"][0].pop("livenessprobe")
    deployment["spec"]["replicas"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, version, strict=True)


def test_embedded_names_are_the_embedded_models():
    assert [name for name, _ in EMBEDDED] == [name for name, _, _ in TINY_MODELS]


def test_embedded_pipeline(tmp_path):
    files = emit(tmp_path, "--drain-timeout", "60")
    assert set(files) == {"pipelines.yaml", "broker.yaml", "gateway.yaml", *(f"workers-{name}.yaml" for name, _ in EMBEDDED)}
    deployments = objects(files, "Deployment")
    pdbs = objects(files, "PodDisruptionBudget")
    # Every Deployment has a PDB over exactly its pods (the brokers': one over the pair).
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [pdb for pdb in pdbs.values()
                    if all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())]
        assert len(covering) == 1, name
        assert covering[0]["spec"]["maxUnavailable"] == 1
    # The stage YAML travels in the ConfigMap and names the roles each model's workers run.
    pipelines = objects(files, "ConfigMap")["omnirelay-pipelines"]["data"]
    assert parse_pipeline(yaml.safe_load(pipelines["tiny-omni.yaml"])).roles == ROLES
    assert parse_pipeline(yaml.safe_load(pipelines["tiny-sd.yaml"])).roles == ("generate",)
    # Each pod builds the embedded models it serves (seed 0: the same weights in every pod).
    gateway = deployments["omnirelay-gateway"]["spec"]["template"]["spec"]
    assert [c["command"][:3] for c in gateway["initContainers"]] == [
        ["omni-make-model", name, f"/models/{name}"] for name, _ in EMBEDDED]
    command = containers(deployments["omnirelay-gateway"])[0]["command"]
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--stage-configs-path"] == [
        f"/etc/omnirelay/pipelines/{name}.yaml" for name, _ in EMBEDDED]
    # Shared memory: the omni model's four roles are containers of one pod.
    omni = deployments["omnirelay-tiny-omni-encode-shm"]
    assert [c["name"] for c in containers(omni)] == ["encode-0", "prefill-0", "decode-0", "generate-0"]
    assert omni["spec"]["template"]["spec"]["initContainers"][0]["command"][:2] == ["omni-make-model", "tiny-omni"]
    # A one-stage image model is a Deployment of its own.
    assert [c["name"] for c in containers(deployments["omnirelay-tiny-sd-generate"])] == ["worker"]


def test_broker_pair_gateway_and_keys(tmp_path):
    files = emit(tmp_path, "--max-body-bytes", "123456", "--otlp-traces-endpoint", "http://otel:4318/v1/traces",
                 "--trace-sample-ratio", "0.25")
    deployments = objects(files, "Deployment")
    services = objects(files, "Service")
    a, b = deployments["omnirelay-broker-a"], deployments["omnirelay-broker-b"]
    for me, other in ((a, "b"), (b, "a")):
        command = containers(me)[0]["command"]
        assert flag(command, "--standby-of") == f"tcp://omnirelay-broker-{other}:5555"
        assert flag(command, "--curve-authorized-keys") == "/etc/omnirelay/authorized"
        assert me["spec"]["strategy"] == {"type": "Recreate"} and me["spec"]["replicas"] == 1
        service = services[me["metadata"]["name"]]
        # A standby binds nothing until it takes over; clients must reach it the moment it does.
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"].items() <= me["spec"]["template"]["metadata"]["labels"].items()
    # b starts only once a is bound: two brokers started cold together would both bind.
    assert "initContainers" not in a["spec"]["template"]["spec"]
    wait = b["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert wait[-2:] == ["omnirelay-broker-a", "5555"]
    both = "tcp://omnirelay-broker-a:5555,tcp://omnirelay-broker-b:5555"
    for name, deployment in deployments.items():
        for container in containers(deployment):   # every daemon exports its spans
            assert flag(container["command"], "--otlp-traces-endpoint") == "http://otel:4318/v1/traces"
            assert flag(container["command"], "--trace-sample-ratio") == "0.25"
            if "broker" not in name:
                assert flag(container["command"], "--broker") == both
    # The gateway: behind its Service, ready on /health, its token socket at the pod's IP.
    gateway = containers(deployments["omnirelay-gateway"])[0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert flag(gateway["command"], "--reply-host") == "$(POD_IP)"
    assert flag(gateway["command"], "--max-body-bytes") == "123456"   # omni-serve's gateway flags pass through
    assert services["omnirelay-gateway"]["spec"]["ports"][0]["targetPort"] == "http"
    assert gateway["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    api_key = next(e for e in gateway["env"] if e["name"] == "OMNIRELAY_API_KEY")
    assert api_key["valueFrom"]["secretKeyRef"]["name"] == "omnirelay-api-key"
    # Keys come from Secrets, each pod mounting only its own secret key.
    for name, secret in (("omnirelay-broker-a", "broker.key_secret"), ("omnirelay-gateway", "gateway.key_secret"),
                         ("omnirelay-tiny-llm-prefill-shm", "worker.key_secret")):
        volumes = {v["name"]: v for v in deployments[name]["spec"]["template"]["spec"]["volumes"]}
        items = [item["key"] for item in volumes["curve"]["secret"]["items"]]
        assert secret in items and not [k for k in items if k.endswith("key_secret") and k != secret], name
        assert volumes["curve"]["secret"]["secretName"] == "omnirelay-curve"


def test_refuses_what_would_leak_or_cannot_be_probed(tmp_path):
    assert "Secret omnirelay-api-key" in emit_fails(tmp_path, "--api-key", "sk-1")
    assert "--protect-probes" in emit_fails(tmp_path, "--protect-probes")
    assert "only format is kubernetes" in emit_fails(tmp_path, emit_format="helm")
    assert not os.listdir(tmp_path)   # nothing written by a refused run


def _worker_containers(files: dict) -> dict[str, dict]:
    return {c["name"] if c["name"] != "worker" else d["metadata"]["name"]: c
            for d in objects(files, "Deployment").values() if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
            for c in containers(d)}


def _assert_worker_probes_and_drain(files: dict, drain_s: int) -> None:
    for deployment in objects(files, "Deployment").values():
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] != "worker":
            continue
        pod = deployment["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > drain_s
        ports = set()
        for container in pod["containers"]:
            command = container["command"]
            assert float(flag(command, "--drain-timeout")) == drain_s
            port = int(flag(command, "--health-port"))
            ports.add(port)
            assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
            assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": port}
            assert container["startupProbe"]["httpGet"]["path"] == "/live"
        assert len(ports) == len(pod["containers"])   # containers of one pod share its network


def test_qwen3_omni_four_roles_over_shared_memory(tmp_path, qwen3_omni):
    files = emit(tmp_path, qwen3_omni, "--num-decode", "2", "--drain-timeout", "60", "--tensor-parallel-size", "2")
    (deployment,) = [d for d in objects(files, "Deployment").values()
                     if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["encode-0", "prefill-0", "decode-0", "decode-1", "generate-0"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    # One tmpfs for the shared-memory connector, one PID namespace for the segment names.
    assert pod["shareProcessNamespace"] is True
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    for container in pod["containers"]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert flag(container["command"], "--worker-id") == f"$(POD_NAME)-{container['name']}"
    # The GPU group of prefill and decode is the tensor-parallel size.
    limits = {c["name"]: c["resources"]["limits"]["nvidia.com/gpu"] for c in pod["containers"]}
    assert limits["prefill-0"] == limits["decode-1"] == 2
    _assert_worker_probes_and_drain(files, 60)


@pytest.mark.parametrize("connector", [
    {"type": "redis", "options": {"url": "redis://redis:6379/0", "ttl_s": 300}},
    {"type": "mooncake_transfer_engine", "options": {"metadata_server": "http://mooncake-meta:8080/metadata"}},
    {"type": "yuanrong", "options": {"ttl_s": 300}},
])
def test_qwen3_omni_four_roles_across_pods(tmp_path, qwen3_omni, connector):
    pipeline = network_pipeline(tmp_path, connector)
    out = tmp_path / "out"
    files = emit(out, qwen3_omni, "--stage-configs-path", pipeline, "--num-decode", "3", "--drain-timeout", "45",
                 "--k8s-namespace", "serving")
    workers = {d["metadata"]["labels"]["omnirelay/roles"]: d for d in objects(files, "Deployment").values()
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}
    assert sorted(workers) == sorted(ROLES)   # one Deployment per role
    assert workers["decode"]["spec"]["replicas"] == 3 and workers["prefill"]["spec"]["replicas"] == 1
    for role, deployment in workers.items():
        (container,) = containers(deployment)
        assert flag(container["command"], "--role") == role
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
        # A new worker serves before an old one drains.
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        assert "shareProcessNamespace" not in deployment["spec"]["template"]["spec"]
        options = json.loads(flag(container["command"], "--connector-options")) \
            if "--connector-options" in container["command"] else {}
        expected = {"mooncake_transfer_engine": {"local_hostname": "$(POD_IP)"},
                    "yuanrong": {"address": "$(HOST_IP):31501"}}   # the node's datasystem worker
        assert options == expected.get(connector["type"], {})
        assert {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}} in container["env"]
    config = objects(files, "ConfigMap")["omnirelay-pipelines"]["data"]
    assert yaml.safe_load(config[f"{os.path.basename(qwen3_omni)}.yaml"])["connectors"]["data"] == connector
    assert {doc["metadata"]["namespace"] for docs in files.values() for doc in docs} == {"serving"}
    _assert_worker_probes_and_drain(files, 45)


def test_cpu_cluster_asks_for_no_gpu(tmp_path):
    files = emit(tmp_path, "--k8s-gpu-resource", "")
    for container in _worker_containers(files).values():
        assert "resources" not in container or not container["resources"]
    assert HEALTH_PORT in {int(flag(c["command"], "--health-port")) for c in _worker_containers(files).values()}
