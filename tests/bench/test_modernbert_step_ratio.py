"""benchmarks/modernbert_step.py's ratios come from the median step times, not from the seq/s it prints
rounded to two decimals (issue 40.9: loaded, its own step times gave 1.23x, the rounded seq/s 1.63x)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from modernbert_step import ratios  # noqa: E402


def test_ratios_are_their_step_time_over_ours():
    # Slow steps (a base-size model on a loaded CPU): 1 sequence in 123 s and in 150 s is 0.01 seq/s both
    # when rounded, which made 1.00x of 150 / 123 = 1.22x.
    got = ratios({"bertforge": 123.0, "transformers": 150.0, "transformers_sparse": 200.0})
    assert got == {"ratio_vs_transformers": pytest.approx(1.220, abs=1e-3),
                   "ratio_vs_transformers_sparse": pytest.approx(1.626, abs=1e-3)}
