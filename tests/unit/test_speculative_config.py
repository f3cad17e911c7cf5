"""``--speculative-config`` (vLLM's JSON) and a decode stage's ``engine_args.speculative_config``:
typed, validated at start-up, and every key or method we do not serve refused by name."""

from __future__ import annotations

import pytest

from omnirelay import speculative
from omnirelay.pipeline import PipelineError, parse_pipeline
from omnirelay.speculative import SpeculativeConfig
from omnirelay.workers import daemon


def test_vllms_example_parses_with_vllms_defaults():
    config = speculative.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert config == SpeculativeConfig("ngram", 5, prompt_lookup_max=4, prompt_lookup_min=4)
    assert speculative.parse('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig("ngram", 2, 5, 5)
    assert speculative.parse(config.to_json()) == config
    assert speculative.parse("") is None and speculative.parse("null") is None


@pytest.mark.parametrize("text, named", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle' is not served"),
    ('{"method": "mtp", "num_speculative_tokens": 1}', "method 'mtp' is not served"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "method 'draft_model' is not served"),
    ('{"method": "bogus", "num_speculative_tokens": 3}', "unknown method 'bogus'"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "/m"}', "speculative_config.model: not served"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "unknown key 'lookahead'"),
    ('{"method": "ngram"}', "num_speculative_tokens: required"),
    ('{"num_speculative_tokens": 3}', "method: required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min 5 exceeds prompt_lookup_max 2"),
    ('[1]', "expected a JSON object"),
    ("{method: ngram}", "not JSON"),
])
def test_bad_configs_are_refused_by_name(text, named):
    with pytest.raises(ValueError, match="--speculative-config") as info:
        speculative.parse(text)
    assert named in str(info.value)


def test_stage_yaml_takes_the_same_object_and_names_the_entry():
    stages = [{"name": "prefill", "role": "prefill"},
              {"name": "decode", "role": "decode",
               "engine_args": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}}]
    assert parse_pipeline({"stages": stages}).stage_for_role("decode").speculative == SpeculativeConfig("ngram", 4)
    stages[1]["engine_args"]["speculative_config"]["method"] = "suffix"
    with pytest.raises(PipelineError, match=r"stages\[1\].engine_args.speculative_config.method 'suffix' is not"):
        parse_pipeline({"stages": stages})
    stages[0]["engine_args"] = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}
    with pytest.raises(PipelineError, match=r"stages\[0\].engine_args.speculative_config: only decode"):
        parse_pipeline({"stages": stages})


def test_worker_refuses_speculation_where_it_cannot_run(tmp_path):
    (tmp_path / "m").mkdir()
    flag = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']

    def config(*args):
        return daemon.worker_config(daemon.build_parser().parse_args(["--model", str(tmp_path / "m"), *args]))

    with pytest.raises(ValueError, match="--speculative-config: only decode workers speculate, not prefill"):
        config("--role", "prefill", *flag)
    with pytest.raises(ValueError, match="single-process decode worker"):
        config("--role", "decode", "--tensor-parallel-size", "2", *flag)
    assert config("--role", "decode", *flag).speculative == SpeculativeConfig("ngram", 3)
