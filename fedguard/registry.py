"""Decorator registries for the named components of a run.

A component is registered under a name with an optional frozen dataclass of
parameters; the configuration refers to it by that name and sets those
parameters. Unknown names fail with the list of known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class NoParams:
    """Parameters of a component that takes none."""


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered component: its factory, parameter class and summary."""

    name: str
    factory: F
    params: type
    summary: str


class Registry(Generic[F]):
    """Named factories of one kind of component (models, datasets, defenses, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[F]] = {}

    def register(self, name: str, params: type = NoParams) -> Callable[[F], F]:
        """Register the decorated factory under ``name`` with parameters ``params``."""
        if not dataclasses.is_dataclass(params):
            raise TypeError(f"{self.kind} '{name}': params must be a dataclass, got {params!r}")

        def decorator(factory: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            summary = (factory.__doc__ or "").strip().split("\n")[0]
            self._entries[name] = Entry(name, factory, params, summary)
            return factory

        return decorator

    def get(self, name: str) -> Entry[F]:
        """The entry named ``name``; raises ``ValueError`` listing the known names."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def build(self, name: str, *args: Any, params: Any = None) -> Any:
        """Call the factory of ``name`` with ``args`` and ``params`` (its defaults when None)."""
        entry = self.get(name)
        return entry.factory(*args, params if params is not None else entry.params())

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[Entry[F]]:
        """Registered entries, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries
