"""Qwen3-TTS without loading it (default tier): what a directory is planned as, which checkpoints the
worker refuses before any of the package's code runs, and the gateway's voices from ``config.json``.
The served model end to end is in test_qwen3_tts.py (slow)."""

from __future__ import annotations

import json

import pytest

from omnirelay.pipeline import load_pipeline
from omnirelay.deploy.served_models import bundled_pipeline
from omnirelay.model_kind import model_kind
from omnirelay.gateway.speech_facts import qwen3_tts_speakers
from omnirelay.workers.speech.qwen3_tts_package import check_supported

CONFIG = {"model_type": "qwen3_tts", "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_type": "custom_voice",
          "talker_config": {"spk_id": {"vivian": 3000, "aiden": 3001}, "text_vocab_size": 151936}}


def test_a_qwen3_tts_directory_is_one_generate_stage(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert model_kind(str(tmp_path)) == "qwen3-tts"
    pipeline = load_pipeline(bundled_pipeline("qwen3-tts"))
    assert pipeline.roles == ("generate",) and not pipeline.connectors
    assert qwen3_tts_speakers(str(tmp_path)) == ["aiden", "vivian"]


def test_other_models_have_no_qwen3_tts_speakers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert qwen3_tts_speakers(str(tmp_path)) is None and model_kind(str(tmp_path)) != "qwen3-tts"


@pytest.mark.parametrize("change, match", [({"tokenizer_type": "qwen3_tts_tokenizer_25hz"}, "12Hz"),
                                           ({"tts_model_type": "base"}, "custom_voice")])
def test_unserved_checkpoints_are_refused_by_their_config(change, match):
    with pytest.raises(ValueError, match=match):
        check_supported({**CONFIG, **change})
    check_supported(CONFIG)
