"""Lazy registry of connector backends: name → ``"module:Class"``; a backend's imports run only
when it is chosen, so a host without Redis, Mooncake or Yuanrong libraries can still use shared memory."""

from __future__ import annotations

import importlib

from .base import Connector

_BACKENDS: dict[str, str] = {}


def register_connector(name: str, target: str) -> None:
    """Register ``target`` (``"package.module:ClassName"``) under ``name``; duplicates are errors."""
    if name in _BACKENDS:
        raise ValueError(f"connector {name!r} is already registered ({_BACKENDS[name]})")
    if ":" not in target:
        raise ValueError(f"connector target must be 'module:Class', got {target!r}")
    _BACKENDS[name] = target


def available_connectors() -> list[str]:
    return sorted(_BACKENDS)


def create_connector(name: str, config: dict | None = None) -> Connector:
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown connector {name!r}; available: {', '.join(available_connectors())}") from None
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise TypeError(f"{target} is not a Connector")
    return cls(config or {})


register_connector("shared_memory", "omnirelay.connectors.shared_memory:SharedMemoryConnector")
register_connector("redis", "omnirelay.connectors.redis:RedisConnector")
register_connector("mooncake_transfer_engine", "omnirelay.connectors.mooncake_transfer_engine:MooncakeTEConnector")
register_connector("mooncake_store", "omnirelay.connectors.mooncake_store:MooncakeStoreConnector")
register_connector("yuanrong", "omnirelay.connectors.yuanrong:YuanrongConnector")
register_connector("fault_injection", "omnirelay.connectors.fault_injection:FaultInjectionConnector")
