"""A GPT whose blocks run under ``nnx.scan`` (examples/gpt_scan.py) against its unrolled twin (examples/gpt.py,
the same weights): both planned and run sharded, each step equal to the same step on one device.

The scan's body is planned like any ops (``ir/trace.py`` flattens it; the runtime re-emits the scan with
the body's sharding constraints), so the sharded scanned step must still be one ``while`` loop in the
compiled program, not an unrolled copy.
"""
from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

import autoshard
from autoshard.compiler.baselines import plan_baseline
from autoshard.compiler.compile_plans import compile_here
from autoshard.compiler.hlo import read_hlo_collectives, summarize_compiled
from autoshard.compiler.verify import compare, compiled_price
from autoshard.ir.trace import trace
from autoshard.passes.classic import Baseline
from autoshard.passes.intra_op import IntraOpOptions
from compiled_examples import FAST_COMPILE
from examples import gpt, gpt_scan
from examples.common import make_train_step

FAST = IntraOpOptions(time_limit_s=1.0)
MESHES = [(2, 4), (1, 8), (8, 1)]
MESH_PARAMS = [pytest.param(m, marks=() if m == (2, 4) else pytest.mark.slow, id="x".join(map(str, m))) for m in MESHES]


def _rel(a, b, floor: float = 0.0) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor, 1e-30))


def _check_three_steps(step_fn, params, batch, mesh):
    """3 SGD steps sharded and on one device: loss and every parameter leaf within 1e-5 relative."""
    tx = optax.sgd(0.1)
    step = make_train_step(step_fn, tx)
    reference = jax.jit(step, compiler_options=FAST_COMPILE)
    ref = (jax.tree.map(lambda x: x.copy(), params), tx.init(params))
    sharded = autoshard.autoshard(step, mesh=mesh, options=FAST, compiler_options=FAST_COMPILE)
    state = (params, tx.init(params))
    for _ in range(3):
        *ref, ref_loss = reference(*ref, batch)
        *state, loss = sharded(*state, batch)
        assert _rel(loss, ref_loss) <= 1e-5, f"loss {float(loss)} vs one device {float(ref_loss)}"
    # a leaf whose gradient is zero in theory (attention key biases) holds rounding noise: floor its scale
    floor = 1e-2 * max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref[0]))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state[0]), jax.tree.leaves(ref[0])):
        assert _rel(got, want, floor) <= 1e-5, f"{jax.tree_util.keystr(path)}: rel err {_rel(got, want, floor):.2e}"
    return sharded


@pytest.mark.parametrize("mesh", MESH_PARAMS)  # (1, 8) and (8, 1) with -m slow
def test_scanned_gpt_and_unrolled_twin_match_one_device(mesh, devices8):
    scanned, unrolled = gpt_scan.workload("tiny"), gpt.workload("tiny")
    assert float(scanned.loss_fn(scanned.args[0], scanned.args[2])) == pytest.approx(
        float(unrolled.loss_fn(unrolled.args[0], unrolled.args[2])), rel=1e-6)  # the same weights
    step = _check_three_steps(scanned.loss_fn, scanned.args[0], scanned.args[2], mesh)
    assert step.plan.mesh_shape == mesh
    assert any(not spec.is_replicated for spec in step.plan.input_specs.values()), "the plan shards nothing"
    assert step.spmd_step.graph.loops, "the scan was not planned as a loop"
    _check_three_steps(unrolled.loss_fn, unrolled.args[0], unrolled.args[2], mesh)


# A GPT big enough that its plan shards (d_model 512, 4 layers, 32 x 128 tokens; ~13M parameters), small
# enough to compile twice here in about a minute. Planned on 1x8-a100 from shapes; compiled for 8 CPU devices.
# HiGHS's LP of this GPT (about 100k columns) takes 5-50 s on two loaded cores: a limit it meets, so both
# plans are the solver's optimum and not the fallback start
SOLVE_S = 120.0
COMPARED = gpt.Config(vocab_size=2048, seq_len=128, d_model=512, num_heads=8, num_layers=4, batch_size=32)


