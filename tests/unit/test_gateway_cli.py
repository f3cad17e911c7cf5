"""omni-gateway's flags are generated from :class:`GatewayConfig`'s and :class:`ServedModel`'s fields
(omnirelay/config_flags.py): every field with a flag round-trips from the command line into the
config, a repeatable per-model flag is given once for all models or once per ``--model``, ``--help``
lists every field's flag, a bad value exits with status 2 naming the flag, and the flags omni-serve
hands on to the gateway are generated from the same fields (same defaults, choices and help) and
arrive as given.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from omnirelay import config_flags
from omnirelay.deploy import serve
from omnirelay.gateway import daemon
from omnirelay.gateway.config import GatewayConfig, ServedModel
from omnirelay.lora_modules import LoraModule, LoraOptions


@pytest.fixture
def model_dir(tmp_path, monkeypatch) -> str:
    # The config only checks that a model's directory exists: empty ones serve.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMNIRELAY_API_KEY", raising=False)
    for name in ("m", "other", "media"):
        (tmp_path / name).mkdir()
    return str(tmp_path / "m")


def _config(model_dir: str, *flags: str) -> GatewayConfig:
    return daemon.gateway_config(daemon.build_parser().parse_args(["--model", model_dir, *flags]))


# Per GatewayConfig field with a flag: the flags given on top of "--model DIR", and the fields they set.
ROUND_TRIPS: dict[str, tuple[list[str], dict]] = {
    "host": (["--host", "0.0.0.0"], {"host": "0.0.0.0"}),
    "port": (["--port", "0"], {"port": 0}),
    "broker": (["--broker", "tcp://10.0.0.1:6000"], {"broker": "tcp://10.0.0.1:6000"}),
    "reply_host": (["--reply-host", "10.0.0.2"], {"reply_host": "10.0.0.2"}),
    "reply_port": (["--reply-port", "7000"], {"reply_port": 7000}),
    "request_timeout_s": (["--request-timeout", "30"], {"request_timeout_s": 30.0}),
    "worker_wait_s": (["--worker-wait", "12.5"], {"worker_wait_s": 12.5}),
    "video_timeout_s": (["--video-timeout", "60"], {"video_timeout_s": 60.0}),
    "video_stall_timeout_s": (["--video-stall-timeout", "10"], {"video_stall_timeout_s": 10.0}),
    "max_body_bytes": (["--max-body-bytes", "1024"], {"max_body_bytes": 1024}),
    "api_key": (["--api-key", "secret"], {"api_key": "secret"}),
    "protect_probes": (["--protect-probes"], {"protect_probes": True}),
    "disable_log_requests": (["--disable-log-requests"], {"disable_log_requests": True}),
    "max_streams_per_client": (["--max-streams-per-client", "3"], {"max_streams_per_client": 3}),
    "stream_write_timeout_s": (["--stream-write-timeout", "5"], {"stream_write_timeout_s": 5.0}),
    "header_timeout_s": (["--header-timeout", "7"], {"header_timeout_s": 7.0}),
    "read_timeout_s": (["--read-timeout", "8"], {"read_timeout_s": 8.0}),
    "max_websocket_sessions": (["--max-websocket-sessions", "2"], {"max_websocket_sessions": 2}),
    "websocket_idle_timeout_s": (["--websocket-idle-timeout", "9"], {"websocket_idle_timeout_s": 9.0}),
    "trust_request_chat_template": (["--trust-request-chat-template"], {"trust_request_chat_template": True}),
    "max_image_pixels": (["--max-image-pixels", "1000"], {"max_image_pixels": 1000}),
    "min_audio_sample_rate": (["--min-audio-sample-rate", "16000"], {"min_audio_sample_rate": 16000}),
    "max_audio_sample_rate": (["--max-audio-sample-rate", "48000"], {"max_audio_sample_rate": 48000}),
    "allow_special_tokens_in_content": (["--allow-special-tokens-in-content"], {"allow_special_tokens_in_content": True}),
    "enable_force_include_usage": (["--enable-force-include-usage"], {"enable_force_include_usage": True}),
    "enable_prompt_tokens_details": (["--enable-prompt-tokens-details"], {"enable_prompt_tokens_details": True}),
    "enable_server_load_tracking": (["--enable-server-load-tracking"], {"enable_server_load_tracking": True}),
    "lora": (["--enable-lora", "--lora-modules", "a=/x", "--max-loras", "2", "--max-lora-rank", "8",
              "--max-cpu-loras", "3", "--allow-runtime-lora-updating"],
             {"lora": LoraOptions(modules=(LoraModule("a", "/x"),), max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                                  allow_runtime_updating=True)}),
}

# Per ServedModel field with a flag: the flags given on top of "--model DIR", and the fields they set.
MODEL_ROUND_TRIPS: dict[str, tuple[list[str], dict]] = {
    "name": (["--served-model-name", "tiny"], {"name": "tiny"}),
    "path": (["--model", "other"], {"name": "other", "path": None}),   # None: absolute, below (and a 2nd model)
    "max_model_len": (["--max-model-len", "512"], {"max_model_len": 512}),
    "allowed_local_media_path": (["--allowed-local-media-path", "media"], {"allowed_local_media_path": None}),
    "reasoning_parser": (["--reasoning-parser", "qwen3"], {"reasoning_parser": "qwen3"}),
    "default_chat_template_kwargs": (["--default-chat-template-kwargs", '{"enable_thinking": false}'],
                                     {"default_chat_template_kwargs": {"enable_thinking": False}}),
    "structured_outputs_in_reasoning": (["--structured-outputs-in-reasoning"], {"structured_outputs_in_reasoning": True}),
    "scheduling_policy": (["--scheduling-policy", "priority"], {"scheduling_policy": "priority"}),
    "tool_call_parser": (["--tool-call-parser", "qwen3_coder"], {"tool_call_parser": "qwen3_coder"}),
    "pooler_config": (["--pooler-config", '{"pooling_type": "MEAN"}'], {"pooler_config": '{"pooling_type": "MEAN"}'}),
}


def test_every_field_has_a_flag_or_says_where_its_value_comes_from():
    assert set(config_flags.flags(GatewayConfig)) == set(ROUND_TRIPS), \
        "a GatewayConfig field's flag lacks a round trip here (or the reverse)"
    assert {f.name for f in dataclasses.fields(GatewayConfig)} - set(ROUND_TRIPS) == {"models", "status_timeout_s"}
    assert set(config_flags.flags(ServedModel)) == set(MODEL_ROUND_TRIPS)
    assert {f.name for f in dataclasses.fields(ServedModel)} - set(MODEL_ROUND_TRIPS) == {"stages"}   # the pipeline


@pytest.mark.parametrize("field", sorted(ROUND_TRIPS))
def test_each_gateway_flag_sets_its_field_and_nothing_else(model_dir, field):
    base = _config(model_dir)
    flags, expected = ROUND_TRIPS[field]
    config = _config(model_dir, *flags)
    for f in dataclasses.fields(GatewayConfig):
        assert getattr(config, f.name) == expected.get(f.name, getattr(base, f.name)), (f.name, flags)
    assert getattr(config, field) != getattr(base, field), f"{flags} left {field} at its default"


@pytest.mark.parametrize("field", sorted(MODEL_ROUND_TRIPS))
def test_each_model_flag_sets_its_field_and_nothing_else(model_dir, field):
    base = _config(model_dir).models[0]
    flags, expected = MODEL_ROUND_TRIPS[field]
    models = _config(model_dir, *flags).models
    model = models[-1]   # --model adds a second model; every other flag sets the only one
    assert len(models) == (2 if field == "path" else 1)
    if field == "path":
        expected = {**expected, "path": os.path.abspath("other")}   # a relative --model becomes absolute
    if field == "allowed_local_media_path":
        expected = {**expected, "allowed_local_media_path": os.path.abspath("media")}
    for f in dataclasses.fields(ServedModel):
        assert getattr(model, f.name) == expected.get(f.name, getattr(base, f.name)), (f.name, flags)
    assert getattr(model, field) != getattr(base, field), f"{flags} left {field} at its default"


def test_the_bare_command_line_gives_the_fields_defaults(model_dir):
    config = _config(model_dir)
    assert config.models == (ServedModel(name=model_dir, path=model_dir),)
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig) if f.name != "models"}
    assert {name: getattr(config, name) for name in defaults} == defaults


def test_repeatable_flags_are_one_for_all_models_or_one_per_model(model_dir):
    other = os.path.abspath("other")
    both = ["--model", "other", "--served-model-name", "a"]
    one = _config(model_dir, *both, "--tool-call-parser", "qwen3_coder", "--max-model-len", "64")
    assert [(m.name, m.path, m.tool_call_parser, m.max_model_len) for m in one.models] == [
        ("a", model_dir, "qwen3_coder", 64), ("other", other, "qwen3_coder", 64)]
    each = _config(model_dir, *both, "--reasoning-parser", "qwen3", "--reasoning-parser", "",
                   "--default-chat-template-kwargs", '{"x": 1}', "--default-chat-template-kwargs", "")
    assert [(m.reasoning_parser, m.default_chat_template_kwargs) for m in each.models] == [("qwen3", {"x": 1}),
                                                                                           (None, {})]
    with pytest.raises(ValueError, match="give one --reasoning-parser for all models or one per --model"):
        _config(model_dir, "--reasoning-parser", "qwen3", "--reasoning-parser", "deepseek_r1")
    with pytest.raises(ValueError, match="more --served-model-name than --model"):
        _config(model_dir, "--served-model-name", "a", "--served-model-name", "b")


def test_the_api_key_defaults_to_the_environment_and_an_empty_one_is_none(model_dir, monkeypatch):
    monkeypatch.setenv("OMNIRELAY_API_KEY", "from-env")
    assert _config(model_dir).api_key == "from-env"   # read when the parser is built
    assert _config(model_dir, "--api-key", "given").api_key == "given"
    assert _config(model_dir, "--api-key", "").api_key is None


def test_lora_left_out_takes_the_pipeline_files_and_given_wins(model_dir, tmp_path):
    stages = {"stages": [{"name": "prefill", "role": "prefill",
                          "engine_args": {"enable_lora": True, "lora_modules": ["s=/stage-adapter"], "max_loras": 2}},
                         {"name": "decode", "role": "decode"}],
              "connectors": {"kv": {"type": "shared_memory"}},
              "edges": [{"from": "prefill", "to": "decode", "connector": "kv"}]}
    path = tmp_path / "stages.yaml"
    path.write_text(json.dumps(stages))   # YAML is a superset of JSON
    from_file = _config(model_dir, "--stage-configs-path", str(path)).lora
    assert (from_file.modules[0].name, from_file.modules[0].path, from_file.max_loras) == ("s", "/stage-adapter", 2)
    given = _config(model_dir, "--stage-configs-path", str(path), "--enable-lora", "--lora-modules", "f=/flag")
    assert given.lora.modules == (LoraModule("f", "/flag"),)
    assert _config(model_dir).lora is None


def _run_gateway(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnirelay.gateway.daemon", *flags],
                          capture_output=True, text=True, timeout=120)


def test_omni_gateway_help_lists_every_fields_flag():
    done = _run_gateway("--help")
    assert done.returncode == 0, done.stderr
    words = " ".join(done.stdout.split())
    for cls in (GatewayConfig, ServedModel):
        for name, spec in config_flags.flags(cls).items():
            for option in spec.names:
                assert option in done.stdout.split() or f"[{option}" in done.stdout, (name, option)
            # The field's documentation is the flag's help (its first words, as argparse wraps lines).
            if spec.add is None:
                assert " ".join(spec.help.split()[:3]) in words, name


@pytest.mark.parametrize("flags, message", [
    (["--port", "x"], "argument --port: invalid int value: 'x'"),
    (["--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice: 'lifo'"),
    (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must be a JSON object"),
    (["--tool-call-parser", "hermes", "--tool-call-parser", "qwen3_coder"],
     "give one --tool-call-parser for all models or one per --model"),
])
def test_a_bad_value_exits_2_naming_its_flag(model_dir, flags, message):
    done = _run_gateway("--model", model_dir, "--broker", "tcp://127.0.0.1:9", *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


# ------------------------------------------------------------------ omni-serve hands them on

def _actions(parser) -> dict:
    return {option: action for action in parser._actions for option in action.option_strings}


def test_omni_serve_declares_the_flags_it_hands_to_the_gateway_from_the_config(monkeypatch):
    monkeypatch.delenv("OMNIRELAY_API_KEY", raising=False)
    served, gateway = _actions(serve.build_parser()), _actions(daemon.build_parser())
    for cls, names in ((GatewayConfig, serve.PASSED_TO_GATEWAY), (ServedModel, serve.PASSED_TO_GATEWAY_PER_MODEL)):
        for name in names:
            option = config_flags.flags(cls)[name].name

            def described(action):
                return (type(action), action.default, action.type, action.choices, action.help)

            assert described(served[option]) == described(gateway[option]), option


@pytest.mark.parametrize("field", [*serve.PASSED_TO_GATEWAY, *serve.PASSED_TO_GATEWAY_PER_MODEL])
def test_a_flag_given_to_omni_serve_reaches_the_gateways_config(model_dir, field):
    flags = (ROUND_TRIPS.get(field) or MODEL_ROUND_TRIPS[field])[0]
    args = serve.build_parser().parse_intermixed_args([model_dir, *flags])
    argv = serve.gateway_command(args, [], "tcp://127.0.0.1:9", "ready")[1:]   # [0]: the daemon's module
    via_serve = daemon.gateway_config(daemon.build_parser().parse_args(["--model", model_dir, *argv]))
    assert via_serve == dataclasses.replace(_config(model_dir, *flags), broker="tcp://127.0.0.1:9")
