"""The data plane. ``create_connector(name, config)`` is the only way to get a backend; see
:mod:`omnirelay.connectors.base` for the contract every backend honours."""

from .base import Connector, ConnectorWrapper, Handle, Payload
from .registry import available_connectors, create_connector, register_connector

__all__ = ["Connector", "ConnectorWrapper", "Handle", "Payload", "available_connectors", "create_connector", "register_connector"]
