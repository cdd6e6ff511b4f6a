"""Decorator registries for the named components of a run.

A component is registered under a name with an optional frozen dataclass of
parameters; the configuration refers to it by that name and sets those
parameters. Unknown names fail with the list of known ones. A kind may also
ask each entry for ``traits``: a pure function of the parameters declaring
what the configuration checks (what an attack needs, which protocols a
defense supports, ...) without building the component or loading any file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, Generic, TypeVar


class TrainedFileError(ValueError):
    """A trained file that cannot be used: the message names it, what is wrong and the command that makes one."""


class MissingTrainedFile(TrainedFileError, FileNotFoundError):
    """Nothing at a trained file's path."""


F = TypeVar("F", bound=Callable[..., Any])
Traits = Callable[[Any], Any]


@dataclass(frozen=True)
class NoParams:
    """Parameters of a component that takes none."""


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered component: its factory, parameter class, summary and traits (None: declares none)."""

    name: str
    factory: F
    params: type
    summary: str
    traits: Traits | None = None


@dataclass(frozen=True)
class RequiredFile:
    """A file a component loads: its parameter ``param`` names it and ``path`` is that parameter's value;
    ``unset`` explains an empty ``path``, ``missing`` a ``path`` with no file (each with the command that makes
    it); ``load(path)`` reads and checks the file as the component does, raising ``TrainedFileError``;
    ``fits(loaded, spec)`` raises ``TrainedFileError`` when the loaded file cannot serve data of ``spec`` (a
    ``DataSpec``; None: any data)."""

    param: str
    path: str
    unset: str
    missing: str
    load: Callable[[str], Any]
    fits: Callable[[Any, Any], None] | None = None

    def unusable(self, spec: Any = None) -> TrainedFileError | None:
        """Why the file at ``path`` cannot be used (``load`` refuses it, or ``fits`` refuses it for data of
        ``spec`` when given); None when it loads and fits, or is missing."""
        try:
            loaded = self.load(self.path)
            if spec is not None and self.fits is not None:
                self.fits(loaded, spec)
        except MissingTrainedFile:
            return None
        except TrainedFileError as error:
            return error
        return None


_FIELD_MARK = re.compile(r"``(\w+)``:\s*")
_LITERAL = re.compile(r"``([^`]+)``")


def field_help(params: type, name: str) -> str:
    """The one-line help of field ``name`` of the parameter dataclass ``params``: its ``help`` metadata, else its
    description in the docstring of the class or of the first class it inherits the field from, written
    ``name``: text, up to the next field described so; else the docstring's first line. Field names read as keys
    (``noise_multiplier`` -> noise-multiplier)."""
    fields = {f.name: f for f in dataclasses.fields(params)}
    if fields[name].metadata.get("help"):
        return fields[name].metadata["help"]
    for cls in params.__mro__:
        doc = cls.__doc__ or ""
        marks = [m for m in _FIELD_MARK.finditer(doc) if m.group(1) in fields]
        for mark, after in zip(marks, marks[1:] + [None]):
            if mark.group(1) == name:
                return _plain(doc[mark.end() : after.start() if after else len(doc)], fields)
    return _plain((params.__doc__ or "").strip().split("\n")[0], fields)


def _plain(text: str, fields: Container[str]) -> str:
    """``text`` on one line, without literal quotes or a trailing separator; field names as keys."""
    text = _LITERAL.sub(lambda m: m.group(1).replace("_", "-") if m.group(1) in fields else m.group(1), text)
    return " ".join(text.split()).rstrip(";,. ")


class Registry(Generic[F]):
    """Named factories of one kind of component (models, datasets, defenses, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[F]] = {}

    def register(self, name: str, params: type = NoParams, traits: Traits | None = None) -> Callable[[F], F]:
        """Register the decorated factory under ``name`` with parameters ``params`` and ``traits(params)``."""
        if not dataclasses.is_dataclass(params):
            raise TypeError(f"{self.kind} '{name}': params must be a dataclass, got {params!r}")

        def decorator(factory: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            summary = (factory.__doc__ or "").strip().split("\n")[0]
            self._entries[name] = Entry(name, factory, params, summary, traits)
            return factory

        return decorator

    def get(self, name: str) -> Entry[F]:
        """The entry named ``name``; raises ``ValueError`` listing the known names."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}") from None

    def build(self, name: str, *args: Any, params: Any = None) -> Any:
        """Call the factory of ``name`` with ``args`` and ``params`` (its defaults when None)."""
        entry = self.get(name)
        return entry.factory(*args, params if params is not None else entry.params())

    def traits(self, name: str, params: Any = None) -> Any:
        """What ``name`` declares for ``params`` (its defaults when None); nothing is built."""
        entry = self.get(name)
        if entry.traits is None:
            raise TypeError(f"{self.kind} {name!r} declares no traits: register it with traits=...")
        return entry.traits(params if params is not None else entry.params())

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[Entry[F]]:
        """Registered entries, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries
