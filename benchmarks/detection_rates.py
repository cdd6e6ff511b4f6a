"""The detection table of a finished sweep whose clients ran detectors (e.g. ``experiments/detection.toml``):
per detector its detection rate on malicious client-rounds and false-alarm rate on honest ones (k of n, Wilson
95 % interval), the same per sweep setting, per manipulation and round beside the images its attack recovered
(``fedguard.report.detection``). The sweep's ``summary.md`` holds the same table.

    .venv/bin/python benchmarks/detection_rates.py runs/detection
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedguard.report.detection import detection_table, pooled_findings, sweep_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="the folder of a finished fedguard sweep")
    folder = parser.parse_args().sweep
    table = detection_table(*pooled_findings(sweep_runs(folder)))
    print(table or f"no run in {folder} recorded detector findings (detect.name = none?)")


if __name__ == "__main__":
    main()
