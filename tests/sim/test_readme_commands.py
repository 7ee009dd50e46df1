"""Every command in the README's ```bash blocks runs as written, from the files a fresh clone has.

The tracked files (``git ls-files``, in their working-tree state) are copied to a temporary directory and
each command runs there in a fresh bash, with no ``XLA_FLAGS`` or ``JAX_PLATFORMS`` inherited, this
checkout's virtual environment on ``PATH`` and the copy's ``autoshard`` package (only it, as an editable
install exposes it) first on ``PYTHONPATH``. A command must exit 0 with no traceback.

``HOW`` says how each command is checked, and a README command missing from it fails the test, so a new
command must be placed: ``ci`` commands run in every test run (about a minute together); ``slow`` ones
(a training run, the comparison, the multi-process launches, a fresh venv install) run with
``-m slow``; the README's test command is what ``.ci/run`` itself runs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && "
TEST_COMMAND = SETUP + "python -m pytest -q"

# README command (without its comment) -> "ci" | "slow" | why it is not run here
HOW = {
    SETUP + "python -m examples.train --model gpt --steps 3": "slow",
    TEST_COMMAND: "the CI command itself: .ci/run runs it in a fresh virtual environment",
    "autoshard trace examples/gpt.py --config large": "ci",
    "autoshard plan examples/gpt.py --config medium --mesh 2x4 --cluster 1x8-a100 --time-limit 2 --out plan.json":
        "ci",
    "autoshard explain plan.json --op 45 --html report.html": "ci",
    "autoshard validate plan.json --cluster 1x8-a100": "ci",
    "autoshard export plan.json --format flax-rules --out rules.json": "ci",
    "autoshard compare examples/gpt.py --config medium --mesh 2x4 --cluster 2x8-a100 --time-limit 2": "slow",
    "autoshard verify examples/gpt.py --config tiny --mesh 2x4 --cluster cpu-8 --time-limit 2": "ci",
    "autoshard verify examples/pipeline_gpt.py --config tiny --stages 2 --microbatches 2 --cluster cpu-8": "ci",
    "autoshard plan examples/pipeline_gpt_scan.py --config tiny --stages 2 --microbatches 2 --cluster cpu-8 "
    "--out scan_plan.json": "slow",
    "autoshard launch --processes 2 --devices-per-process 4 -- python -m examples.multihost_gpt --steps 3": "slow",
    "python -m autoshard.runtime.launch -n 2 -k 4 -- python -m examples.multihost_gpt --steps 3": "slow",
    "autoshard profile --out cluster.json": "slow",
    "autoshard advise examples/gpt.py --config medium --cluster 2x8-a100 --time-limit 2 --out advice": "slow",
    "autoshard check-config advice/accelerate_config.yaml advice/deepspeed.json": "slow",
    "autoshard export plan.json --format launch --out bundle": "ci",
}


def readme_commands() -> list[str]:
    """Each line of the README's ```bash blocks, its trailing ``# comment`` removed, in README order."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def test_every_readme_command_is_checked():
    commands = readme_commands()
    unplaced = [c for c in commands if c not in HOW]
    assert not unplaced, f"README commands with no entry in HOW (place each as ci or slow): {unplaced}"
    assert len(commands) >= 10


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files, as a fresh clone would have them (working-tree contents)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    target = tmp_path_factory.mktemp("clone")
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def _env(clone: Path) -> dict[str, str]:
    """A fresh shell's environment in which ``import autoshard`` finds the copy's package, and nothing else
    of the copy (as ``pip install -e .`` exposes only autoshard: ``examples`` must come from the cwd)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    site = clone.parent / f"{clone.name}-site"
    if not site.exists():
        site.mkdir()
        (site / "autoshard").symlink_to(clone / "autoshard")
    env["PYTHONPATH"] = str(site)
    return env


def _run(command: str, clone: Path, timeout_s: float) -> None:
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=_env(clone), capture_output=True, text=True,
                          timeout=timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"`{command}` printed a traceback:\n{out[-3000:]}"


def test_ci_commands_run_as_written(clone):
    for command in readme_commands():
        if HOW.get(command) == "ci":
            _run(command, clone, timeout_s=300)
    assert (clone / "plan.json").exists() and (clone / "report.html").exists() and (clone / "rules.json").exists()
    assert (clone / "bundle" / "run.sh").exists()


@pytest.fixture()
def slow_selected(request) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a long run: select it with -m slow")


@pytest.mark.slow
def test_slow_commands_run_as_written(clone, slow_selected, tmp_path):
    for command in readme_commands():
        if HOW.get(command) != "slow":
            continue
        if command.startswith(SETUP):  # a fresh virtual environment of the copy, as a new user makes it
            _run(command.replace(".venv", str(tmp_path / "venv")), clone, timeout_s=1800)
        else:
            _run(command, clone, timeout_s=900)
