"""fedguard: what a server can reconstruct from federated uploads, and which defense stops it.

The Python API (``fedguard.api``): ``run`` and ``run_sweep`` start an experiment or a sweep as the command line
does (``run(..., warm=True)`` in a runtime kept for the process's next runs until ``close()``); ``attack``
attacks a finished run's saved uploads again in this process; ``open_run`` opens what one wrote
(``RunResults``, ``SweepResults``) as pandas DataFrames and arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fedguard.api import RunFailed, RunResults, SweepResults, as_config, attack, close, open_run, run, run_sweep

__all__ = [
    "RunFailed",
    "RunResults",
    "SweepResults",
    "__version__",
    "as_config",
    "attack",
    "close",
    "open_run",
    "run",
    "run_sweep",
]
API = tuple(name for name in __all__ if name != "__version__")


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (``python -m fedguard`` does not load pandas)."""
    if name in API:
        from fedguard import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedguard' has no attribute {name!r}")
