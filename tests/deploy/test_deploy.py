"""Deployment artefacts: the systemd units, vLLM-Omni's legacy stage config, the launcher's checks."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import requests

from conftest import ServeProcess

from omnirelay.legacy_stages import translate_legacy
from omnirelay.pipeline import PipelineError, load_pipeline, parse_pipeline
from omnirelay.deploy.serve import main as serve_main
from repo_paths import REPO_ROOT

ROOT = str(REPO_ROOT)
UNITS = os.path.join(ROOT, "deploy", "systemd")
ENV_DIR = os.path.join(UNITS, "env")
INSTALL_PREFIX = "/opt/omnirelay/venv"
UNIT_FILES = ("omni-broker.service", "omni-gateway.service", "omni-worker@.service")


# ------------------------------------------------------------------------------------------ systemd


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str
    with open(os.path.join(UNITS, name)) as handle:
        # configparser keeps only the last of repeated keys; systemd accumulates them. Number them.
        lines, seen = [], {}
        for line in handle.read().replace("\\\n", " ").splitlines():
            key = line.split("=", 1)[0].strip()
            if "=" in line and not line.startswith("#"):
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > 1:
                    line = f"{key}#{seen[key]}={line.split('=', 1)[1]}"
            lines.append(line)
    parser.read_string("\n".join(lines))
    return parser


def _env_file(name: str) -> dict[str, str]:
    env = {}
    with open(os.path.join(ENV_DIR, name)) as handle:
        for line in handle:
            line = line.strip()
            if line and not line.startswith("#"):
                key, value = line.split("=", 1)
                env[key] = value
    return env


def test_systemd_analyze_verify_is_clean(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; .ci/run installs it)")
    # The units name the install prefix of the README; point them at this interpreter's scripts.
    for name in UNIT_FILES:
        with open(os.path.join(UNITS, name)) as handle:
            text = handle.read().replace(INSTALL_PREFIX, sys.prefix)
        (tmp_path / name).write_text(text)
    targets = [str(tmp_path / "omni-broker.service"), str(tmp_path / "omni-gateway.service"),
               str(tmp_path / "omni-worker@prefill-0.service"), str(tmp_path / "omni-worker@decode-1.service")]
    result = subprocess.run(["systemd-analyze", "verify", *targets], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    # verify exits 0 on unknown keys and bad values too; any complaint is a failure here.
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


@pytest.mark.parametrize("name", UNIT_FILES)
def test_units_are_sandboxed_supervised_and_configured_per_host(name):
    service = _unit(name)["Service"]
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service.get("User") == "omnirelay" or service.get("DynamicUser") == "yes"
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert service["EnvironmentFile"].startswith("/etc/omnirelay/")
    assert service["CapabilityBoundingSet"] == ""


def test_worker_stop_timeout_outlasts_its_drain():
    service = _unit("omni-worker@.service")["Service"]
    stop_s = float(service["TimeoutStopSec"].rstrip("s"))
    drain_s = float(_env_file("worker.env")["OMNI_DRAIN_TIMEOUT"])
    assert stop_s >= drain_s + 15, "TimeoutStopSec must leave the drain time to finish"
    assert service["KillMode"] == "mixed"   # SIGTERM to rank 0 only; it stops its own group


_SPECIFIER = re.compile(r"%(.)")
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)\}|\$(\w+)")


def _systemd_command(unit: str, instance: str, env: dict[str, str], host: str, creds: str) -> list[str]:
    """ExecStart as systemd would run it: specifiers, then ``${VAR}`` (one word) and ``$VAR``
    (split on whitespace) from the environment files, ``$$`` → ``$``."""
    line = _unit(unit)["Service"]["ExecStart"]
    specifiers = {"i": instance, "H": host, "d": creds, "C": "/var/cache", "%": "%"}
    words = []
    for word in shlex.split(line):
        word = _SPECIFIER.sub(lambda m: specifiers[m.group(1)], word)
        whole = re.fullmatch(r"\$(\w+)", word)
        if whole:
            words.extend(env.get(whole.group(1), "").split())
            continue
        words.append(_VARIABLE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1) or m.group(2), ""),
                                   word))
    return words


def _flags_of(module: str) -> set[str]:
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    return set(re.findall(r"--[a-z][a-z-]+", result.stdout))


@pytest.mark.parametrize("unit, instance, env_files, module", [
    ("omni-worker@.service", "decode-1", ("worker.env", "worker-decode-0.env"), "omnirelay.workers.daemon"),
    ("omni-broker.service", "", ("broker.env",), "omnirelay.broker.daemon"),
    ("omni-gateway.service", "", ("gateway.env",), "omnirelay.gateway.daemon"),
])
def test_unit_command_lines_give_the_daemon_flags_it_knows(unit, instance, env_files, module, tmp_path):
    env = {}
    for name in env_files:
        env.update(_env_file(name))
    words = _systemd_command(unit, instance, env, host="host-a", creds="/run/credentials/x")
    binary = next(w for w in words if w.startswith(INSTALL_PREFIX))
    # Run the command line for real, with a stand-in for the daemon that prints its arguments.
    stub = tmp_path / "stub"
    stub.write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    stub.chmod(0o755)
    result = subprocess.run([str(stub) if w == binary else w for w in words], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    flags = {a for a in argv if a.startswith("--")}
    assert flags <= _flags_of(module), f"unknown flags {flags - _flags_of(module)}"
    assert all(a for a in argv), f"an empty argument (an unset variable?): {argv}"
    if instance:
        assert argv[argv.index("--role") + 1] == "decode"
        assert argv[argv.index("--worker-id") + 1] == "host-a-decode-1"
        assert argv[argv.index("--curve-secret-key") + 1] == "/run/credentials/x/worker.key_secret"
        assert argv[argv.index("--drain-timeout") + 1] == env["OMNI_DRAIN_TIMEOUT"]


def test_example_pipeline_is_valid():
    pipeline = load_pipeline(os.path.join(ENV_DIR, "pipeline.yaml"))
    assert pipeline.roles == ("prefill", "decode") and pipeline.connector_for("decode").type == "redis"


# ------------------------------------------------------------------------- vLLM-Omni legacy stage_args

# Shaped like vLLM-Omni's Qwen3-Omni PD-separation config: thinker prefill → thinker decode → talker
# → code2wav, one Mooncake store connector, runtime edges.
LEGACY_PD = """
async_chunk: false
stage_args:
  - stage_id: 0
    stage_type: llm
    is_prefill_only: true
    runtime: {devices: "0,1", max_batch_size: 16}
    engine_args:
      model_stage: thinker
      worker_type: ar
      gpu_memory_utilization: 0.9
      tensor_parallel_size: 2
      enforce_eager: true
    final_output: false
    output_connectors: {to_stage_1: mooncake}
    default_sampling_params: {temperature: 0.4, max_tokens: 2048}
  - stage_id: 1
    stage_type: llm
    is_decode_only: true
    runtime: {devices: "2,3", max_batch_size: 64}
    engine_args: {model_stage: thinker, tensor_parallel_size: 2}
    engine_input_source: [0]
    input_connectors: {from_stage_0: mooncake}
    output_connectors: {to_stage_2: mooncake}
    final_output: true
    final_output_type: text
  - stage_id: 2
    stage_type: llm
    runtime: {devices: "4", max_batch_size: 64}
    engine_args: {model_stage: talker, engine_output_type: latent}
    engine_input_source: [1]
    custom_process_input_func: vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker
  - stage_id: 3
    stage_type: llm
    runtime: {devices: "4", max_batch_size: 1}
    engine_args: {model_stage: code2wav, worker_type: generation, engine_output_type: audio}
    engine_input_source: [2]
    final_output: true
    final_output_type: audio
