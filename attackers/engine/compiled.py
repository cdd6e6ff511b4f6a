"""``torch.compile`` of the engine's per-iteration functions, where it pays.

Eager ``torch.func`` code spends most of a small model's iteration dispatching
operators; compiled, the same maths runs as a few fused kernels (IG on the DLG
LeNet, 2 CPU threads: 5.2 -> 1.9 ms per iteration for 8 jobs, 4.2 -> 0.9 ms for
one). Compiling costs seconds (tracing, and on a cold cache generating and
building kernels: 10-30 s on 2 cores; Inductor's on-disk cache makes a later
process's compile of the same program about 2 s), so ``auto`` compiles only
searches of at least ``AUTO_MIN_ITERATIONS`` iterations on a device with a
compiler (CPU: a C++ compiler on PATH; CUDA: triton and a C compiler) and never when
``FEDGUARD_COMPILE=off``, nor ``bfloat16`` searches on the CPU (Inductor's C++
kernels for the gradient-matching gradient in bfloat16 fail to build on torch
2.14.1: conflicting declarations). ``on`` always compiles, ``off`` never. A
program ``auto`` cannot compile runs eager, with one warning per search kind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

AUTO_MIN_ITERATIONS = 500
ENV = "FEDGUARD_COMPILE"
F = TypeVar("F", bound=Callable[..., object])
_failed: set[object] = set()
_cached: list[object] = []  # the kind of search whose programs dynamo's in-memory cache holds


def compiler_available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can build kernels for ``device``: triton and a C compiler (for its launcher)
    on CUDA, a C++ compiler on the CPU."""
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None and any(
            shutil.which(c) for c in (os.environ.get("CC", ""), "gcc", "cc", "clang") if c
        )
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


def compiles(mode: str, device: torch.device, iterations: int, key: object = None, precision: str = "float32") -> bool:
    """Whether a search of ``iterations`` in ``precision`` on ``device`` in ``mode`` compiles (``key``: its
    kind, for the memo of failures)."""
    if mode == "auto":
        return (
            os.environ.get(ENV, "auto") != "off"
            and iterations >= AUTO_MIN_ITERATIONS
            and not (precision == "bfloat16" and device.type == "cpu")
            and key not in _failed
            and compiler_available(device)
        )
    return mode == "on"


class Compiler:
    """Wraps the functions of one search: compiled (``enabled``) or as they are; ``mode`` is one of
    ``attackers.base.COMPILE_MODES``, checked with the search's other parameters.

    ``key`` names the kind of search (a ``SearchSpec`` without its iteration count, and the shape of its
    variable) for the memo of programs that failed to compile under ``auto``. Consecutive searches of one kind
    reuse the compiled programs (their closures' tensors are the programs' inputs, guarded by shape); a search
    of another kind empties dynamo's cache first, so that it never fills up (past its limit dynamo would run
    the rest of the process eager)."""

    def __init__(
        self, mode: str, device: torch.device, iterations: int, key: object, precision: str = "float32"
    ) -> None:
        self.strict, self.key = mode == "on", key
        self.enabled = compiles(mode, device, iterations, key, precision)
        if self.enabled and _cached != [key]:
            torch._dynamo.reset()
            _cached[:] = [key]

    def __call__(self, fn: F) -> F:
        if not self.enabled:
            return fn
        compiled = torch.compile(fn, dynamic=False)
        if self.strict:
            return compiled  # type: ignore[return-value]
        state = {"fn": compiled}

        def guarded(*args: object) -> object:
            try:
                return state["fn"](*args)
            except Exception as error:  # any compiler failure falls back to eager under 'auto'
                if state["fn"] is fn:
                    raise
                _failed.add(self.key)
                warnings.warn(
                    f"torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0][:200]});"
                    f" this search runs eager (compile = 'off' skips the attempt)",
                    stacklevel=2,
                )
                state["fn"] = fn
                return fn(*args)

        return guarded  # type: ignore[return-value]
