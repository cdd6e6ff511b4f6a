"""A defense of one's own, outside the fedguard package: upload only the sign of each gradient entry.

Each client sends ``scale * sign(g)`` for every entry of its gradient (signSGD's message, scaled so that the
server's step of ``train.lr`` stays near the plain one's): one bit of each entry leaves the client, and its
magnitude never does. Not a privacy guarantee: the signs still carry the gradient's structure.

Select it from the configuration (the module must be importable: this repository's root is)::

    fedguard run experiments/quickstart.toml --set server.plugins=extensions.sign_upload \\
        --set defense.name=sign --set defense.sign.scale=0.01
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedguard.defenses import Defense, LocalStep, register_defense


@dataclass(frozen=True)
class SignParams:
    """The sign of each gradient entry, times a scale"""

    scale: float = field(default=0.01, metadata={"help": "size of every uploaded entry (the sign times it)"})

    def __post_init__(self) -> None:
        if not 0 < self.scale < 1e6:
            raise ValueError(f"scale = {self.scale!r}: must be > 0 and < 1e6")


@register_defense("sign", params=SignParams)
def build_sign(params: SignParams) -> Defense:
    """Upload scale * sign(g) for each gradient entry g"""

    def defend(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [params.scale * g.sign() for g in step.grads]

    return defend
