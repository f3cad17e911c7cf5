"""The connector registry: ``shared_memory`` is registered and created by name with its options,
unknown names and options are refused, and registrations are checked and do not leak between tests."""

from __future__ import annotations

import pytest

from omnirelay.connectors import available_connectors, create_connector, register_connector, registry
from omnirelay.connectors.base import Connector
from omnirelay.connectors.shared_memory import SharedMemoryConnector

from shm_support import no_segments_in_real_dev_shm  # noqa: F401  (autouse fixture)


def test_shared_memory_is_registered():
    assert "shared_memory" in available_connectors()


def test_create_connector_shared_memory(shm_dir):
    c = create_connector("shared_memory", {"shm_dir": shm_dir, "ttl_s": 5})
    try:
        assert isinstance(c, SharedMemoryConnector) and isinstance(c, Connector)
        assert c.ttl_s == 5.0 and c.shm_dir == shm_dir
    finally:
        c.close()


def test_unknown_connector_names_available_ones():
    with pytest.raises(ValueError) as info:
        create_connector("no_such_backend", {})
    assert "no_such_backend" in str(info.value)
    for name in available_connectors():
        assert name in str(info.value)


def test_unknown_option_rejected():
    with pytest.raises(ValueError) as info:
        create_connector("shared_memory", {"bogus": 1})
    assert "bogus" in str(info.value)


def test_shm_dir_must_exist(tmp_path):
    with pytest.raises(ValueError):
        create_connector("shared_memory", {"shm_dir": str(tmp_path / "missing")})


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test go to a copy of the table and vanish afterwards."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))


def test_duplicate_registration_rejected(scratch_registry):
    with pytest.raises(ValueError):
        register_connector("shared_memory", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
    register_connector("test_dummy", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
    with pytest.raises(ValueError):
        register_connector("test_dummy", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
    assert "test_dummy" in available_connectors()


def test_bad_registration_target(scratch_registry):
    with pytest.raises(ValueError):
        register_connector("no_colon", "omnirelay.connectors.shared_memory.SharedMemoryConnector")
    register_connector("not_a_connector", "omnirelay.errors:TransferFailed")
    with pytest.raises(TypeError):
        create_connector("not_a_connector", {})


def test_registry_changes_do_not_leak():
    assert "test_dummy" not in available_connectors()
    assert "not_a_connector" not in available_connectors()