def _compiled_peak_bytes(compiled) -> float:
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def _plans_compared() -> dict[str, tuple]:
    """Per model (scanned, unrolled): modeled step, compiled per-device peak, one device's, the HLO text, the
    fidelity report (the plan's collectives, FLOPs and HBM bytes against the compiled program's), the compiled
    program's own step priced on the plan's cluster (``verify.compiled_price``) and the partial sums the plan
    holds at its peak (bytes)."""
    found = {}
    for name, module in (("scanned", gpt_scan), ("unrolled", gpt)):
        work = module.workload(COMPARED, abstract=True)
        step = autoshard.autoshard(work.step, mesh=(2, 4), cluster="1x8-a100", num_stages=1,
                                   options=IntraOpOptions(time_limit_s=SOLVE_S))
        compiled = step.lower(*work.args).compile()
        one_device = jax.jit(work.step).lower(*work.args).compile()
        summary = summarize_compiled(compiled)
        found[name] = (step.plan.ledger.step_s, _compiled_peak_bytes(compiled), _compiled_peak_bytes(one_device),
                       compiled.as_text(), compare(step.plan, summary), compiled_price(step.plan, summary).step_s,
                       step.plan.ledger.memory_by_kind.get("stacked partial sums", 0.0))
    return found


@pytest.fixture(scope="module")
def compared(devices8):
    return _plans_compared()


def test_scanned_plan_memory_matches_the_unrolled_plan(compared):
    """The compiled program's per-device memory: scanned within 10% of unrolled once the partial sums the
    scanned plan chose to hold are set aside (its stacked gradients reduced once after the loop,
    passes/deferral.py: a trade of memory for time the ILP prices), both far below one device's; the scan
    stays a loop."""
    (_, scan_bytes, scan_one, scan_hlo, *_), (_, flat_bytes, flat_one, *_) = compared["scanned"], compared["unrolled"]
    assert "while" in scan_hlo, "the scanned step was unrolled"
    assert scan_bytes <= 0.25 * scan_one and flat_bytes <= 0.25 * flat_one
    held = compared["scanned"][6]
    assert abs((scan_bytes - held) / flat_bytes - 1) <= 0.10, (
        f"compiled peak {scan_bytes / 2**20:.1f} (partial sums {held / 2**20:.1f}) vs {flat_bytes / 2**20:.1f} MiB")


def test_scanned_plan_is_priced_as_xla_compiles_it(compared):
    """The scanned plan's collectives (XLA runs a loop body's trip-count times) and FLOPs against the compiled
    program, within ``autoshard verify``'s tolerances."""
    report = compared["scanned"][4]
    for what in ("all collective bytes", "flops per device"):
        assert report.row(what).ok, str(report)


# the figure XLA counts a loop body once for (compiler/hlo_bytes.py prices its other runs); no compile of its own
def test_scanned_plan_hbm_bytes_as_xla_compiles_it(compared):
    report = compared["scanned"][4]
    assert report.row("hbm bytes per device").ok, str(report)


def test_scanned_plans_extra_time_is_the_compiled_programs(compared):
    """The scan's modeled penalty over its unrolled twin is XLA's, not the model's: the two compiled programs,
    priced on the same cluster from their own HLO, cost bytes and collectives (ratio) within 15% of the plans'."""
    scanned, unrolled = compared["scanned"], compared["unrolled"]
    modeled, compiled = scanned[0] / unrolled[0], scanned[5] / unrolled[5]
    assert abs(modeled / compiled - 1) <= 0.15, f"modeled x{modeled:.3f}, compiled programs x{compiled:.3f}"


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="measured +41% modeled (2.167 vs 1.541 ms) and +52% as XLA compiles the two "
                   "plans (compiled_price 2.30 vs 1.51 ms): XLA's while loop copies each layer's weights out of their "
                   "stack (dynamic-slice) and each stacked residual in and out (dynamic-update-slice / dynamic-slice), "
                   "3.16e9 HBM bytes against the unrolled 2.00e9 with the same data-parallel plan, and runs each "
                   "iteration's gradient all-reduce on its own (4 latencies instead of one combined). The model "
                   "predicts both (scanned DP 3.146e9 bytes predicted, 3.159e9 compiled); the planner's answer, "
                   "ZeRO-3-like stacked weights (2.161 ms) over DP (2.197 ms), is the cheaper of the two")
def test_scanned_plan_step_matches_the_unrolled_plan(compared):
    scan_s, flat_s = compared["scanned"][0], compared["unrolled"][0]
    assert abs(scan_s / flat_s - 1) <= 0.10, f"modeled step {scan_s * 1e3:.3f} vs {flat_s * 1e3:.3f} ms"


