"""benchmarks/retrieval_squad.py --device cuda (issue 39.5): accepted by its parser, and refused in one line
where torch sees no CUDA device (here, and on a GPU machine with the devices hidden)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_device_cuda_without_cuda_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "retrieval_squad.py"), "--device", "cuda",
                           "--parts", "zero-shot", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "retrieval_squad.py: --device cuda, but torch sees no CUDA device on this machine"]
    assert not (tmp_path / "out").exists()  # refused before anything is written
    # An unknown device is the parser's own refusal (cpu and cuda only).
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "retrieval_squad.py"), "--device", "tpu"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'tpu'" in done.stderr
