"""The detection table: what the clients' detectors flagged, on honest and on malicious rounds, beside what the
attack behind each manipulation recovered.

A client-round is one client's check of the model it received in one round (an entry of a round's ``detect``
list in ``rounds.jsonl``: ``<detector>.flagged`` per detector). It is malicious when the run's
``threat.malicious`` schedules a manipulation in that round (the server sends it to every client of the
round), honest otherwise. Per detector, and for ``any`` (the union: flagged by at least one), the detection
rate is the share of malicious client-rounds flagged and the false-alarm rate the share of honest ones
flagged, each as k of n with its Wilson 95 % interval (``fedguard.report.statistics.wilson_interval``). Per
manipulation and round, the same counts beside the images its attack recovered: the share of the scored
images of ``attacks.jsonl`` rows of that manipulation and round with SSIM above ``RECOVERED_SSIM``. Per setting of
a sweep (``[sweep.settings]``: protocol, server strategy), the detector rates of its runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedguard.config import ConfigError, parse_schedule
from fedguard.report.leakage import RECOVERED_SSIM
from fedguard.report.recorded import read_recorded_config
from fedguard.report.statistics import wilson_interval
from fedguard.store.folder import RUNS_FILE
from fedguard.store.invocations import own_rows
from fedguard.store.rows import AttackRow, RoundRow, read_attacks, read_cells, read_rounds

HONEST = "honest"  # the manipulation of an honest client-round
ANY = "any"  # the union of the detectors
HEADING = "Detection"  # the table's section title in summary.md
FLAGGED = ".flagged"  # suffix of a detector's flag among a client's findings


@dataclass(frozen=True)
class ClientRound:
    """One client's findings on the model of one round: the ``manipulation`` sent (``HONEST`` for none),
    per detector whether it flagged the model, and the sweep ``setting`` of its run ("" outside a sweep)."""

    manipulation: str
    round: int
    client: int
    flags: dict[str, bool]
    setting: str = ""


@dataclass(frozen=True)
class Rate:
    """``k`` of ``n`` with the Wilson 95 % interval [low, high] of k / n (None when n is 0)."""

    k: int
    n: int
    ci95: list[float] | None

    @property
    def share(self) -> float | None:
        """k / n, None when n is 0."""
        return self.k / self.n if self.n else None


@dataclass(frozen=True)
class DetectorRow:
    """A detector's (or ``any``'s) ``detected`` malicious and ``false_alarms`` honest client-rounds."""

    detector: str
    detected: Rate
    false_alarms: Rate


@dataclass(frozen=True)
class ManipulationRow:
    """The malicious client-rounds of one manipulation in one round: how many, those ``flagged`` per detector
    (and ``any``), and the attack's ``recovered`` images (SSIM above ``RECOVERED_SSIM``) of those it scored."""

    manipulation: str
    round: int
    client_rounds: int
    flagged: dict[str, Rate]
    recovered: Rate


def rate(k: int, n: int) -> Rate:
    """``k`` of ``n`` with its interval."""
    return Rate(k, n, wilson_interval(k, n) if n else None)


def client_rounds(rounds: list[RoundRow], schedule: dict[int, str], setting: str = "") -> list[ClientRound]:
    """The client-rounds of one run's ``rounds.jsonl`` rows, malicious where ``schedule`` (round -> manipulation,
    ``fedguard.config.parse_schedule``) names a manipulation; ``setting``: the run's sweep setting."""
    return [
        ClientRound(
            schedule.get(row["round"], HONEST),
            row["round"],
            int(entry["client"]),
            {key[: -len(FLAGGED)]: bool(value) for key, value in entry.items() if key.endswith(FLAGGED)},
            setting,
        )
        for row in rounds
        for entry in row.get("detect") or []
    ]


def detectors(found: list[ClientRound]) -> list[str]:
    """The detectors that scored any of ``found``, in order of appearance, then ``ANY``; empty when none did."""
    names = list(dict.fromkeys(name for c in found for name in c.flags))
    return [*names, ANY] if names else []


def flagged(c: ClientRound, detector: str) -> bool:
    """Whether ``detector`` (or ``ANY``: one of them) flagged the client-round ``c``."""
    return any(c.flags.values()) if detector == ANY else c.flags.get(detector, False)


def detector_rows(found: list[ClientRound]) -> list[DetectorRow]:
    """Per detector and ``ANY``: its detection rate on the malicious client-rounds and false-alarm rate on the
    honest ones."""
    malicious = [c for c in found if c.manipulation != HONEST]
    honest = [c for c in found if c.manipulation == HONEST]
    return [
        DetectorRow(
            name,
            rate(sum(flagged(c, name) for c in malicious), len(malicious)),
            rate(sum(flagged(c, name) for c in honest), len(honest)),
        )
        for name in detectors(found)
    ]


def detected(found: list[ClientRound]) -> Rate | None:
    """The malicious client-rounds of ``found`` that any detector flagged; None where no malicious one was checked."""
    malicious = [c for c in found if c.manipulation != HONEST]
    return rate(sum(flagged(c, ANY) for c in malicious), len(malicious)) if malicious else None


def setting_rows(found: list[ClientRound]) -> dict[str, list[DetectorRow]]:
    """Per sweep setting, in order of appearance: ``detector_rows`` of its client-rounds alone."""
    settings = dict.fromkeys(c.setting for c in found)
    return {s: detector_rows([c for c in found if c.setting == s]) for s in settings}


