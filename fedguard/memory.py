"""How much memory a run needs at the least, and how much this machine has.

The estimate counts the copies of the model a run surely holds at once, read off the model built on the meta
device (shapes, no values), and one training batch's activations; it leaves out the interpreter, torch and Ray
themselves, so a run it passes may still need a few hundred MB a process more. A run it refuses cannot fit:

- each client training at once (``min(train.clients-per-round, sim.num-cpus // sim.client-cpus)`` on this machine,
  none when ``sim.address`` names a cluster) holds ``CLIENT_COPIES`` copies of the weights (the model, its
  gradient, the parameters it received and the upload it sends) and the activations of one batch, kept for the
  backward pass;
- the server holds the global model and one upload from each client of the round;
- each attack worker holds ``WORKER_COPIES`` (the model and a dummy gradient).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

CLIENT_COPIES = 4
WORKER_COPIES = 2
ACTIVATION_COPIES = 2  # the outputs kept for the backward pass, and their gradients
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True)
class RunMemory:
    """The parts of a run's least memory, in bytes: ``weights`` (parameters and buffers of one model copy),
    ``activations`` (one sample's module outputs in a training forward pass; 0 when the meta device cannot run
    it), and how many of each holder the run has at once."""

    weights: int
    activations: int
    batch: int
    clients: int
    uploads: int
    workers: int

    @property
    def client_bytes(self) -> int:
        """One training client: its copies of the weights and one batch's activations."""
        return CLIENT_COPIES * self.weights + ACTIVATION_COPIES * self.activations * self.batch

    @property
    def total(self) -> int:
        """Every client training at once, the server with one upload per client, and the attack workers."""
        server = (1 + self.uploads) * self.weights
        return self.clients * self.client_bytes + server + self.workers * WORKER_COPIES * self.weights


def model_bytes(net: nn.Module) -> int:
    """Bytes of ``net``'s parameters and buffers (works on the meta device)."""
    tensors = [*net.parameters(), *net.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_bytes(net: nn.Module, shape: tuple[int, ...]) -> int:
    """Bytes of the outputs of ``net``'s leaf modules for one input of ``shape`` (C, H, W), in eval mode on the
    meta device; 0 when a module cannot run there."""
    total = 0

    def count(_module: nn.Module, _inputs: object, output: object) -> None:
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * output.element_size()

    leaves = [m for m in net.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    was_training = net.training
    try:
        with torch.device("meta"), torch.no_grad():
            net.eval()(torch.zeros(1, *shape))
    except (RuntimeError, NotImplementedError, ValueError):
        return 0
    finally:
        for hook in hooks:
            hook.remove()
        net.train(was_training)
    return total


def machine_bytes() -> int:
    """The memory this process may use: the machine's physical memory, or its cgroup's limit when lower."""
    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)


def size_text(count: int) -> str:
    """'10.0 GB', '512 MB', '3.6 TB': ``count`` bytes in decimal units."""
    units = ("B", "kB", "MB", "GB", "TB", "PB")
    value, unit = float(count), 0
    while value >= 1000 and unit < len(units) - 1:
        value, unit = value / 1000, unit + 1
    return f"{value:.0f} {units[unit]}" if unit < 3 else f"{value:.1f} {units[unit]}"
