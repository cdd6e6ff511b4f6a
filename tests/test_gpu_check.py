"""benchmarks/gpu_check.py and gpu_wheels.py: a part past its limit is stopped with what it started, the
summary lists every part, and Ray's repacked wheel leaves out what it names and keeps the rest intact."""

from __future__ import annotations

import os
import sys
import time
import zipfile
from pathlib import Path

from tests.benchmark_module import load_benchmark


def _gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` has ended within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_part_past_its_limit_is_stopped_with_the_process_it_started(tmp_path: Path) -> None:
    check = load_benchmark("gpu_check")
    child = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(120)"
    )
    part = check.Part("hang", "a part that never ends", [sys.executable, "-c", script], 60)
    log = tmp_path / "gpu-check.log"
    start = time.perf_counter()
    outcome = check.run(part, 3.0, tmp_path, log)
    assert outcome.status == "timed out after 3 s" and time.perf_counter() - start < 3 + 3 * check.GRACE_S
    assert outcome.figures == ["started"] and _gone(int(child.read_text()), 10.0)
    assert log.read_text().startswith("=== hang: timed out after 3 s")


def test_the_summary_lists_every_part_with_its_status_and_figures(tmp_path: Path) -> None:
    check = load_benchmark("gpu_check")
    parts = check.plan("cpu", True, {}, tmp_path)
    assert tuple(p.name for p in parts) == check.PART_NAMES
    outcomes = [
        check.Outcome(parts[0], "ok", 12.5, ["58 passed in 12.00s"], []),
        check.Outcome(parts[1], "failed (exit 1)", 3.0, [], ["RuntimeError: CUDA error"]),
        check.Outcome(parts[2], "skipped: the budget of 330 s is spent", 0.0, [], []),
    ]
    text = check.summary({"error": "timed out after 90 s"}, outcomes, "cuda", 330.0, False)
    assert "| tests | ok | 12.5 |" in text and "58 passed in 12.00s" in text
    assert "| throughput | failed (exit 1) | 3.0 |" in text and "RuntimeError: CUDA error" in text
    assert "| bare-loop | skipped: the budget of 330 s is spent | 0.0 |" in text
    assert "the environment part did not finish (timed out after 90 s)" in text


def test_rays_repacked_wheel_leaves_out_the_named_folders_and_keeps_the_rest(tmp_path: Path) -> None:
    wheels = load_benchmark("gpu_wheels")
    wheel = tmp_path / "ray-2.55.1-cp312-cp312-manylinux2014_x86_64.whl"
    kept = {"ray/_raylet.so": b"\x7fELF" + bytes(range(256)) * 64, "ray/__init__.py": b"import os\n"}
    dropped = {"ray/jars/ray_dist.jar": b"PK", "ray/rllib/__init__.py": b""}
    record = "".join(f"{name},sha256=x,1\n" for name in [*kept, *dropped])
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in {**kept, **dropped, "ray-2.55.1.dist-info/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    wheels.repack_ray(wheel)
    with zipfile.ZipFile(wheel) as archive:
        assert sorted(archive.namelist()) == sorted([*kept, "ray-2.55.1.dist-info/RECORD"])
        assert all(item.compress_type == zipfile.ZIP_LZMA for item in archive.infolist())
        assert all(archive.read(name) == data for name, data in kept.items())
        assert archive.read("ray-2.55.1.dist-info/RECORD").decode().splitlines() == [
            f"{name},sha256=x,1" for name in kept
        ]
