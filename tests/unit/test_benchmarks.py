"""A smoke run of the benchmark runner's pieces on the tiny MLP and GPT, so benchmarks/ does not rot (< 60 s).

Nothing here compiles: the cells run with ``compiled=False`` and the targets are judged on rows whose compiled
prices are given (tests/sim/test_benchmark_compiled.py runs a compiled cell). The full default set is left to
``python -m benchmarks.run``.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from autoshard.passes.intra_op import IntraOpOptions
from benchmarks import planning_scaling, run
from benchmarks.machine import describe, recorded_args
from benchmarks.compiled import CompiledRow, ObjectiveRow
from benchmarks.quality import Cell, CellResult, StrategyRow, WorkloadCache, geomean, run_cell
from benchmarks.tables import baselines_table, contest_table, quality_table, render_markdown, render_rich
from benchmarks.targets import evaluate

FAST = IntraOpOptions(time_limit_s=0.2)


def test_power_law_fit_recovers_the_exponent():
    layers = [2, 6, 12, 24, 48, 96]
    fit = planning_scaling.fit_power_law(layers, [0.5 * x**1.3 for x in layers])
    assert fit is not None
    assert fit.exponent == pytest.approx(1.3)
    assert fit.coefficient == pytest.approx(0.5)
    assert fit.r2 == pytest.approx(1.0)
    assert planning_scaling.fit_power_law([4], [1.0]) is None


def test_geomean_ignores_missing_values():
    assert geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert geomean([]) is None


def test_default_set_covers_the_issue():
    cells = run.default_cells()
    gpt_sizes = {c.config for c in cells if c.model == "gpt"}
    assert {"small", "medium", "large", "xl"} <= gpt_sizes
    assert {c.cluster for c in cells} == {"1x8-a100", "2x8-a100", "4x8-h100"}
    assert any(c.model == "moe" for c in cells) and any(c.model == "convnet" for c in cells)
    assert any(c.model == "moe_topk" and c.config == "large" for c in cells)  # sort/gather routing
    assert all(c.cluster == "1x8-a100" for c in cells if c.fidelity)


def test_tiny_cell_scaling_and_report():
    result = run_cell(Cell("mlp", "tiny", "1x8-a100", compiled=False), WorkloadCache(), FAST)
    assert result.error is None
    assert result.autoshard is not None and result.autoshard.fits
    assert {b.name for b in result.baselines} >= {"DP", "FSDP/ZeRO-3", "Megatron TP", "DP x TP"}
    assert result.speedup is not None and result.speedup >= 1.0 - 1e-9  # hinted with the best baseline
    assert 0 < result.bound_fraction <= 1.0
    assert result.ilp is not None and result.ilp.classes <= result.ilp.nodes

    points = planning_scaling.run([2], meshes=(("1x8-a100", (2, 4)),), options=FAST, base_config="tiny",
                                    seq_len=None)
    assert len(points) == 1 and points[0].error is None
    assert points[0].total_s > 0 and points[0].total_cpu_s > 0 and math.isfinite(points[0].other_s)

    assert result.contest == () and result.autoshard.compiled is None and result.compiled_speedup is None
    targets = evaluate([result], points)
    assert targets[0].met is None and "not compiled" in targets[0].detail  # rated on compiled prices only
    render_rich(quality_table([result]))
    settings = run.RunSettings(0.2, 0.2, 1, 1.0, "mean 1.0", 1.0)
    text = run.markdown(describe(["run.py", "--quick"]), settings, [result], points, targets)
    for heading in ("## Run", "## Targets", "## Plan quality", "## Planning time against depth", "## Details"):
        assert heading in text
    assert render_markdown(quality_table([result])).count("\n") == 4  # title, blank, header, rule, one row
    assert "python -m benchmarks.run --quick" in text


def test_decisions_are_the_plan_without_its_figures(tmp_path):
    """``run.py --plans`` writes what each cell's plan decided and nothing timed, so two runs that decide alike
    write the same files."""
    cell = Cell("mlp", "tiny", "1x8-a100", compiled=False)
    result = run_cell(cell, WorkloadCache(), FAST)
    decided = result.decisions
    assert json.loads(json.dumps(decided)) == decided, "the decisions are not plain JSON data"
    assert decided["mesh"] == [2, 4] and decided["schedule"] == "spmd" and decided["num_microbatches"] == 1
    assert decided["inputs"] and decided["ops"], "no specs in the decisions"
    assert all(isinstance(spec, str) for spec in decided["inputs"].values())
    assert "planning_s" not in json.dumps(decided) and "ledger" not in json.dumps(decided)
    run.write_decisions(tmp_path / "plans", [result])
    written = json.loads((tmp_path / "plans" / f"{cell.workload}_{cell.cluster}.json").read_text())
    assert written["autoshard"] == decided and written["pipeline"] is None and written["error"] is None


def test_hotspots_name_autoshard_functions():
    spots = planning_scaling.hotspots(2, "1x8-a100", (2, 4), FAST, base_config="tiny", seq_len=None, top=4)
    assert 0 < len(spots) <= 4
    assert all(h.function.startswith("autoshard/") and 0 < h.share <= 1 for h in spots)
    assert [h.cumulative_s for h in spots] == sorted((h.cumulative_s for h in spots), reverse=True)


def _row(name: str, step_s: float, *, fits: bool = True, compiled: float | None = None,
         cross_node: int = 0) -> StrategyRow:
    """A strategy row; its compiled step is ``compiled`` (default: the modeled one)."""
    c = compiled if compiled is not None else step_s
    return StrategyRow(name, step_s, 1e9, fits, 64, step_s / 2, step_s / 4, step_s / 4,
                       CompiledRow(c, c * 0.8, c * 0.2, 0.01, 0.05, True, cross_node))


def _cell(model: str, cluster: str, auto: StrategyRow, *baselines: StrategyRow, params: int = 10**9) -> CellResult:
    return CellResult(Cell(model, "large", cluster), params, 48, 80 * 2**30, auto, tuple(baselines), 0.01, 1.0, 2.0,
                      30.0, None)


def test_targets_judge_compiled_speedups_budgets_and_toys():
    fast = _cell("gpt", "2x8-a100", _row("autoshard", 1.0), _row("DP", 2.0), _row("FSDP/ZeRO-3", 3.0))
    assert fast.speedup == pytest.approx(2.0) and fast.compiled_speedup == pytest.approx(2.0)
    # modeled and compiled disagree: the targets follow the compiled programs
    fooled = _cell("gpt", "1x8-a100", _row("autoshard", 1.0, compiled=3.0), _row("DP", 2.0, compiled=2.4))
    assert fooled.speedup == pytest.approx(2.0) and fooled.compiled_speedup == pytest.approx(0.8)
    # a faster classic plan that does not fit does not count
    unfit = _cell("moe", "1x8-a100", _row("autoshard", 1.0), _row("DP", 0.5, fits=False), _row("FSDP/ZeRO-3", 1.1))
    assert unfit.compiled_speedup == pytest.approx(1.1)
    over = _cell("gpt", "1x8-a100", _row("autoshard", 1.0, fits=False), _row("FSDP/ZeRO-3", 1.2))
    assert over.compiled_speedup is None and over.over_budget
    toy = _cell("gpt", "2x8-a100", _row("autoshard", 1.0), _row("DP", 20.0), params=300_000)

    minimum, nodes, _over_dp, moe, two_node = evaluate([fast, unfit, toy], [])[:5]
    assert minimum.met is True and "compiled" in minimum.name
    assert nodes.met is True and "1.10x" in nodes.name
    assert moe.met is False and "1.10x" in moe.detail
    assert two_node.met is True and two_node.caveat is None  # fast alone reaches 2.0x

    # a geomean that two decimals would round up to the target is printed with four
    near = _cell("gpt", "2x8-a100", _row("autoshard", 1.0), _row("DP", 1.4996))
    near_two_node = evaluate([near], [])[4]
    assert near_two_node.met is False and "geomean 1.4996x" in near_two_node.detail

    slow = _cell("gpt", "2x8-a100", _row("autoshard", 1.0), _row("DP", 1.01))
    two_node = evaluate([slow, toy], [])[4]
    assert two_node.met is True and two_node.caveat and "1.01x" in two_node.caveat
    assert two_node.verdict == "met, with a caveat"

    minimum = evaluate([fast, fooled], [])[0]
    assert minimum.met is False and "0.80x compiled (2.00x modeled)" in minimum.detail
    minimum = evaluate([fast, over], [])[0]
    assert minimum.met is False and "over the memory budget" in minimum.detail
    uncompiled = dataclasses.replace(fast, autoshard=dataclasses.replace(fast.autoshard, compiled=None))
    assert evaluate([uncompiled], [])[0].met is None


def test_gpt_medium_on_two_nodes_is_rated_against_data_parallel_compiled():
    medium = CellResult(Cell("gpt", "medium", "2x8-a100"), 3 * 10**8, 16, 80 * 2**30,
                        _row("autoshard", 1.0, compiled=0.9, cross_node=40),
                        (_row("DP", 1.1, compiled=1.05, cross_node=3), _row("FSDP/ZeRO-3", 1.3)), 0.01, 1.0, 2.0,
                        30.0, None)
    target = next(t for t in evaluate([medium], []) if "data parallel" in t.name)
    assert target.met is True and target.detail.startswith("1.17x")  # 1.05 / 0.9, compiled
    assert "collectives crossing nodes: autoshard 40, DP 3" in target.detail
    worse = dataclasses.replace(medium, autoshard=_row("autoshard", 1.0, compiled=1.0))
    assert next(t for t in evaluate([worse], []) if "data parallel" in t.name).met is False
    assert next(t for t in evaluate([], []) if "data parallel" in t.name).met is None


def test_tables_show_compiled_prices_the_contest_and_the_objective_check():
    from benchmarks.compiled import ContestRow

    cell = _cell("gpt", "2x8-a100", _row("autoshard", 1.0, compiled=0.9, cross_node=2), _row("DP", 2.0))
    cell = dataclasses.replace(
        cell, objective=ObjectiveRow(1e-3, 1e-3, 1e-3, True), arbitration_s=12.0,
        contest=(ContestRow("autoshard", 1.0, 1.2, True, False), ContestRow("autoshard next-best 1", 1.1, 0.9,
                                                                          True, True),
                 ContestRow("DP", 2.0, None, True, False, "RuntimeError: boom")))
    quality = render_markdown(quality_table([cell]))
    assert "900 ms" in quality and "DP 2 s" in quality and "2.22x" in quality and "agree: 1 ms / 1 ms / 1 ms" in quality
    contest = render_markdown(contest_table([cell]))
    assert contest.count("\n") == 6 and "did not compile: RuntimeError: boom" in contest and "-16.7%" in contest
    assert "| 2 |" in render_markdown(baselines_table([cell]))  # autoshard's collectives crossing nodes


def test_planning_targets_name_the_slow_and_the_superlinear_pass():
    def point(layers: int) -> planning_scaling.ScalingPoint:
        other = 0.025 * layers**1.5  # decode + memory grows faster than depth: 23.5 s at 96 layers
        intra = 5.0 + 0.05 * layers + other
        trace = 0.025 * layers  # 24 layers: 9.7 s in all, within the 10 s target; 96 layers: 35.7 s
        return planning_scaling.ScalingPoint(layers, "1x8-a100", (2, 4), 0, 0, trace, intra, 0.05 * layers,
                                             5.0, 1, 1, 1, 1, 1, "feasible", 0.1, trace, intra)

    targets = evaluate([], [point(n) for n in planning_scaling.DEPTHS])
    by_depth = {t.name.split(" ")[0]: t for t in targets}
    assert by_depth["24-layer"].met is True
    ninety_six = by_depth["96-layer"]
    assert ninety_six.met is False and "Slowest pass: decode + memory profile" in ninety_six.detail
    linear = next(t for t in targets if "linearly" in t.name)
    assert "superlinear pass: decode + memory grows as L^1.50" in linear.detail


def test_rewriting_results_keeps_the_fuzz_section():
    from benchmarks.sections import carry_over, replace_section

    old = "# Benchmark results\n\n## Run\nold run\n\n## Fuzz corpus\n\n- 0 crashes\n\n## Details\nold\n"
    new = "# Benchmark results\n\n## Run\nnew run\n\n## Details\nnew\n"
    kept = carry_over(old, new)
    assert "new run" in kept and "old run" not in kept and kept.endswith("## Fuzz corpus\n\n- 0 crashes\n")
    again = replace_section(kept, "## Fuzz corpus", "## Fuzz corpus\n\n- 2000 programs\n")
    assert again.count("## Fuzz corpus") == 1 and "- 2000 programs" in again and "0 crashes" not in again


def test_pipeline_columns_rate_the_pipeline_against_every_other_row():
    from dataclasses import replace

    cell = _cell("gpt", "2x8-a100", _row("autoshard", 1.0), _row("FSDP/ZeRO-3", 1.2), _row("uniform GPipe", 0.9),
                 _row("DP", 0.5, fits=False))
    assert cell.pipeline_speedup is None  # not planned
    piped = replace(cell, pipeline=_row("pipeline", 0.6), pipeline_stages="2 stages [L0-7@2x4 | L8-15@2x4] B=8 1f1b",
                    pipeline_s=12.0)
    assert piped.pipeline_speedup == pytest.approx(0.9 / 0.6)  # the fastest fitting other row: uniform GPipe
    # autoshard's answer with stages searched is the faster of its SPMD plan and the pipeline: the cell is
    # rated by it, so an SPMD plan slower than uniform GPipe does not rate the cell below 1.0x
    assert piped.answer is piped.pipeline and piped.speedup == pytest.approx(piped.fallback.step_s / 0.6)
    slow = replace(piped, pipeline=_row("pipeline", 5.0))
    assert slow.answer is slow.autoshard and slow.speedup == pytest.approx(cell.speedup)
    row = render_markdown(quality_table([piped])).splitlines()[-1]
    assert "1.50x" in row and "2 stages [L0-7@2x4 \\| L8-15@2x4]" in row  # markdown escapes the bar
    over = replace(piped, pipeline=_row("pipeline", 0.1, fits=False))
    assert over.pipeline_speedup is None
    # compiled prices rate the answer too: the pipeline's stage executables priced, against uniform GPipe's
    assert piped.compiled_answer is piped.pipeline.compiled and piped.compiled_speedup == pytest.approx(0.9 / 0.6)
    # check="compiled" weighs both compiled: a pipeline the model chose but that compiles slower than the SPMD
    # plan is not the answer, and one the model passed over is when it compiles faster
    slower = replace(piped, pipeline=_row("pipeline", 0.6, compiled=1.8))
    assert slower.compiled_answer_row is slower.autoshard and slower.compiled_speedup == pytest.approx(0.9)
    passed_over = replace(piped, pipeline=_row("pipeline", 5.0, compiled=0.3))
    assert passed_over.answer is passed_over.autoshard and passed_over.compiled_speedup == pytest.approx(3.0)
    uncompiled = replace(piped, pipeline=replace(piped.pipeline, compiled=None),
                         autoshard=replace(piped.autoshard, compiled=None))
    assert uncompiled.compiled_speedup is None
    assert "autoshard's plan (pipeline) was not compiled" in evaluate([uncompiled], [])[0].detail
    assert all(c.pipeline for c in run.default_cells() if c.model == "gpt" and c.cluster == "2x8-a100")
    assert any(c.pipeline for c in run.quick_cells())



def test_a_run_without_the_scaling_study_keeps_the_last_one_marked():
    from benchmarks.run import SCALING_HEADING, merged

    old = f"# R\n\n## Plan quality\n\nold cells\n\n{SCALING_HEADING}\n\n| 12 | 3 s |\n\n## Fuzz corpus\n\nfuzz\n"
    new = "# R\n\n## Plan quality\n\nnew cells\n"
    text = merged(old, new, "abc123", scaled=False)
    assert "new cells" in text and "old cells" not in text and "fuzz" in text
    assert "| 12 | 3 s |" in text and "this run (commit abc123) skipped the scaling study" in text
    rescaled = merged(old, new + f"\n{SCALING_HEADING}\n\n| 12 | 2 s |\n", "abc123", scaled=True)
    assert "| 12 | 2 s |" in rescaled and "| 12 | 3 s |" not in rescaled and "Carried over" not in rescaled


def test_recorded_commands_leave_out_side_output_paths():
    """The scaling markdown and RESULTS files record their command without ``--json`` / ``--plans`` paths."""
    recorded = recorded_args(["--layers", "12", "24", "--json", "out/x.json", "--markdown", "m.md",
                              "--json=out/y.json", "--plans", "out/plans", "--plans=out/p2"])
    assert recorded == ["--layers", "12", "24", "--markdown", "m.md"]
    assert describe(["run.py", "--quick", "--plans", "out/plans"]).command == "python -m benchmarks.run --quick"


def test_solver_gaps_count_what_was_proven():
    """benchmarks/solver_gaps.py: a cell counts as solved when proven optimal or within 1% of its bound; a
    cell without a bound says so rather than printing an infinite gap."""
    from benchmarks.solver_gaps import GapRow, markdown

    rows = [GapRow("a on 1x8-a100 2x4", "optimal", 0.0, 2e-3, 2e-3, 3.0, 4.0, 4.0, 1000),
            GapRow("b on 2x8-a100 2x8", "feasible", 0.005, 2e-3, 1.99e-3, 10.0, 11.0, 11.0, 1000),
            GapRow("c on 4x8-h100 4x8", "feasible", 0.2, 2e-3, 1.6e-3, 10.0, 11.0, 11.0, 1000),
            GapRow("d on 4x8-h100 4x8", "feasible", math.inf, 2e-3, math.nan, 10.0, 11.0, 11.0, 1000)]
    text = markdown(rows, IntraOpOptions(), ("1.0", "1.0"), 60.0)
    assert "**2 of 4 cells**" in text
    assert "| d on 4x8-h100 4x8 | feasible | no bound | 2.000 | - |" in text
    assert "| c on 4x8-h100 4x8 | feasible | 20.0% | 2.000 | 1.600 |" in text


def test_the_stage_search_targets_read_the_timed_searches():
    """The planning-time issue's stage-search targets (gpt-large <= 30 s, gpt-xl@8 <= 90 s with stages searched
    on two nodes) are rated from ``benchmarks/stage_search_time.py``'s points, wall seconds against the limit."""
    from benchmarks.stage_search_time import StageSearchPoint, markdown

    assert all(t.met is None for t in evaluate([], [])[-2:])  # not run
    fast = StageSearchPoint("large", "2x8-a100", 24, 25.0, 28.0, (1.0, 1.2), "pipeline, 2 stages, 404 ms",
                            {"trace": 1.7, "pricing": 14.8, "stage-dp": 0.1, "spmd": 8.0})
    slow = dataclasses.replace(fast, case="xl@8", layers=32, wall_s=95.0, cpu_s=80.0)
    large, xl = evaluate([], [], staged=[fast, slow])[-2:]
    assert large.met is True and "24 layers" in large.name and "<= 30 s" in large.name and "spmd 8.0 s" in large.detail
    assert xl.met is False and "<= 90 s" in xl.name and "inflated by the load" in xl.detail
    table = markdown([fast, slow])
    assert table.count("\n") == 3 and "| gpt-xl@8 | 32 | 2x8-a100 | 95.0 | 80.0 |" in table


