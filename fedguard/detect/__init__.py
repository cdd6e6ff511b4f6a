"""Client-side detectors of a malicious server, by name. Importing this package registers them all.

A client runs the configured detectors (``detect.name``) on every model it receives, before training on it,
and reports what they found; per ``detect.action`` a flagged model is trained on anyway (``report``), answered
with an empty update (``skip``) or refused (``refuse``). Nothing here imports Flower or Ray.
"""

from fedguard.detect import drift, dsnr, structure  # noqa: F401  (registration)
from fedguard.detect.base import (
    DETECTORS,
    STATE_PREFIX,
    Detector,
    Finding,
    Received,
    build_detector,
    register_detector,
)
from fedguard.detect.verdict import ACTIONS, Action, Verdict, detect

__all__ = [
    "ACTIONS",
    "DETECTORS",
    "STATE_PREFIX",
    "Action",
    "Detector",
    "Finding",
    "Received",
    "Verdict",
    "build_detector",
    "detect",
    "register_detector",
]