def recovered_images(attacks: list[AttackRow], manipulation: str, round_: int) -> Rate:
    """The images above ``RECOVERED_SSIM`` among those scored by the ``attacks.jsonl`` rows (status 'ok') of
    ``manipulation`` in round ``round_``."""
    scores = [
        image.get("ssim")
        for row in attacks
        if row.get("status") == "ok" and row.get("manipulation") == manipulation and row.get("round") == round_
        for image in row.get("per_image") or []
    ]
    kept = [s for s in scores if isinstance(s, (int, float))]
    return rate(sum(s > RECOVERED_SSIM for s in kept), len(kept))


def manipulation_rows(found: list[ClientRound], attacks: list[AttackRow]) -> list[ManipulationRow]:
    """Per (manipulation, round) of the malicious client-rounds, in order of appearance: the detectors' counts
    and the images its attack recovered."""
    names = detectors(found)
    keys = dict.fromkeys((c.manipulation, c.round) for c in found if c.manipulation != HONEST)
    rows = []
    for manipulation, round_ in keys:
        group = [c for c in found if (c.manipulation, c.round) == (manipulation, round_)]
        counts = {name: rate(sum(flagged(c, name) for c in group), len(group)) for name in names}
        rows.append(
            ManipulationRow(manipulation, round_, len(group), counts, recovered_images(attacks, manipulation, round_))
        )
    return rows


def run_findings(folder: Path, setting: str = "") -> tuple[list[ClientRound], list[AttackRow]]:
    """(the client-rounds, the ``attacks.jsonl`` rows) of the run in ``folder`` (of sweep setting ``setting``),
    its schedule read from its ``config.toml``; none of either when its clients ran no detector, or when that file
    is missing or unreadable (which rounds were malicious is unknown)."""
    rounds = read_rounds(folder)
    if not any(row.get("detect") for row in rounds):
        return [], []
    try:
        malicious = str(read_recorded_config(folder).value("threat.malicious", ""))
    except ConfigError:
        return [], []
    return client_rounds(rounds, parse_schedule(malicious), setting), own_rows(read_attacks(folder))


def pooled_findings(runs: list[tuple[str, Path]]) -> tuple[list[ClientRound], list[AttackRow]]:
    """``run_findings`` of every (setting, run folder), pooled."""
    found: list[ClientRound] = []
    attacks: list[AttackRow] = []
    for setting, folder in runs:
        more, rows = run_findings(folder, setting)
        found += more
        attacks += rows
    return found, attacks


def completed_runs(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, Path]]:
    """(setting, folder) of the ``runs.jsonl`` rows of status 'ok'."""
    return [(str(row.get("setting", "")), Path(row["folder"])) for row in rows if row.get("status") == "ok"]


def sweep_runs(folder: Path) -> list[tuple[str, Path]]:
    """(setting, folder) of the completed runs of the sweep in ``folder``; raises ``FileNotFoundError`` when it
    holds no ``runs.jsonl``."""
    runs = folder / RUNS_FILE
    if not runs.is_file():
        raise FileNotFoundError(f"{runs} not found: is {folder} the folder of a finished fedguard sweep?")
    return completed_runs(read_cells(folder, RUNS_FILE))


def _count(r: Rate) -> str:
    return "-" if r.share is None else f"{r.k} of {r.n} ({100 * r.share:.0f}%)"


def _interval(r: Rate) -> str:
    return "-" if r.ci95 is None else f"[{100 * r.ci95[0]:.0f}, {100 * r.ci95[1]:.0f}]%"


RATE_COLUMNS = "detected (malicious client-rounds) | 95% CI | false alarms (honest client-rounds) | 95% CI"


def _rates(row: DetectorRow) -> str:
    return (
        f"{_count(row.detected)} | {_interval(row.detected)} | {_count(row.false_alarms)} "
        f"| {_interval(row.false_alarms)}"
    )


def detector_lines(found: list[ClientRound]) -> list[str]:
    """Markdown: the rates per detector over every client-round."""
    lines = [f"| detector | {RATE_COLUMNS} |", "|---|---|---|---|---|"]
    return lines + [f"| {row.detector} | {_rates(row)} |" for row in detector_rows(found)]


def setting_lines(found: list[ClientRound]) -> list[str]:
    """Markdown: the rates per sweep setting and detector; none when the client-rounds are of one setting."""
    per_setting = setting_rows(found)
    if len(per_setting) < 2:
        return []
    lines = ["Per setting:", "", f"| setting | detector | {RATE_COLUMNS} |", "|---|---|---|---|---|---|"]
    for setting, rows in per_setting.items():
        lines += [f"| {setting} | {row.detector} | {_rates(row)} |" for row in rows]
    return ["", *lines]


def manipulation_lines(found: list[ClientRound], attacks: list[AttackRow]) -> list[str]:
    """Markdown: per manipulation and round, the client-rounds each detector flagged and the images recovered."""
    names = detectors(found)
    lines = [
        f"| manipulation | round | {' | '.join(f'flagged by {n}' for n in names)} | images SSIM > {RECOVERED_SSIM} |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for m in manipulation_rows(found, attacks):
        cells = " | ".join(_count(m.flagged[n]) for n in names)
        lines.append(f"| {m.manipulation} | {m.round} | {cells} | {_count(m.recovered)} |")
    return lines


def detection_table(found: list[ClientRound], attacks: list[AttackRow]) -> str:
    """Markdown: the rates per detector, per setting (when there are several), then per manipulation and round
    with its attack's recovered images; empty when no client-round was scored."""
    if not found:
        return ""
    lines = [
        f"## {HEADING}",
        "",
        *detector_lines(found),
        *setting_lines(found),
        "",
        *manipulation_lines(found, attacks),
    ]
    return "\n".join(lines) + "\n"
