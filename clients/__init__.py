"""Flower clients: local training wrapped by the defense middleware."""

from clients.defended_client import DefendedClient

__all__ = ["DefendedClient"]
