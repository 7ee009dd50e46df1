"""The plan tools on solved, compiled plans (8 simulated devices).

- round trip: plan -> save -> load -> apply on a second Mesh object (other
  device order) gives the same numbers as the planned step on the first;
- ``autoshard verify`` on GPT and MoE plans prints predicted vs compiled;
- ``autoshard compare`` on GPT, mesh (2, 4), presets 1x8-a100 and 2x8-a100:
  autoshard and the six classic strategies with time, memory and batch
  ceiling, autoshard no slower than any that fits (compiled, priced from the
  HLO, with the default --check compiled; modeled with --check none).

The ILP runs with a short time limit: these tests check the tools, not the
solver's quality (tests/unit/test_ilp.py does that).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

import autoshard
from autoshard import cli
from autoshard.compiler.baselines import Baseline, plan_baseline
from autoshard.compiler.ceiling import BatchProbe, args_at_batch, batch_ceiling, batch_multiple
from autoshard.compiler.driver import plan_step
from autoshard.runtime.applied import annotations_for
from autoshard.plans.plan import load_plan
from autoshard.runtime.spmd import make_jax_mesh
from autoshard.ir.trace import trace
from autoshard.passes.intra_op import IntraOpOptions, memory_profile
from autoshard.runtime.spmd import SpmdStep
from compiled_examples import FAST_COMPILE
from examples import gpt

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIME_LIMIT_S = 1.0  # the local search before CP-SAT finds these plans; CP-SAT only polishes
STRATEGIES = ("autoshard", *(b.label for b in Baseline))
FIGURES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all collective",
           "peak memory")


@pytest.fixture(scope="module")
def gpt_planned(tmp_path_factory):
    work = gpt.workload("tiny", abstract=True)
    planned = plan_step(work.step, work.args, mesh=(2, 4), cluster="1x8-a100",
                        options=IntraOpOptions(time_limit_s=TIME_LIMIT_S), name="gpt-tiny")
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    plan = planned.plan
    plan = dataclasses.replace(plan, origin={"target": str(EXAMPLES / "gpt.py"), "config": "tiny"})
    plan.save(path)
    return planned, path


def test_round_trip_apply_on_a_second_mesh_gives_the_same_numbers(gpt_planned, devices8):
    planned, path = gpt_planned
    work = gpt.workload("tiny")
    host = jax.device_get(work.args)  # numpy copies: each run places (and donates) its own buffers
    first = make_jax_mesh((2, 4), ("x", "y"), devices8)
    second = make_jax_mesh((2, 4), ("x", "y"), devices8[::-1])  # another Mesh object, other device order
    original = SpmdStep(planned.graph, annotations_for(planned.plan, planned.graph), first,
                        compiler_options=FAST_COMPILE)
    want = original(*original.place(*host))
    got = autoshard.apply(load_plan(path), work.step, second, compiler_options=FAST_COMPILE)(*host)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _table_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if cells and cells[0] in STRATEGIES + FIGURES:
            rows[cells[0]] = cells[1:]
    return rows


def test_verify_gpt_plan_file_reports_predicted_vs_compiled(gpt_planned, capsys):
    _planned, path = gpt_planned
    status = cli.main(["verify", str(path)])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert "predicted" in out and "compiled (XLA)" in out
    assert {"all collective", "peak memory"} <= set(rows)
    for cells in rows.values():
        assert len(cells) == 5 and cells[4] in ("ok", "OFF")  # predicted, compiled, error, tolerance, flag
        assert re.fullmatch(r"\d+% or [\d.]+ [KM]iB", cells[3]), cells
    assert status == (1 if any(cells[4] == "OFF" for cells in rows.values()) else 0)


def test_verify_moe_target_reports_predicted_vs_compiled(capsys):
    status = cli.main(["verify", str(EXAMPLES / "moe.py"), "--config", "tiny", "--mesh", "2x4", "--cluster",
                       "1x8-a100", "--time-limit", str(TIME_LIMIT_S)])
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert "plan 'moe-tiny' predicted vs compiled" in out
    assert {"all collective", "peak memory"} <= set(rows) and status in (0, 1)


@pytest.mark.parametrize("cluster,check", [("1x8-a100", "compiled"), ("2x8-a100", "none")])
def test_compare_gpt_autoshard_no_slower_than_any_baseline_that_fits(cluster, check, tmp_path, capsys):
    """With --check compiled (the default) no slower compiled, priced from the HLO; with none, modeled."""
    out_path = tmp_path / "plan.json"
    assert cli.main(["compare", str(EXAMPLES / "gpt.py"), "--config", "tiny", "--mesh", "2x4", "--cluster", cluster,
                     "--time-limit", str(TIME_LIMIT_S), "--check", check, "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out.split("compiled arbitration:")[0])  # the comparison, not the contest table after it
    assert set(rows) == set(STRATEGIES)
    for name, cells in rows.items():  # step, [compiled step, compiled speedup,] peak memory, fits, ceiling, speedup
        if check == "compiled":
            assert re.fullmatch(r"[\d.]+ (ms|µs|s)", cells[1]), cells
            cells = cells[:1] + cells[2 + (name != "autoshard"):]
        assert re.fullmatch(r"[\d.]+ (ms|µs|s)", cells[0]) and re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", cells[1])
        assert cells[2] in ("yes", "no") and re.fullmatch(r"[\d,]+|unbounded", cells[3])
    assert "fallback (best classic that fits)" in out
    figures = load_plan(out_path).baselines
    assert set(figures) == set(STRATEGIES)
    key = "compiled_step_s" if check == "compiled" else "step_s"
    auto = figures["autoshard"][key]
    for name, row in figures.items():
        if row["fits"]:
            assert auto <= row[key] * (1 + 1e-9), f"autoshard {auto} s slower than {name} {row[key]} s ({key})"
    assert json.loads(out_path.read_text())["explanations"]  # autoshard's plan keeps its explanations
    assert bool(load_plan(out_path).arbitration) == (check == "compiled")


def test_batch_ceiling_fits_and_the_next_batches_do_not():
    work = gpt.workload("tiny", abstract=True)
    graph = trace(work.step, *work.args)
    budget = 4 * 2**20
    planned = plan_baseline(graph, Baseline.FSDP, mesh=(2, 4), cluster="1x8-a100", memory_budget=budget,
                            options=IntraOpOptions(time_limit_s=TIME_LIMIT_S), explain=False)
    probe = BatchProbe(work.step, work.args, graph)
    ceiling = batch_ceiling(planned.result, probe, budget)
    m = batch_multiple(planned.result)
    assert ceiling is not None and ceiling > 24 and ceiling % m == 0
    peak = lambda b: float(memory_profile(  # noqa: E731  (the memory model, on the step traced at batch b)
        trace(work.step, *args_at_batch(graph, work.args, b)), planned.result.value_specs, dict(zip(("x", "y"), (2, 4))), planned.result.reshards,
        op_strategies=planned.result.node_strategies[len(graph.inputs):])[0].max())
    assert peak(ceiling) <= budget
    assert peak(int(ceiling * 1.02) // m * m + m) > budget  # the largest, to within 2%
