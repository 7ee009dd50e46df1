"""Every command in the README's (and docs/') ```bash blocks runs as written from a fresh clone, writes only
into the ignored ``out/``, and every statement the README makes about a plan holds for the plan it describes.

The tracked files (``git ls-files``, in their working-tree state) are copied to a temporary directory made a
git repository of its own, and each command runs there in a fresh bash, with no ``XLA_FLAGS`` or
``JAX_PLATFORMS`` inherited, this checkout's virtual environment on ``PATH`` and the copy's ``autoshard``
package (only it, as an editable install exposes it) first on ``PYTHONPATH``. A command must exit 0 with no
traceback (one the README says exits 1 when a figure is off, ``MAY_FLAG``, may exit 1 saying so), and
afterwards ``git status`` of the copy must be clean: outputs go to ``out/``, which git ignores.

``HOW`` says how each command is checked, and a command missing from it fails the test, so a new command
must be placed: ``ci`` commands run in every test run; ``slow`` ones (a training run, the comparison, the
multi-process launches, a fresh venv install) run with ``-m slow``; the README's test command is what
``.ci/run`` itself runs. ``CLAIMS`` does the same for the bullets of the README's "What the example plans
show": each is checked against the plan file it names, after the commands that make it ran.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from autoshard.plans.plan import Plan, load_plan
from autoshard.plans.why import why_lines

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && "
TEST_COMMAND = SETUP + "python -m pytest -q"

# command (without its comment) -> "ci" | "slow" | why it is not run here
HOW = {
    SETUP + "python -m examples.train --model gpt --steps 3": "slow",
    TEST_COMMAND: "the CI command itself: .ci/run runs it in a fresh virtual environment",
    "mkdir -p out": "ci",
    "autoshard trace examples/gpt.py --config large": "ci",
    "autoshard plan examples/gpt.py --config medium --mesh 2x4 --cluster 1x8-a100 --out out/plan.json":
        "ci",
    "autoshard plan examples/gpt.py --config small --mesh 1x8 --cluster 1x8-a100 --time-limit 2 "
    "--out out/small_plan.json": "ci",
    "autoshard explain out/plan.json --op 45 --html out/report.html": "ci",
    "autoshard explain --legend": "ci",
    "autoshard validate out/plan.json --cluster 1x8-a100 --memory-budget 40GiB": "ci",
    "autoshard export out/plan.json --format flax-rules --out out/rules.json": "ci",
    "autoshard compare examples/gpt.py --config medium --mesh 2x4 --cluster 2x8-a100 --time-limit 2": "slow",
    "autoshard verify examples/gpt.py --config tiny --mesh 2x4 --cluster cpu-8 --time-limit 2": "ci",
    "autoshard verify examples/pipeline_gpt.py --config tiny --stages 2 --microbatches 2 --cluster cpu-8": "ci",
    "autoshard plan examples/pipeline_gpt_scan.py --config tiny --stages 2 --microbatches 2 --cluster cpu-8 "
    "--out out/scan_plan.json": "slow",
    "autoshard profile --out out/cluster.json": "slow",
    "autoshard advise examples/gpt.py --config medium --cluster 2x8-a100 --time-limit 2 --out out/advice": "slow",
    "autoshard check-config out/advice/accelerate_config.yaml out/advice/deepspeed.json": "slow",
    "autoshard export out/plan.json --format launch --out out/bundle": "ci",
    "autoshard launch --processes 2 --devices-per-process 4 -- python -m examples.multihost_gpt --steps 3": "slow",
    "python -m autoshard.runtime.launch -n 2 -k 4 -- python -m examples.multihost_gpt --steps 3": "slow",
}


def _largest_arrays_split(plan: Plan) -> None:
    state = plan.state_specs()
    largest = r"\['lm_head'\]\['kernel'\]|\['token_embed'\]\['embedding'\]|\['mlp'\]\['(up|down)'\]\['kernel'\]"
    wanted = [p for p in plan.param_specs() if re.search(largest, p)]
    assert len(wanted) >= 3, wanted
    for path in wanted:
        specs = [plan.input_specs[path], *state.get(path, {}).values()]
        assert any(not s.is_replicated for s in specs), f"{path} is whole in its value and its Adam state"


def _medium_shape(plan: Plan) -> None:
    params = sum(math.prod(shape) for path, (shape, _) in plan.input_shapes.items()
                 if plan.input_roles.get(path) == "param")
    assert round(params / 1e6) == 163, params
    [tokens] = [shape for path, (shape, _) in plan.input_shapes.items() if plan.input_roles.get(path) == "batch"]
    assert tokens[0] == 48 and tokens[1] in (1024, 1025), tokens  # 1024 tokens (+ the next-token target)
    assert plan.fits and plan.memory_budget_bytes == 80 * 2**30


def _latency_bound_toy(plan: Plan) -> None:
    assert any(line.startswith("latency-bound") for line in why_lines(plan)), why_lines(plan)
    assert "latency-bound" in str(plan)
    whole = sum(s.is_replicated for s in plan.input_specs.values())
    assert whole > len(plan.input_specs) / 2, f"{whole} of {len(plan.input_specs)} arrays whole"


def _scan_stages(plan: Plan) -> None:
    assert len(plan.stages) == 2 and all(len(st.device_indices) == 4 for st in plan.stages)
    assert plan.collectives_summary().startswith("stage 0: ") and "stage 1: " in plan.collectives_summary()


# README bullet (its text) -> (the plan file it describes, the check)
CLAIMS: dict[str, tuple[str, Callable[[Plan], None]]] = {
    "`out/plan.json` is GPT-2 small's shape (163M parameters, batch 48 x 1024 tokens) and fits an A100's 80 GiB "
    "per device.": ("out/plan.json", _medium_shape),
    "In it the largest arrays, the LM head, the token embedding and the MLP kernels, are each split across devices, "
    "in their values or in their Adam state (an `S(...)` in the `spec` or `optimizer state` column of `autoshard "
    "explain out/plan.json`).": ("out/plan.json", _largest_arrays_split),
    "`out/small_plan.json` is a toy (`--config small`) whose whole modeled step is shorter than one collective's "
    "latency across the 8 A100s: its report says it is latency-bound, and its plan keeps most arrays whole.":
        ("out/small_plan.json", _latency_bound_toy),
    "`out/scan_plan.json` cuts the scanned GPT into 2 stages of 4 devices each, and its report gives each stage's "
    "collective bytes.": ("out/scan_plan.json", _scan_stages),
}


def readme_commands() -> list[str]:
    """Each line of the ```bash blocks of the README and docs/, its trailing ``# comment`` removed, in order."""
    blocks = [b for doc in DOCS for b in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S)]
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def readme_claims() -> list[str]:
    """The bullets of the README's "What the example plans show", each joined into one line."""
    section = re.search(r"^## What the example plans show\n(.*?)^## ", (ROOT / "README.md").read_text(),
                        flags=re.S | re.M)
    assert section, "the README has no 'What the example plans show' section"
    bullets = re.findall(r"^- (.*?)(?=^- |\Z)", section.group(1), flags=re.S | re.M)
    return [" ".join(b.split()) for b in bullets]


def test_every_readme_command_and_claim_is_checked():
    commands = readme_commands()
    unplaced = [c for c in commands if c not in HOW]
    assert not unplaced, f"README commands with no entry in HOW (place each as ci or slow): {unplaced}"
    assert len(commands) >= 10
    claims = readme_claims()
    unchecked = [c for c in claims if c not in CLAIMS]
    assert not unchecked, f"README statements about plans with no check in CLAIMS: {unchecked}"
    assert len(claims) >= 3
    for command in commands:  # every plan file a claim reads is made by a command
        if command.startswith("autoshard") and "--out" in command:
            assert re.search(r"--out out/", command), f"`{command}` writes outside out/"
    for _claim, (plan_file, _check) in CLAIMS.items():
        assert any(f"--out {plan_file}" in c for c in commands), f"no command makes {plan_file}"


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files, as a fresh clone would have them (working-tree contents), committed in a repository of
    their own so that ``git status`` tells what the commands left behind."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    target = tmp_path_factory.mktemp("clone")
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    git = ["git", "-c", "user.name=readme", "-c", "user.email=readme@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fresh clone"]):
        subprocess.run([*git, *args], cwd=target, check=True, capture_output=True)
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
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


# commands the README says exit 1 when a figure is off (verify, on a plan the time limit may leave unproven): exit
# 0 or 1, and either way with the table of predicted against compiled figures
# (the pipeline's per-stage figures: the layer solves are time-limited, and a stage's small collectives can
# differ from XLA's by more than the tolerance: issue "pipeline fidelity")
MAY_FLAG = {"autoshard verify examples/gpt.py --config tiny --mesh 2x4 --cluster cpu-8 --time-limit 2",
            "autoshard verify examples/pipeline_gpt.py --config tiny --stages 2 --microbatches 2 --cluster cpu-8"}


def _run(command: str, clone: Path, timeout_s: float) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=_env(clone), capture_output=True, text=True,
                          timeout=timeout_s)
    out = proc.stdout + proc.stderr
    if command in MAY_FLAG:
        assert proc.returncode in (0, 1) and "predicted vs compiled" in out, f"`{command}`:\n{out[-3000:]}"
        assert proc.returncode == 0 or "off by more than their tolerance" in out, out[-3000:]
        assert "Traceback" not in out, f"`{command}` printed a traceback:\n{out[-3000:]}"
        return out
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"`{command}` printed a traceback:\n{out[-3000:]}"
    return out


def _assert_clean(clone: Path) -> None:
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout
    assert not status.strip(), f"the README's commands left files git sees:\n{status}"


def _check_claims(clone: Path, kind: str) -> None:
    made_by = {c: HOW.get(c) for c in readme_commands()}
    for claim, (plan_file, check) in CLAIMS.items():
        command = next(c for c in made_by if f"--out {plan_file}" in c)
        if made_by[command] == kind:
            check(load_plan(clone / plan_file))


def test_ci_commands_run_as_written_and_the_claims_hold(clone):
    outputs = {}
    for command in readme_commands():
        if HOW.get(command) == "ci":
            outputs[command] = _run(command, clone, timeout_s=300)
    for made in ("plan.json", "small_plan.json", "report.html", "rules.json", "bundle/run.sh"):
        assert (clone / "out" / made).exists(), made
    verify_pipe = next(c for c in outputs if c.startswith("autoshard verify examples/pipeline_gpt.py"))
    assert "stage cut: stage 0 layers" in outputs[verify_pipe]
    # the first stage's forward: an activation several layers read in one layout is gathered once (54.1 KiB
    # predicted against XLA's 36.1 KiB while each reader paid its own copy)
    [row] = [line for line in outputs[verify_pipe].splitlines() if "stage 0 forward all collective" in line]
    assert row.rstrip(" │|").endswith("ok"), row
    assert "pricing layer class" not in outputs[verify_pipe]  # per-class lines only with --verbose
    assert "partial sum" in outputs["autoshard explain --legend"]
    _assert_clean(clone)
    _check_claims(clone, "ci")


@pytest.fixture()
def slow_selected(request) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a long run: select it with -m slow")


@pytest.mark.slow
def test_slow_commands_run_as_written(clone, slow_selected, tmp_path):
    (clone / "out").mkdir(exist_ok=True)
    for command in readme_commands():
        if HOW.get(command) == "ci" and "--out out/plan.json" in command:
            _run(command, clone, timeout_s=900)  # what the bundle and check-config commands read
        if HOW.get(command) != "slow":
            continue
        if command.startswith(SETUP):  # a fresh virtual environment of the copy, as a new user makes it
            _run(command.replace(".venv", str(tmp_path / "venv")), clone, timeout_s=1800)
        else:
            _run(command, clone, timeout_s=900)
    _assert_clean(clone)
    _check_claims(clone, "slow")
