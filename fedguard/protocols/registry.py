"""The protocols by name (``train.protocol``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fedguard.registry import Registry

if TYPE_CHECKING:
    from fedguard.protocols.base import Protocol

P = TypeVar("P", bound="type[Protocol]")
PROTOCOLS: Registry[Callable[..., Protocol]] = Registry("protocol")


def register_protocol(name: str) -> Callable[[P], P]:
    """Register the decorated ``Protocol`` subclass under ``name`` (its docstring's first line is its summary)."""

    def decorator(cls: P) -> P:
        cls.name = name

        def build(_params: object) -> Protocol:
            return cls()

        build.__doc__ = cls.__doc__
        PROTOCOLS.register(name)(build)
        return cls

    return decorator


def protocol(name: str) -> Protocol:
    """The protocol registered as ``name``; ``ValueError`` naming the registered ones otherwise."""
    return PROTOCOLS.build(name)
