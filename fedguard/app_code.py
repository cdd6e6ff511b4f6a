"""Objects that Ray ships to its workers, rebuilt there from this app's own code.

A Ray worker puts the folder its driver was started in first on ``sys.path``, ahead of anything a runtime_env
sets (``maybe_initialize_job_config`` in Ray's ``_raylet.pyx``; a runtime_env's ``working_dir`` or ``py_modules``
on one actor cannot be a local folder). Flower's simulation runtime is such a driver, started in the folder of
its SuperLink: under ``flwr run`` the app that runs may be another copy, installed under ``$FLWR_HOME/apps``.
Its ServerApp imports that copy; an object Ray unpickles in a worker would import the SuperLink's copy
instead, with whatever code that holds. ``reduce_in_app`` pickles an object so that the worker first puts
this app's folder (``app_root``) first on its ``sys.path``, then imports what the object needs.

The plugins a process imported (``server.plugins``; ``ship_plugin``) travel too: the worker adds each one's folder
to its ``sys.path`` and imports it before it unpickles, so that a model, a defense or an attack registered outside
this app (a Flower app's own model, ``fedguard.flower``) is known there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def app_root() -> str:
    """The folder this app's packages (fedguard, attackers, clients, strategies) were imported from."""
    return str(Path(__file__).resolve().parents[1])


SHIPPED_PLUGINS: dict[str, str] = {}
"""Plugin module -> the folder it was imported from, for every plugin this process imported."""


def ship_plugin(module: str, file: str | None) -> None:
    """Note the imported plugin ``module`` (its ``__file__``) for the processes objects are shipped to."""
    if file is None:
        return
    path = Path(file).resolve()
    depth = module.count(".") + (2 if path.name == "__init__.py" else 1)
    SHIPPED_PLUGINS[module] = str(path.parents[depth - 1])


def _loader(root: str, plugins: tuple[tuple[str, str], ...]) -> Callable[[bytes], Any]:
    """A function, pickled by value (it is local, and imports only the standard library), that puts ``root``
    first on ``sys.path`` of the process that calls it, imports each ``(module, folder)`` of ``plugins`` from its
    folder (added last), then unpickles ``(function, args)`` and calls it."""

    def load(payload: bytes) -> Any:
        import importlib
        import pickle
        import sys

        if root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)
        for module, folder in plugins:
            if folder not in sys.path:
                sys.path.append(folder)
            importlib.import_module(module)
        function, args = pickle.loads(payload)
        return function(*args)

    return load


def reduce_in_app(function: Callable[..., Any], *args: Any) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
    """A ``__reduce__`` value: the process that unpickles it puts this app's folder first on ``sys.path``, then
    builds ``function(*args)`` from this app's modules (``function`` and ``args`` pickled with cloudpickle)."""
    from ray import cloudpickle

    return _loader(app_root(), tuple(SHIPPED_PLUGINS.items())), (cloudpickle.dumps((function, args)),)


def rebuilt(cls: type[object], state: dict[str, Any]) -> Any:
    """An instance of ``cls`` holding ``state``, as pickle rebuilds an object (no ``__init__``)."""
    instance = cls.__new__(cls)
    instance.__dict__.update(state)
    return instance


class AppCode:
    """Mixin of objects pickled to other processes (the ClientApp Flower ships to its Ray actors): rebuilt
    there from this app's code (``reduce_in_app``)."""

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return reduce_in_app(rebuilt, type(self), vars(self))


class Call(AppCode):
    """``function(*args)``, called later, in the process that unpickles it, with this app's code."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function = function
        self.args = args

    def __call__(self) -> Any:
        return self.function(*self.args)
