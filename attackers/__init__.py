"""The server-side attacker: sinks that receive captured observations.

Nothing here imports Flower; strategies hand ``fedguard.observation.Observation``
objects to an ``ObservationSink``.
"""

from attackers.sinks import DiskSink, ObservationSink

__all__ = ["DiskSink", "ObservationSink"]
