"""The speech facts of a served model (gateway/speech_facts.py) are read from its directory once, when
the model is loaded: what the spoken paths judge by does not change with the files afterwards, and
each kind of directory gives its own voices and codes per second."""

from __future__ import annotations

import json

from omnirelay.gateway.speech_facts import CODES_PER_SECOND, SpeechFacts

TTS_CONFIG = {"model_type": "qwen3_tts", "tokenizer_type": "qwen3_tts_tokenizer_12hz",
              "tts_model_type": "custom_voice", "talker_config": {"spk_id": {"vivian": 3000, "aiden": 3001}}}


def test_an_omni_directory_speaks_its_speaker_table_and_is_read_once(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    (tmp_path / "spk_dict.json").write_text(json.dumps({"Ethan": {}, "Chelsie": {}}))
    facts = SpeechFacts.read(str(tmp_path))
    assert facts == SpeechFacts(("Chelsie", "Ethan"), True, CODES_PER_SECOND)
    (tmp_path / "spk_dict.json").unlink()   # the files change after loading: the facts do not
    assert facts.voices == ("Chelsie", "Ethan") and facts.has_speakers
    assert SpeechFacts.read(str(tmp_path)) == SpeechFacts(None, False, CODES_PER_SECOND)


def test_a_pickled_speaker_table_speaks_with_voices_left_to_the_worker(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    (tmp_path / "spk_dict.pt").write_bytes(b"")
    assert SpeechFacts.read(str(tmp_path)) == SpeechFacts(None, True, CODES_PER_SECOND)


def test_a_qwen3_tts_directory_has_its_speakers_and_its_codec_rate(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TTS_CONFIG))
    (tmp_path / "speech_tokenizer").mkdir()
    (tmp_path / "speech_tokenizer" / "config.json").write_text(
        json.dumps({"output_sample_rate": 24000, "decode_upsample_rate": 1920}))
    assert SpeechFacts.read(str(tmp_path)) == SpeechFacts(("aiden", "vivian"), True, 12.5)


def test_a_text_model_does_not_speak(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not SpeechFacts.read(str(tmp_path)).has_speakers
