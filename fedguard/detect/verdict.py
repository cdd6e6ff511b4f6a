"""Running the configured detectors on a received model, and what a client reports of them.

A client's report travels in its reply as numbers named ``<detector>.<score>`` and ``<detector>.flagged``
(1 or 0), with ``flagged`` (1 when any detector flagged the model) and ``action`` (what the client did:
``report``, ``skip`` or ``refuse``; ``none`` when nothing was flagged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedguard.detect.base import Detector, Finding, Received

Action = Literal["report", "skip", "refuse"]
ACTIONS: tuple[Action, ...] = ("report", "skip", "refuse")


@dataclass(frozen=True)
class Verdict:
    """The findings of every detector by name, and the action the client takes."""

    findings: dict[str, Finding]
    action: Action

    @property
    def flagged(self) -> bool:
        """Whether any detector flagged the model."""
        return any(f.flagged for f in self.findings.values())

    @property
    def declines(self) -> bool:
        """Whether the client neither trains nor uploads (flagged, and the action is ``skip`` or ``refuse``)."""
        return self.flagged and self.action != "report"

    def row(self) -> dict[str, float | str]:
        """What the client reports: every score, each detector's flag, the overall flag and the action taken."""
        row: dict[str, float | str] = {}
        for name, finding in self.findings.items():
            row.update({f"{name}.{score}": value for score, value in finding.scores.items()})
            row[f"{name}.flagged"] = float(finding.flagged)
        row["flagged"] = float(self.flagged)
        row["action"] = self.action if self.flagged else "none"
        return row


def detect(
    detectors: dict[str, Detector], received: Received, state: dict[str, torch.Tensor], action: Action
) -> Verdict:
    """Run every detector on ``received`` with the detectors' part of the client ``state``; when none flags the
    model, let those that keep a reference remember it in ``state`` (in place)."""
    findings = {name: detector(received, state) for name, detector in detectors.items()}
    verdict = Verdict(findings, action)
    if not verdict.flagged:
        for detector in detectors.values():
            remember = getattr(detector, "remember", None)
            if remember is not None:
                remember(received, state)
    return verdict
