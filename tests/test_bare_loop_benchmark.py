"""benchmarks/ig_vs_bare_loop.py: its bare loop is the engine's Inverting Gradients written out, so that the
ratio it prints compares the same maths: from the same starts both reach the same images."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # it imports vs_breaching, beside it
    try:
        spec = importlib.util.spec_from_file_location("ig_vs_bare_loop", BENCHMARKS / "ig_vs_bare_loop.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_the_bare_loop_and_the_engine_reach_the_same_images_from_the_same_starts(tmp_path: Path) -> None:
    benchmark = _benchmark()
    args = argparse.Namespace(
        device="cpu",
        model="lenet",
        uploads=2,
        iterations=200,
        lr=0.1,
        tv=0.01,
        threads=1,
        seed=0,
        compile="off",
        out=tmp_path / "report.json",
    )
    report = benchmark.run(args)
    fedguard, bare = report["rows"]
    assert fedguard["labels_exact"]
    assert abs(fedguard["psnr_db"] - bare["psnr_db"]) < 0.05 and abs(fedguard["ssim"] - bare["ssim"]) < 0.005
    assert fedguard["psnr_db"] > 13  # it moved: the uniform starts score about 8 dB against these photos
    assert fedguard["job_iterations_per_s"] > 0 and bare["job_iterations_per_s"] > 0
