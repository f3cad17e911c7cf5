"""omni-worker's flags are generated from :class:`WorkerConfig`'s fields (omnirelay/config_flags.py):
every field with a flag round-trips from the command line into the config, the flags that default to
the stage YAML's value take it when left out and win when given, ``--help`` lists every field's flag,
and a field that declares no flag cannot be added by accident. The engine checks that moved out of the
config (sequence- and expert-parallel sizes) run from the role table, before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from omnirelay import config_flags
from omnirelay.lora_modules import LoraModule, LoraOptions
from omnirelay.pipeline import default_llm_pipeline
from omnirelay.speculative import SpeculativeConfig
from omnirelay.workers import daemon
from omnirelay.workers.role_table import check_config
from omnirelay.workers.runtime.config import WorkerConfig


@pytest.fixture
def model_dir(tmp_path, monkeypatch) -> str:
    # The config reads no file of the model (its engine's checks do): an empty directory serves.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "other").mkdir()
    return str(tmp_path / "m")


def _config(model_dir: str, *flags: str) -> WorkerConfig:
    base = ["--role", "prefill", "--model", model_dir, "--worker-id", "w", "--capacity", "5"]
    return daemon.worker_config(daemon.build_parser().parse_args([*base, *flags]))


# Per field with a flag: the flags given on top of the base command line, and the fields they set.
ROUND_TRIPS: dict[str, tuple[list[str], dict]] = {
    "role": (["--role", "decode"], {"role": "decode",   # and the decode stage's default
                                    "stream_chunk_tokens": default_llm_pipeline("shared_memory", {})
                                    .stage_for_role("decode").stream_chunk_tokens}),
    "model_path": (["--model", "other"], {"model_path": None, "model_name": "other"}),   # None: abspath, below
    "model_name": (["--served-model-name", "tiny"], {"model_name": "tiny"}),
    "broker": (["--broker", "tcp://10.0.0.1:6000"], {"broker": "tcp://10.0.0.1:6000"}),
    "worker_id": (["--worker-id", "x"], {"worker_id": "x"}),
    "capacity": (["--capacity", "3"], {"capacity": 3}),
    "max_model_len": (["--max-model-len", "512"], {"max_model_len": 512}),
    "kv_cache_bytes": (["--kv-cache-bytes", "1048576"], {"kv_cache_bytes": 1048576}),
    "block_size": (["--block-size", "32"], {"block_size": 32}),
    "heartbeat_interval_s": (["--heartbeat-interval", "0.5"], {"heartbeat_interval_s": 0.5}),
    "stream_chunk_tokens": (["--stream-chunk-tokens", "4"], {"stream_chunk_tokens": 4}),
    "wedged_after_s": (["--wedged-after", "60"], {"wedged_after_s": 60.0}),
    "drain_timeout_s": (["--drain-timeout", "5"], {"drain_timeout_s": 5.0}),
    "dtype": (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    "quantization": (["--quantization", "int8"], {"quantization": "int8"}),
    "cache_backend": (["--role", "generate", "--cache-backend", "static"], {"role": "generate", "cache_backend": "static"}),
    "cache_config": (["--role", "generate", "--cache-config", '{"interval": 2}'],
                     {"role": "generate", "cache_config": '{"interval": 2}'}),
    "tensor_parallel_size": (["--tensor-parallel-size", "2"], {"tensor_parallel_size": 2}),
    "pipeline_parallel_size": (["--pipeline-parallel-size", "3"], {"pipeline_parallel_size": 3}),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "64"], {"max_num_batched_tokens": 64}),
    "prefix_caching": (["--no-prefix-caching"], {"prefix_caching": False}),
    "kv_transfer": (["--kv-transfer", "whole"], {"kv_transfer": "whole"}),
    "threads": (["--threads", "2"], {"threads": 2}),
    "devices": (["--devices", "1, 0", "--tensor-parallel-size", "2"], {"devices": (1, 0), "tensor_parallel_size": 2}),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
    "sequence_parallel_size": (["--role", "generate", "--sequence-parallel-size", "2"],
                               {"role": "generate", "sequence_parallel_size": 2}),
    "expert_parallel": (["--enable-expert-parallel"], {"expert_parallel": True}),
    "speculative": (["--role", "decode", "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
                    {"role": "decode", "stream_chunk_tokens": default_llm_pipeline("shared_memory", {})
                     .stage_for_role("decode").stream_chunk_tokens,
                     "speculative": SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4)}),
    "lora": (["--enable-lora", "--lora-modules", "a=/x", "--max-loras", "2", "--max-lora-rank", "8",
              "--max-cpu-loras", "3"],
             {"lora": LoraOptions(modules=(LoraModule("a", "/x"),), max_loras=2, max_lora_rank=8, max_cpu_loras=3)}),
}


def test_every_field_has_a_flag_or_says_where_its_value_comes_from():
    flagged = config_flags.flags(WorkerConfig)
    assert set(flagged) == set(ROUND_TRIPS), "a WorkerConfig field's flag lacks a round trip here (or the reverse)"
    unflagged = {f.name for f in dataclasses.fields(WorkerConfig)} - set(flagged)
    assert unflagged == {"connector", "connector_options"}   # the stage pipeline sets them

    @dataclasses.dataclass
    class Forgotten:
        given: int = config_flags.flag("--given", "a field with its flag", default=1, type=int)
        forgotten: int = 2

    with pytest.raises(TypeError, match="Forgotten.forgotten declares neither a flag"):
        config_flags.add_flags(daemon.argparse.ArgumentParser(), Forgotten)


@pytest.mark.parametrize("field", sorted(ROUND_TRIPS))
def test_each_flag_sets_its_field_and_nothing_else(model_dir, field):
    base = _config(model_dir)
    flags, expected = ROUND_TRIPS[field]
    config = _config(model_dir, *flags)
    if field == "model_path":
        expected = {**expected, "model_path": os.path.abspath("other")}   # a relative --model becomes absolute
    for f in dataclasses.fields(WorkerConfig):
        want = expected.get(f.name, getattr(base, f.name))
        assert getattr(config, f.name) == want, (f.name, flags)
    assert getattr(config, field) != getattr(base, field), f"{flags} left {field} at its default"


def test_the_base_command_line_gives_the_fields_defaults(model_dir):
    config = _config(model_dir)
    assert (config.role, config.model_path, config.model_name, config.capacity) == ("prefill", model_dir, model_dir, 5)
    defaults = {f.name: f.default for f in dataclasses.fields(WorkerConfig)
                if f.name not in ("role", "model_path", "model_name", "worker_id", "capacity", "connector_options")}
    # --dtype auto is resolved on construction: the tiny model is saved in float32 (tests/unit/test_dtypes.py).
    defaults["dtype"] = "float32"
    assert {name: getattr(config, name) for name in defaults} == defaults
    assert config.connector_options == {}
    # 0 is "not given": the stage's max_batch_size, else the role's default.
    assert daemon.worker_config(daemon.build_parser().parse_args(
        ["--role", "decode", "--model", model_dir, "--capacity", "0"])).capacity == 64


def test_flags_left_out_take_the_stage_yaml_and_given_ones_win(model_dir, tmp_path):
    stages = {"stages": [
        {"name": "prefill", "role": "prefill", "runtime": {"max_batch_size": 3},
         "engine_args": {"kv_transfer": "whole", "enable_expert_parallel": True, "enable_lora": True,
                         "lora_modules": ["s=/stage-adapter"], "max_loras": 2}},
        {"name": "decode", "role": "decode", "runtime": {"max_batch_size": 9, "stream_chunk_tokens": 7}}],
        "connectors": {"kv": {"type": "shared_memory", "options": {"a": 1}}},
        "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}
    path = tmp_path / "stages.yaml"
    path.write_text(json.dumps(stages))   # YAML is a superset of JSON

    def config(*flags: str) -> WorkerConfig:
        return daemon.worker_config(daemon.build_parser().parse_args(
            ["--model", model_dir, "--stage-configs-path", str(path), "--connector-options", '{"b": 2}', *flags]))

    prefill = config("--role", "prefill")
    assert (prefill.capacity, prefill.kv_transfer, prefill.expert_parallel) == (3, "whole", True)
    assert prefill.lora == LoraOptions(modules=(LoraModule("s", "/stage-adapter"),), max_loras=2)
    assert prefill.connector == "shared_memory" and prefill.connector_options == {"a": 1, "b": 2}
    given = config("--role", "prefill", "--capacity", "4", "--kv-transfer", "layerwise", "--enable-lora",
                   "--lora-modules", "f=/flag-adapter")
    assert (given.capacity, given.kv_transfer, given.lora.modules) == (4, "layerwise", (LoraModule("f", "/flag-adapter"),))
    decode = config("--role", "decode")
    assert (decode.capacity, decode.stream_chunk_tokens) == (9, 7)
    assert config("--role", "decode", "--stream-chunk-tokens", "0").stream_chunk_tokens == 0   # 0 given is 0


def test_bad_values_name_their_flag(model_dir):
    with pytest.raises(ValueError, match="--devices '0,0': expected distinct device ids"):
        _config(model_dir, "--devices", "0,0")
    with pytest.raises(ValueError, match="--max-loras needs --enable-lora"):
        _config(model_dir, "--max-loras", "2")
    with pytest.raises(ValueError, match="--gpu-memory-utilization 1.5"):
        _config(model_dir, "--gpu-memory-utilization", "1.5")


def test_omni_worker_help_lists_every_fields_flag():
    done = subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = set(done.stdout.split())
    for name, spec in config_flags.flags(WorkerConfig).items():
        for option in spec.names:
            assert option in listed or f"[{option}" in done.stdout, (name, option)
        # The field's documentation is the flag's help (its first words, as argparse wraps lines).
        if spec.add is None:
            assert " ".join(spec.help.split()[:3]) in " ".join(done.stdout.split()), name


def test_omni_serve_declares_the_flags_it_hands_to_workers_from_the_config():
    from omnirelay.deploy.serve import PASSED_TO_WORKERS, build_parser

    def actions(parser):
        return {option: action for action in parser._actions for option in action.option_strings}

    serve, worker = actions(build_parser()), actions(daemon.build_parser())
    for name in PASSED_TO_WORKERS:
        option = config_flags.flags(WorkerConfig)[name].name
        assert (serve[option].default, serve[option].type, serve[option].help) == \
            (worker[option].default, worker[option].type, worker[option].help), option


# ------------------------------------------------------------------ the engines' checks, before loading

def test_the_role_table_runs_the_engine_checks_the_config_no_longer_makes(tiny_model, tmp_path):
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                       "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    # The config alone holds (runtime/ imports no engine); the generate engine refuses the transformer.
    config = WorkerConfig("generate", str(flux), "m", sequence_parallel_size=2)
    with pytest.raises(ValueError, match="FluxTransformer2DModel; use sequence_parallel_size 1"):
        check_config(config)
    check_config(dataclasses.replace(config, sequence_parallel_size=1))
    # The LLM engines: a dense model has no experts to place over the ranks.
    dense = WorkerConfig("decode", tiny_model, "m", tensor_parallel_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="the model has no experts"):
        check_config(dense)
    check_config(dataclasses.replace(dense, expert_parallel=False))
    # What the config can judge alone stays in it.
    with pytest.raises(ValueError, match="only generate workers"):
        WorkerConfig("decode", tiny_model, "m", sequence_parallel_size=2)
    with pytest.raises(ValueError, match="--enable-expert-parallel: only prefill and decode"):
        WorkerConfig("encode", tiny_model, "m", expert_parallel=True)
