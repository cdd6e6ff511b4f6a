"""benchmarks/vs_breaching.py's verdicts: a target counts as met only by a batched row at breaching's quality."""

from __future__ import annotations

from typing import Any

from tests.benchmark_module import load_benchmark


def _row(tool: str, ssim: float, ratio: float, iterations: int = 500) -> dict[str, Any]:
    return {"case": "ig-convnet", "tool": tool, "ssim": ssim, "vs_breaching": ratio, "iterations": iterations}


def test_the_fastest_batched_row_at_breaching_quality_decides() -> None:
    bench = load_benchmark("vs_breaching")
    rows = [
        _row(bench.BATCHED, 0.28, 1.3),
        _row(bench.ONE_AT_A_TIME, 0.28, 1.2),
        _row(bench.FEWER, 0.20, 3.2, 200),
        _row("breaching", 0.18, 1.0),
    ]
    verdict = bench.verdicts(rows)["ig-convnet"]
    assert verdict["met"] and verdict["best"]["tool"] == bench.FEWER and verdict["one_at_a_time_not_slower"]


def test_a_fast_row_below_breaching_quality_does_not_count() -> None:
    bench = load_benchmark("vs_breaching")
    rows = [
        _row(bench.BATCHED, 0.28, 1.3),
        _row(bench.ONE_AT_A_TIME, 0.28, 0.9),
        _row(bench.FEWER, 0.15, 4.0, 100),
        _row("breaching", 0.18, 1.0),
    ]
    verdict = bench.verdicts(rows)["ig-convnet"]
    assert not verdict["met"] and verdict["best"]["tool"] == bench.BATCHED
    assert not verdict["one_at_a_time_not_slower"]
    assert bench.verdicts([_row(bench.BATCHED, 0.1, 9.0), _row("breaching", 0.18, 1.0)])["ig-convnet"]["best"] is None