# ---- issue 25, item 1: one reduction per stacked gradient, the scanned step as fast as the unrolled one

REDUCTIONS = ("all-reduce", "reduce-scatter")


def _reduction_runs(hlo_text: str) -> tuple[int, list[str]]:
    """Runs per step of the program's reduce collectives (XLA combines an unrolled step's gradient reductions
    into one; a collective in a loop body runs once per iteration), and those that run in a loop body."""
    found = [c for c in read_hlo_collectives(hlo_text) if c.kind in REDUCTIONS]
    return sum(c.count for c in found), [str(c) for c in found if c.count > 1]


def test_scanned_gradients_are_reduced_once_per_step(compared):
    """No reduction runs in a loop body of the scanned step (its stacked gradients' partial sums are reduced once,
    after the loop: passes/deferral.py), and each reduction kind runs once per step, as the unrolled twin's (XLA
    combines all-reduces with all-reduces and reduce-scatters with reduce-scatters)."""
    scan_runs, in_loops = _reduction_runs(compared["scanned"][3])
    flat_runs, flat_in_loops = _reduction_runs(compared["unrolled"][3])
    assert not flat_in_loops
    assert not in_loops, f"reductions run in a loop body: {in_loops}"
    kinds = {c.kind for c in read_hlo_collectives(compared["scanned"][3]) if c.kind in REDUCTIONS}
    assert scan_runs <= len(kinds), f"{scan_runs} reduction runs per step for {sorted(kinds)}"
    assert flat_runs <= 2


def _loop_bodies(hlo_text: str) -> list[str]:
    """The text of every while body of a compiled program."""
    names = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
    return [re.search(r"^%" + re.escape(n) + r" .*?^}", hlo_text, re.S | re.M).group(0) for n in sorted(names)]


def test_scanned_stacks_are_updated_in_place(compared):
    """Each iteration writes its slice into the stacks it builds (a dynamic-update-slice fusion, in place): no
    loop body copies a whole stack, so a stack costs one layer's bytes per iteration, not the whole stack."""
    bodies = _loop_bodies(compared["scanned"][3])
    assert len(bodies) >= 2, "the forward and backward loops"
    for body in bodies:
        stacks = {m.group(1).split("{")[0] for m in re.finditer(
            r"%[\w.\-]*dynamic-update-slice[\w.\-]* = (\S+) fusion\(", body)}
        assert stacks, "a loop body writes no stack"
        copied = {m.group(1).split("{")[0] for m in re.finditer(r"= (\S+) copy\(", body)}
        assert not copied & stacks, f"a loop body copies whole stacks: {sorted(copied & stacks)}"


@pytest.fixture(scope="module")
def unrolled_dp_compiled_s(devices8) -> float:
    """The unrolled twin's data-parallel plan priced from its compiled program on 1x8-a100 (``compiled_price``)."""
    work = gpt.workload(COMPARED, abstract=True)
    graph = trace(work.step, *work.args)
    planned = plan_baseline(graph, Baseline.DP, mesh=(2, 4), cluster="1x8-a100",
                            options=IntraOpOptions(time_limit_s=SOLVE_S), explain=False)
    compiled = compile_here(graph, planned.plan)
    assert compiled.summary is not None, compiled.error
    return compiled_price(planned.plan, compiled.summary).step_s


@pytest.mark.xfail(strict=True, reason="measured x1.42: the scanned plan's compiled program 2.00 ms against the "
                   "unrolled twin's plan, 1.40 ms (both proven optimal under the model; the unrolled DP plan 1.68 ms). "
                   "Its gradients reduced once after the loop took it from 2.16 ms (x1.54); the rest is HBM bytes: "
                   "per-iteration slices of the weight stacks and stacked residuals copied before the backward loop "
                   "(2.93e9 against 1.98e9 bytes)")
def test_scanned_step_compiles_within_15_percent_of_its_unrolled_twin(compared, unrolled_dp_compiled_s):
    """The scanned plan's compiled price against the better of its unrolled twin's plan and DP plan: <= 1.15x."""
    scanned_s = compared["scanned"][5]
    unrolled_s = min(compared["unrolled"][5], unrolled_dp_compiled_s)
    assert scanned_s / unrolled_s <= 1.15, f"compiled {scanned_s * 1e3:.3f} vs {unrolled_s * 1e3:.3f} ms"
