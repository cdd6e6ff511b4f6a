"""The wheels ``make gpu-check`` needs on a machine without network: download them into one folder.

Downloads every pin of ``benchmarks/gpu_check_wheels.txt`` as a wheel for CPython ``--python-version`` on
x86-64 Linux, without dependencies (the list names each one), into ``--dest`` (default ``.whl/``, which git
ignores), after removing the wheels already there. Source-only releases are built into wheels here. Ray's
wheel (74 MB) is repacked to fit a 64 MiB transfer: the Java workers' jar, the dashboard's web page and the
libraries Flower's simulation never imports (RLlib, Serve, Tune, Train, Data, LLM) are left out, and every
file is stored LZMA-compressed, which pip unpacks like any wheel (25 MB in all). Prints each file's size and
the total in MiB.

    make gpu-wheels
    python3 benchmarks/gpu_wheels.py [--python-version 3.12] [--dest .whl]

On the GPU machine: ``python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site`` (docs/how-to/gpu-check.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PINS = HERE / "gpu_check_wheels.txt"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
SOURCE_ONLY = ("antlr4-python3-runtime",)  # no wheel on PyPI: built with `pip wheel`
RAY_LEFT_OUT = (
    "ray/jars/",
    "ray/dashboard/client/build/",
    "ray/rllib/",
    "ray/serve/",
    "ray/tune/",
    "ray/train/",
    "ray/data/",
    "ray/llm/",
)
MIB = 2**20


def read_pins(path: Path = PINS) -> list[str]:
    """The ``name==version`` lines of ``path``, comments and blank lines left out."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def pip(*args: str) -> None:
    """Run ``python -m pip`` with ``args``; exit with its message when it fails."""
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])
    if done.returncode != 0:
        sys.exit(f"pip {' '.join(args[:2])} ... failed (exit {done.returncode})")


def download(pins: list[str], dest: Path, python_version: str) -> None:
    """Wheels of ``pins`` for CPython ``python_version`` on x86-64 Linux into ``dest``; source-only releases
    are built into wheels."""
    built = [pin for pin in pins if pin.split("==")[0] in SOURCE_ONLY]
    binary = [pin for pin in pins if pin not in built]
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    pip(
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "--dest",
        str(dest),
        *binary,
    )
    if built:
        pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest), *built)


def repack_ray(wheel: Path) -> None:
    """Rewrite ray's ``wheel`` in place without ``RAY_LEFT_OUT`` (nor their lines of RECORD), LZMA-compressed."""
    packed = wheel.with_suffix(".repacking")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_LZMA) as target:
        for item in source.infolist():
            if item.filename.startswith(RAY_LEFT_OUT):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not line.startswith(RAY_LEFT_OUT)]
                data = ("\n".join(kept) + "\n").encode()
            item.compress_type = zipfile.ZIP_LZMA
            target.writestr(item, data)
    packed.replace(wheel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--dest", type=Path, default=HERE.parent / ".whl", help="output folder (default .whl/)")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):
        old.unlink()
    download(read_pins(), args.dest, args.python_version)
    for wheel in args.dest.glob("ray-*.whl"):
        repack_ray(wheel)
    wheels = sorted(args.dest.glob("*.whl"), key=lambda w: w.stat().st_size, reverse=True)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / MIB:7.2f} MiB  {wheel.name}")
    print(f"{sum(w.stat().st_size for w in wheels) / MIB:7.2f} MiB in {len(wheels)} wheels in {args.dest}")


if __name__ == "__main__":
    main()