runtime:
  enabled: true
  defaults: {window_size: -1, max_inflight: 1}
  connectors:
    mooncake:
      name: MooncakeStoreConnector
      extra: {host: "10.0.0.2", metadata_server: P2PHANDSHAKE, master: "10.0.0.9:50051",
              segment: 536870912, localbuf: 67108864, proto: tcp}
  edges:
    - {from: 0, to: 1, window_size: -1}
    - {from: 1, to: 2, window_size: -1}
    - {from: 2, to: 3, window_size: -1}
"""


def test_legacy_pd_pipeline_translates_roles_connectors_and_edges():
    pipeline = parse_pipeline(__import__("yaml").safe_load(LEGACY_PD))
    assert [(s.name, s.role) for s in pipeline.stages] == [
        ("thinker-0", "prefill"), ("thinker-1", "decode"), ("talker-2", "generate")]
    prefill, decode, generate = pipeline.stages
    assert prefill.devices == ("0", "1") and prefill.tensor_parallel_size == 2 and prefill.max_batch_size == 16
    assert prefill.engine_args == {"gpu_memory_utilization": 0.9, "tensor_parallel_size": 2, "component": "thinker"}
    assert decode.max_batch_size == 64 and decode.group_size == 2
    # talker → code2wav run together in one generate stage, batch 1 (the smaller of the two).
    assert generate.engine_args["components"] == ["talker", "code2wav"] and generate.max_batch_size == 1
    assert [(e.source, e.target, e.connector) for e in pipeline.edges] == [
        ("thinker-0", "thinker-1", "mooncake"), ("thinker-1", "talker-2", "mooncake")]
    spec = pipeline.connectors["mooncake"]
    assert spec.type == "mooncake_store"
    assert spec.options == {"local_hostname": "10.0.0.2", "metadata_server": "P2PHANDSHAKE",
                            "master": "10.0.0.9:50051", "segment_mb": 512, "local_buffer_mb": 64, "protocol": "tcp"}
    assert pipeline.connector_for("decode").name == "mooncake"


def test_legacy_translation_reports_what_it_drops():
    _, notes = translate_legacy(__import__("yaml").safe_load(LEGACY_PD))
    text = "\n".join(notes)
    assert "async_chunk" in text and "stage_args[0]: vLLM-specific keys dropped: default_sampling_params" in text
    assert "stage_args[0].engine_args: vLLM-specific keys dropped: enforce_eager, worker_type" in text
    assert "stage_args[3]: merged into generate stage 'talker-2'" in text


def test_whole_llm_stage_becomes_prefill_and_decode_over_shared_memory():
    pipeline = parse_pipeline({"stage_args": [
        {"stage_id": 0, "runtime": {"max_batch_size": 4}, "engine_args": {"max_num_seqs": 9}},
        {"stage_id": 1, "stage_type": "diffusion", "engine_input_source": [0]}]})
    assert [(s.name, s.role, s.max_batch_size) for s in pipeline.stages] == [
        ("stage-0-prefill", "prefill", 4), ("stage-0-decode", "decode", 4), ("stage-1", "generate", 1)]
    assert [(e.source, e.target) for e in pipeline.edges] == [("stage-0-prefill", "stage-0-decode"),
                                                              ("stage-0-decode", "stage-1")]
    assert {c.type for c in pipeline.connectors.values()} == {"shared_memory"}


def test_legacy_yuanrong_connector_becomes_the_yuanrong_backend():
    pipeline = parse_pipeline(_legacy(
        [{"stage_id": 0, "is_prefill_only": True, "output_connectors": {"to_stage_1": "yr"}},
         {"stage_id": 1, "is_decode_only": True, "engine_input_source": [0]}],
        {"connectors": {"yr": {"name": "YuanrongConnector", "extra": {"host": "10.0.0.3", "port": 31501}}}}))
    spec = pipeline.connector_for("decode")
    assert (spec.type, spec.options) == ("yuanrong", {"address": "10.0.0.3:31501"})


def _legacy(stages: list[dict], runtime: dict | None = None) -> dict:
    return {"stage_args": stages, **({"runtime": runtime} if runtime else {})}


@pytest.mark.parametrize("document, message", [
    (_legacy([{"stage_id": 0}, {"stage_id": 1, "stage_type": "vision"}]),
     "stage_args[1].stage_type: must be one of llm, diffusion, got 'vision'"),
    (_legacy([{"stage_id": 0}, {"stage_id": 0}]), "stage_args[1].stage_id: duplicate stage id 0 (also stage_args[0])"),
    (_legacy([{"stage_id": 0}, {"stage_id": 1, "engine_input_source": [7]}]),
     "stage_args[1].engine_input_source[0]: unknown stage id 7 (stage ids: [0, 1])"),
    (_legacy([{"stage_id": 0, "output_connectors": {"to_stage_1": "nope"}}, {"stage_id": 1, "engine_input_source": [0]}]),
     "stage_args[0].output_connectors.to_stage_1: unknown connector 'nope'"),
    (_legacy([{"stage_id": 0, "output_connectors": {"to_stage_1": "a"}},
              {"stage_id": 1, "engine_input_source": [0], "input_connectors": {"from_stage_0": "b"}}],
             {"connectors": {"a": {"name": "SharedMemoryConnector"}, "b": {"name": "RedisConnector"}}}),
     "stage_args[0].output_connectors.to_stage_1 is 'a' but stage_args[1].input_connectors.from_stage_0 is 'b'"),
    (_legacy([{"stage_id": 0}], {"connectors": {"y": {"name": "NixlConnector"}}}),
     "runtime.connectors.y.name: unsupported connector 'NixlConnector'"),
    (_legacy([{"stage_id": 0, "runtime": {"devices": "0,1"}, "engine_args": {"tensor_parallel_size": 4}}]),
     "stage_args[0].runtime.devices: 2 device(s) 0,1 but tensor_parallel_size 4 × pipeline_parallel_size 1 = 4"),
    (_legacy([{"stage_id": 0, "engine_args": {"tensor_parallel_size": 0}}]),
     "stage_args[0].engine_args.tensor_parallel_size: must be a positive integer, got 0"),
    (_legacy([{"stage_id": 0, "engine_input_source": [1]}, {"stage_id": 1, "engine_input_source": [0]}]),
     "runtime.edges: the stages [0, 1] form a cycle"),
    (_legacy([{"stage_id": 0}], {"edges": [{"from": 0, "to": 5}]}),
     "runtime.edges[0].to: unknown stage id 5 (stage ids: [0])"),
    (_legacy([{"stage_id": 0, "is_prefill_only": True, "is_decode_only": True}]),
     "stage_args[0]: is_prefill_only and is_decode_only are both set"),
    (_legacy([{"stage_id": 0, "output_connectors": {"to_stage_3": "a"}}], {"connectors": {"a": {"name": "RedisConnector"}}}),
     "stage_args[0].output_connectors.to_stage_3: no edge from stage 0 to stage 3"),
    (_legacy([{"stage_id": 0, "runtimes": {}}]), "stage_args[0]: unknown keys ['runtimes']"),
    ({"stage_args": []}, "stage_args: expected a non-empty list"),
    ({"stages": [{"name": "p", "role": "prefill", "runtime": {"devices": "0,1,2"},
                  "engine_args": {"tensor_parallel_size": 2}}]},
     "stages[0].runtime.devices: 3 device(s) 0,1,2 but tensor_parallel_size 2 × pipeline_parallel_size 1 = 2"),
    ({"stages": [{"name": "p", "role": "prefill", "runtime": {"devices": "0,0"}}]},
     "stages[0].runtime.devices: device ids repeat in '0,0'"),
])
def test_pipeline_errors_name_the_offending_entry(document, message):
    with pytest.raises(PipelineError) as info:
        parse_pipeline(document)
    assert message in str(info.value)


def test_legacy_error_from_a_file_names_the_file_and_entry(tmp_path):
    path = tmp_path / "stages.yaml"
    path.write_text("stage_args:\n  - stage_id: 0\n  - stage_id: 1\n    engine_input_source: [4]\n")
    with pytest.raises(PipelineError, match=re.escape(f"{path}: stage_args[1].engine_input_source[0]: unknown stage")):
        load_pipeline(path)


def test_omni_serve_runs_a_legacy_stage_config(tiny_model, tmp_path):
    path = tmp_path / "legacy.yaml"
    path.write_text(textwrap.dedent("""\
        # one whole llm stage, as vLLM-Omni writes a plain LM: here prefill → decode over shared memory
        stage_args:
          - stage_id: 0
            stage_type: llm
            runtime: {process: true, devices: "0", max_batch_size: 4}
            engine_args: {model_stage: thinker, enforce_eager: true, gpu_memory_utilization: 0.5}
            final_output: true
            final_output_type: text
        """))
    serve = ServeProcess(tiny_model, "--served-model-name", "tiny-llm", "--stage-configs-path", str(path),
                         log_path=str(tmp_path / "serve.log"))
    try:
        response = requests.post(serve.url + "/v1/completions", timeout=60,
                                 json={"model": "tiny-llm", "prompt": "Hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        roles = sorted(w["role"] for w in requests.get(serve.url + "/cluster", timeout=10).json()["workers"])
        assert roles == ["decode", "prefill"]
    finally:
        assert serve.stop() == 0, serve.output()[-3000:]


# ------------------------------------------------------------------------- omni-serve's consistency checks


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide the 4 attention heads and 2 KV heads"),
    (["--tensor-parallel-size", "4"], "--tensor-parallel-size 4 does not divide the 4 attention heads and 2 KV heads"),
    (["--pipeline-parallel-size", "5"], "--pipeline-parallel-size 5 exceeds the 4 layers"),
    (["--tensor-parallel-size", "2", "--devices", "0"],
     "--devices 0 names 1 device(s) but the prefill worker's group is --tensor-parallel-size 2 × "
     "--pipeline-parallel-size 1 × sequence_parallel_size 1 (stage 'prefill') = 2"),
    (["--devices", "0,x"], "--devices '0,x': expected distinct device ids like 0,1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0: must be at least 1"),
    (["--num-decode", "0"], "--num-prefill, --num-decode, --num-encode and --num-generate must be at least 1"),
])
def test_omni_serve_refuses_inconsistent_values(tiny_model, capsys, flags, message):
    with pytest.raises(SystemExit) as info:
        serve_main([tiny_model, "--port", "0", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_omni_serve_refuses_a_flag_that_contradicts_the_stage_config(tiny_model, tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"stages": [
        {"name": "prefill", "role": "prefill", "engine_args": {"tensor_parallel_size": 2}},
        {"name": "decode", "role": "decode"}],
        "connectors": {"kv": {"type": "shared_memory"}}, "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}))
    with pytest.raises(SystemExit):
        serve_main([tiny_model, "--stage-configs-path", str(path), "--tensor-parallel-size", "1"])
    assert (f"--tensor-parallel-size 1 contradicts stage 'prefill' of --stage-configs-path {path}, which sets "
            "tensor_parallel_size: 2") in capsys.readouterr().err


def test_omni_serve_counts_a_generate_stages_sequence_parallel_ranks_in_devices(tmp_path, capsys):
    # A generate stage's group is TP × PP × SP (worker_commands' group_size): --devices numbers all of them.
    from omnirelay.deploy.builders.dit import build_tiny_dit
    from omnirelay.deploy.serve import LaunchError, build_parser, check_parallel
    from omnirelay.deploy.served_models import plan_models

    model = str(build_tiny_dit(tmp_path / "tiny-dit"))
    path = tmp_path / "sp2.yaml"
    path.write_text(json.dumps({"stages": [{"name": "images", "role": "generate",
                                            "engine_args": {"sequence_parallel_size": 2}}]}))
    with pytest.raises(SystemExit) as info:
        serve_main([model, "--port", "0", "--stage-configs-path", str(path), "--devices", "0"])
    assert info.value.code == 2
    assert ("--devices 0 names 1 device(s) but the generate worker's group is --tensor-parallel-size 1 × "
            "--pipeline-parallel-size 1 × sequence_parallel_size 2 (stage 'images') = 2") in capsys.readouterr().err
    args = build_parser().parse_args([model, "--stage-configs-path", str(path), "--devices", "0,1"])
    [plan] = plan_models([(model, "tiny-dit")], args.stage_configs_path, args.connector)
    # The count is right, but SP ranks run on the CPU in this build: refused at launch, not by a
    # worker exiting 2 after it.
    with pytest.raises(LaunchError, match="runs sequence_parallel_size 2, whose ranks run on the CPU"):
        check_parallel(args, plan)


def test_ray_address_where_no_cluster_listens_fails_fast(tiny_model):
    # An address where no Ray cluster listens: a clear message, exit 1, nothing left running.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "omnirelay.deploy.serve", tiny_model, "--port", "0",
                             "--ray-address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"omni-serve: cannot reach the Ray cluster at 127.0.0.1:{port}: nothing answers" in result.stderr


def test_yuanrong_workers_get_the_datasystem_address(tiny_model, tmp_path):
    """``--connector yuanrong`` hands the datasystem worker's address (``--yuanrong-address``, or the
    one omni-serve starts) to the workers of yuanrong edges only, never over a file's own address."""
    from omnirelay.deploy.serve import build_parser, worker_commands, yuanrong_needs_address
    from omnirelay.deploy.served_models import plan_models

    args = build_parser().parse_args([tiny_model, "--connector", "yuanrong", "--yuanrong-address", "127.0.0.1:9"])
    plans = plan_models([(tiny_model, "tiny-llm")], None, args.connector)
    assert yuanrong_needs_address(args, plans)
    for command in worker_commands(args, plans, "ipc:///tmp/none.sock"):
        at = command.argv.index("--connector-options")
        assert json.loads(command.argv[at + 1]) == {"address": "127.0.0.1:9"}, command.name

    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text("stages: [{name: p, role: prefill}, {name: d, role: decode}]\n"
                        "connectors: {kv: {type: yuanrong, options: {address: '10.0.0.5:31501'}}}\n"
                        "edges: [{from: p, to: d, connector: kv}]\n")
    args = build_parser().parse_args([tiny_model, "--stage-configs-path", str(pipeline)])
    plans = plan_models([(tiny_model, "tiny-llm")], args.stage_configs_path, args.connector)
    assert not yuanrong_needs_address(args, plans)
    assert all("--connector-options" not in c.argv for c in worker_commands(args, plans, "ipc:///tmp/none.sock"))


@pytest.mark.parametrize("extra", [[], ["--yuanrong-address", "127.0.0.1:9"]], ids=["local", "address"])
def test_yuanrong_without_its_package_is_refused_naming_the_extra(tiny_model, tmp_path, extra):
    hidden = tmp_path / "hidden" / "yr"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('yr hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "omnirelay.deploy.serve", tiny_model, "--port", "0",
                             "--connector", "yuanrong", *extra], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the yuanrong connector needs the 'yuanrong' extra: pip install 'omnirelay[yuanrong]'" in result.stderr
