"""A client that failed its round, as the server records it: the client, its node and a one-line reason read out
of the error Flower relays (for a ClientApp that raised in a Ray actor, a traceback wrapped in Ray's and
Flower's own exceptions)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FAILURE_CHARS = 1000  # the most of a reason a round's row keeps
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): ?(.*)$")
FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
WRAPPERS = ("ClientAppException", "RayTaskError", "RayActorError")  # what the simulation wraps an exception in
DEATHS = re.compile(r"\b(ActorDiedError|ActorUnavailableError)\b")  # Ray's word for a client process that died


def reason_line(reason: str | None) -> str:
    """The exception a relayed error reason ends in, with the frame that raised it (``ValueError: broke (at
    defense.py:13 in defend)``); the reason as sent, without colour codes, where it holds no traceback; at most
    ``FAILURE_CHARS`` characters (its end)."""
    text = ANSI.sub("", reason or "").strip() or "no reason given"
    if death := DEATHS.search(text):  # a simulated client's process is started again (fedguard.runtime.actor_restarts)
        return f"the client's process died ({death.group(1)}); it is started again for its next round"
    lines = text.splitlines()
    raised = [i for i, line in enumerate(lines) if (m := EXCEPTION_LINE.match(line)) and not _wrapper(m.group(1))]
    if raised:
        at = raised[0]  # Python prints the cause before what it caused
        frames = [m for line in lines[:at] if (m := FRAME_LINE.match(line))]
        where = f" (at {frames[-1].group(1)}:{frames[-1].group(2)} in {frames[-1].group(3)})" if frames else ""
        text = lines[at].strip() + where
    return text if len(text) <= FAILURE_CHARS else "..." + text[-FAILURE_CHARS:]


def _wrapper(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in WRAPPERS


@dataclass(frozen=True)
class ClientFailure:
    """One client that failed its round (its ClientApp raised, or its process died): the client the server assigned
    to its node (None for a node it assigned none), the node, and the reason (``reason_line``)."""

    client: int | None
    node: int
    reason: str

    @classmethod
    def of(cls, client: int | None, node: int, reason: str | None) -> ClientFailure:
        return cls(client, node, reason_line(reason))

    def row(self) -> dict[str, Any]:
        """The entry of ``failed`` in the round's row of ``rounds.jsonl``."""
        return {"client": self.client, "node": self.node, "reason": self.reason}

    def __str__(self) -> str:
        return f"client {'?' if self.client is None else self.client} (node {self.node}): {self.reason}"
