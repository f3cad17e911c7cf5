"""A diffusers directory may state its own native size in ``model_index.json``
(:data:`omnirelay.dit_families.NATIVE_SIZE_KEY`); one its family cannot make is refused."""

from __future__ import annotations

import json

import pytest

from omnirelay.dit_families import NATIVE_SIZE_KEY, family_of_dir


def _directory(tmp_path, **index):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", **index}))
    return tmp_path


def test_a_stated_native_size_replaces_the_familys(tmp_path):
    assert family_of_dir(_directory(tmp_path)).native_size == (832, 480)
    assert family_of_dir(_directory(tmp_path, **{NATIVE_SIZE_KEY: [416, 240]})).native_size == (416, 240)


@pytest.mark.parametrize("stated", [[420, 240], [416], "416x240", [0, 240]])
def test_a_native_size_the_family_cannot_make_is_refused(tmp_path, stated):
    with pytest.raises(ValueError, match=NATIVE_SIZE_KEY):
        family_of_dir(_directory(tmp_path, **{NATIVE_SIZE_KEY: stated}))
