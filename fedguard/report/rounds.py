"""``rounds.jsonl``: one row per round, written as each round ends, with live progress."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from fedguard.store.folder import JsonlAppender
from fedguard.store.rows import RoundRow


class RoundRecorder:
    """Appends ``{"round", "accuracy", "loss", "seconds"}`` rows and prints progress.

    Round 0 is the initial model. ``seconds`` is the wall time since the
    previous row (training plus evaluation of that round). Each row reaches the
    file as it is written, so a run that stops keeps every finished round; a
    non-finite loss or accuracy is written as strict JSON (``fedguard.store.folder``). A resumed run passes the
    rows already in the file as ``previous``; new rows are appended after them. Each of ``listeners`` is given
    each new row once it is in the file (a tracker).
    """

    def __init__(
        self,
        path: Path,
        total_rounds: int,
        clients_per_round: int,
        out: TextIO | None = None,
        previous: Iterable[RoundRow] = (),
        listeners: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        self.listeners = tuple(listeners)
        self.path = Path(path)
        self.total_rounds = total_rounds
        self.clients_per_round = clients_per_round
        self.out = out or sys.stdout
        self.rows: list[dict[str, Any]] = [dict(row) for row in previous]
        self._start = self._last = time.perf_counter()
        self._file = JsonlAppender(self.path)

    def record(self, round_: int, loss: float, accuracy: float, **extra: Any) -> dict[str, Any]:
        """Write one row and print a progress line; returns the row."""
        now = time.perf_counter()
        row = {"round": round_, "accuracy": accuracy, "loss": loss, "seconds": round(now - self._last, 4), **extra}
        row["at"] = round(time.time(), 3)
        self._last = now
        self.rows.append(row)
        self._file.append(row)
        for listener in self.listeners:
            listener(row)
        self.out.write(self._progress(row) + "\n")
        self.out.flush()
        return row

    def _progress(self, row: dict[str, Any]) -> str:
        done = row["round"]
        who = "initial model" if done == 0 else f"{row.get('clients', self.clients_per_round)} clients"
        line = (
            f"round {done:>{len(str(self.total_rounds))}}/{self.total_rounds} | {who} | "
            f"accuracy {100 * row['accuracy']:5.1f}% | loss {row['loss']:.4f}"
        )
        if done > 0:
            line += f" | {row['seconds']:.1f} s"
        for name, value in row.get("defense", {}).items():
            line += f" | {name} {value:.4g}"
        # The first round pays the start-up of every client process: estimate from the rounds after it.
        recent = [r["seconds"] for r in self.rows if r["round"] > 1][-10:]
        if recent:
            line += f" | about {(self.total_rounds - done) * sum(recent) / len(recent):.0f} s left"
        return line

    def summary(self) -> str:
        """A few lines on how the run went."""
        if not self.rows:
            return "no round finished"
        first, last = self.rows[0], self.rows[-1]
        best = max(self.rows, key=lambda r: r["accuracy"])
        return (
            f"{last['round']} of {self.total_rounds} rounds in {time.perf_counter() - self._start:.1f} s; "
            f"accuracy {100 * first['accuracy']:.1f}% -> {100 * last['accuracy']:.1f}% "
            f"(best {100 * best['accuracy']:.1f}% at round {best['round']}); final loss {last['loss']:.4f}"
        )

    def close(self) -> None:
        """Close the file."""
        self._file.close()
