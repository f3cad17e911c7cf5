"""Request parsing never turns a wrongly typed field into a 500: each case is a client error (4xx)
that names the field. Found by schemathesis sending objects where strings belong."""

from __future__ import annotations

import pytest

from omnirelay.errors import OmniError
from omnirelay.gateway.schema import parse_chat


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("body, param", [
    (_chat(messages=[{"role": "user", "content": [{"type": {}}]}]), "messages[0].content"),
    (_chat(messages=[{"role": "user", "content": [{"type": ["image_url"]}]}]), "messages[0].content"),
    (_chat(modalities=[{}]), "modalities"),
    (_chat(modalities=["text", ["audio"]]), "modalities"),
    (_chat(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": {}}), "audio.format"),
    (_chat(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": ["wav"]}), "audio.format"),
])
def test_wrongly_typed_fields_are_client_errors(body, param):
    with pytest.raises(OmniError) as caught:
        parse_chat(body)
    assert 400 <= caught.value.status < 500 and caught.value.param == param, (caught.value.status, caught.value.param)


@pytest.mark.parametrize("fmt", [{}, ["wav"], 3])
def test_speech_format_of_the_wrong_type_is_a_400(fmt):
    from omnirelay.gateway.routes.speech import _speech_format
    with pytest.raises(OmniError) as caught:
        _speech_format({"response_format": fmt})
    assert caught.value.status == 400 and caught.value.param == "response_format"