def test_the_returned_plan_s_compiled_collectives_are_rated_against_its_modeled_ones():
    def row(modeled_comm: float, compiled_comm: float) -> StrategyRow:  # half the modeled in ops, half resharding
        return StrategyRow("autoshard", 1.0, 1e9, True, 64, 0.5, modeled_comm / 2, modeled_comm / 2,
                           CompiledRow(1.0, 0.6, compiled_comm, 0.01, 0.05, True))

    near = _cell("gpt", "1x8-a100", row(0.21, 0.2), _row("DP", 2.0))  # +5%
    far = _cell("moe", "4x8-h100", row(0.2, 0.3), _row("DP", 2.0))  # -33%
    target = next(t for t in evaluate([near], []) if "collectives within" in t.name)
    assert target.met is True and target.detail == "1 of 1 cells within 10%"
    target = next(t for t in evaluate([near, far], []) if "collectives within" in t.name)
    assert target.met is False and "1 of 2 cells" in target.detail
    assert "moe-large on 4x8-h100" in target.detail and "(-33%)" in target.detail
    uncompiled = dataclasses.replace(near, autoshard=dataclasses.replace(near.autoshard, compiled=None))
    assert next(t for t in evaluate([uncompiled], []) if "collectives within" in t.name).met is None


def test_a_compared_cell_is_rated_against_the_fastest_compiled_classic_plan_that_fits():
    from benchmarks.compared import ComparedCell, table_lines
    from benchmarks.flax_zoo import DEFAULT_CELLS, MODELS, markdown

    rows = (("autoshard", 2.0e-3, 1.0e-3, True), ("DP", 3.0e-3, 1.5e-3, True),
            ("Megatron TP", 2.5e-3, 0.9e-3, False), ("FSDP/ZeRO-3", 3.1e-3, None, True))
    cell = ComparedCell("vit:1x8-a100:2x4", 60.0, rows, "autoshard", "optimal")
    assert cell.speedup == pytest.approx(1.5) and cell.ok  # Megatron TP does not fit; FSDP was not compiled
    slower = dataclasses.replace(cell, rows=(("autoshard", 2.0e-3, 2.0e-3, True), *rows[1:]))
    assert slower.speedup == pytest.approx(0.75) and not slower.ok
    uncompiled = dataclasses.replace(cell, rows=(("autoshard", 2.0e-3, None, True), *rows[1:]))
    assert uncompiled.speedup is None and not uncompiled.ok
    lines = table_lines([cell])
    assert "| vit:1x8-a100:2x4 | Megatron TP | 2.5 ms | 900 µs | no |" in lines
    assert any(line.startswith("- vit:1x8-a100:2x4: autoshard (autoshard) 1.50x") for line in lines)
    assert {c.split(":")[0] for c in DEFAULT_CELLS} == set(MODELS)
    text = markdown([cell, slower], "1.0 1.0 1.0", 10.0)
    assert "1 of 2 cells at least as fast" in text and "geomean over the cells 1.06x" in text
