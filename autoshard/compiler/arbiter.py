"""Compiled arbitration: compile the plans in contention and return the one XLA's program runs fastest.

The cost model ranks plans, but XLA decides the collectives it runs (it may
gather where the plan resharded, or group devices across nodes). So with
``check="compiled"`` (``compare``, ``autoshard.plan``, the decorator):

1. the contenders are the chosen plan, its next-best distinct ILP plans
   (``passes/next_plans.py``: no-good cuts, up to ``NEXT_BEST`` of them) and
   the classic plans (``compare``: every one; ``autoshard.plan``: the best one
   under the model that fits);
2. each is compiled (``compiler/compile_plans.py``: here, or in a child
   process with as many simulated devices as its mesh has) and priced from
   its HLO with the same ClusterSpec (``compiler/verify.compiled_price``:
   FLOPs at the plan's peaks, bytes accessed at HBM bandwidth, each
   collective at its replica groups' links and node crossings);
3. the fastest compiled program among the plans that fit the budget wins
   (ties: the earlier contender, so the model's choice first). A plan that
   does not compile cannot win; when none compiles, the model's choice
   stays, with the reason in ``Plan.checks``.

Each contender's ledger gets its compiled price beside the modeled one
(``Ledger.compiled_step_s``, ``prediction_error``), and the winner's plan
records the whole contest (``Plan.arbitration``). So "never slower than the
best classic recipe" holds on the compiled program, among the classic plans
compiled.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from autoshard.compiler.compile_plans import CompiledPlan, compile_plans
from autoshard.compiler.driver import PlannedStep, build_plan
from autoshard.compiler.verify import CompiledPrice, compiled_price
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.passes.next_plans import next_best_plans
from autoshard.plans.ledger import fmt_s
from autoshard.plans.plan import Plan

__all__ = ["CHECKS", "Arbitration", "Contender", "arbitrate", "arbitrate_steps", "check_option", "next_best_steps",
           "with_price"]

log = logging.getLogger(__name__)

Check = Literal["compiled"]
CHECKS: tuple[str | None, ...] = (None, "compiled")
NEXT_BEST = 3  # next-best distinct ILP plans compiled beside the chosen one
NEXT_BEST_TIME_LIMIT_S = 5.0  # CP-SAT seconds per next-best re-solve (at most the planner's own limit)
CHECK_NAME = "compiled arbitration"  # the key in Plan.checks


def check_option(check: object) -> Check | None:
    """``check`` as an option: None (off) or "compiled"; a clear error otherwise (raised at once)."""
    if check is None or (isinstance(check, str) and check == "compiled"):
        return check  # type: ignore[return-value]
    raise ValueError(f"check must be None (no check) or \"compiled\" (compile the chosen plan, its next-best "
                     f"plans and the best classic plan, and return the fastest compiled program), got {check!r}")


@dataclass(frozen=True)
class Contender:
    name: str  # "autoshard", "autoshard next-best 1", a classic strategy's label
    step: PlannedStep
    compiled: CompiledPlan | None = None
    price: CompiledPrice | None = None

    @property
    def plan(self) -> Plan:
        return self.step.plan

    @property
    def compiled_s(self) -> float | None:
        return None if self.price is None else self.price.step_s

    @property
    def error(self) -> str | None:
        return None if self.compiled is None else self.compiled.error


@dataclass(frozen=True)
class Arbitration:
    contenders: tuple[Contender, ...]  # in contention order, each with its compiled price (or error)
    winner: Contender
    seconds: float  # next-best solves and compiles, wall

    def table(self) -> dict[str, dict[str, float]]:
        """What ``Plan.arbitration`` records: per contender its modeled and compiled step, fit, and which won."""
        out: dict[str, dict[str, float]] = {}
        for c in self.contenders:
            row = {"modeled_s": c.plan.step_s, "fits": float(c.plan.fits), "chosen": float(c is self.winner)}
            if c.compiled_s is not None:
                row["compiled_s"] = c.compiled_s
            out[c.name] = row
        return out

    def summary(self) -> str:
        """One line for ``Plan.checks``."""
        compiled = [c for c in self.contenders if c.price is not None]
        if self.winner.price is None:
            return (f"no contender compiled ({'; '.join(f'{c.name}: {c.error}' for c in self.contenders)}): "
                    f"kept the model's choice")
        return (f"{self.winner.name} runs fastest compiled, {fmt_s(self.winner.compiled_s or 0.0)} (modeled "
                f"{fmt_s(self.winner.plan.step_s)}), of {len(compiled)} compiled: "
                + ", ".join(f"{c.name} {fmt_s(c.compiled_s or 0.0)}" for c in compiled))


def with_price(plan: Plan, price: CompiledPrice | None) -> Plan:
    """``plan`` with its compiled price in the ledger (unchanged when None)."""
    if price is None:
        return plan
    return replace(plan, ledger=replace(plan.ledger, compiled_step_s=price.step_s, compiled_compute_s=price.compute_s,
                                        compiled_collectives_s=price.collectives_s))


def next_best_steps(chosen: PlannedStep, options: IntraOpOptions, k: int = NEXT_BEST,
                    time_limit_s: float | None = None, starts: Sequence[PlannedStep] = ()) -> list[PlannedStep]:
    """The next-best distinct ILP plans after ``chosen`` (``passes/next_plans.py``) as PlannedSteps named
    "autoshard next-best i"; ``options`` as ``chosen`` was planned with (its budget included); ``starts``:
    other plans of the same graph and mesh (the classic ones) whose layouts hint the re-solves."""
    limit = min(options.time_limit_s, NEXT_BEST_TIME_LIMIT_S) if time_limit_s is None else time_limit_s
    budget = chosen.plan.memory_budget_bytes
    opts = replace(options, memory_budget_bytes=budget, hint=tuple(chosen.result.node_strategies))
    hints = [s.result.node_strategies for s in starts if s.logical_mesh.shape == chosen.logical_mesh.shape]
    results = next_best_plans(chosen.graph, chosen.logical_mesh, opts, chosen.result, k, time_limit_s=limit,
                              starts=hints)
    steps = []
    for i, result in enumerate(results, 1):
        plan = build_plan(chosen.graph, result, budget, {}, name=f"autoshard next-best {i}", explain=False)
        steps.append(PlannedStep(plan, chosen.graph, result.mesh, result))
    return steps


def program_key(plan: Plan) -> str:
    """What decides the program XLA compiles for an SPMD plan: its mesh and every layout it pins."""
    return repr((tuple(plan.mesh_shape), tuple(plan.axis_names), sorted((k, str(v)) for k, v in plan.input_specs.items()),
                 sorted((k, str(v)) for k, v in plan.output_specs.items()),
                 sorted((k, tuple(map(str, v))) for k, v in plan.op_out_specs.items()),
                 sorted((k, sorted((p, tuple(map(str, c))) for p, c in v.items()))
                        for k, v in plan.op_in_reshards.items()),
                 sorted((k, tuple(map(str, v))) for k, v in plan.output_reshards.items())))


def arbitrate(contenders: Sequence[tuple[str, PlannedStep]], *, seconds_before: float = 0.0) -> Arbitration:
    """Compile every contender (all of one graph), price each from its HLO and pick the fastest that fits
    (module docstring). The first contender is the model's choice: it wins ties and stays when none
    compiles."""
    start = time.perf_counter()
    if not contenders:
        raise ValueError("arbitrate needs at least one contender")
    graph = contenders[0][1].graph
    keys = [program_key(step.plan) for _, step in contenders]
    unique = list(dict.fromkeys(keys))  # a kept classic plan is the same program as the classic one
    by_key = dict(zip(unique, compile_plans(graph, [contenders[keys.index(k)][1].plan for k in unique])))
    compiled = [by_key[k] for k in keys]
    rows = []
    for (name, step), result in zip(contenders, compiled):
        price = compiled_price(step.plan, result.summary) if result.summary is not None else None
        rows.append(Contender(name, replace(step, plan=with_price(step.plan, price)), result, price))
    fitting = [c for c in rows if c.price is not None and c.plan.fits]
    winner = min(fitting, key=lambda c: c.price.step_s) if fitting else rows[0]  # type: ignore[union-attr]
    seconds = seconds_before + time.perf_counter() - start
    log.info("compiled arbitration in %.1fs: %s", seconds, ", ".join(
        f"{c.name} {c.compiled_s if c.compiled_s is not None else c.error}" for c in rows))
    return Arbitration(tuple(rows), winner, seconds)


def arbitrate_steps(chosen: PlannedStep, classics: Sequence[tuple[str, PlannedStep]], options: IntraOpOptions,
                    k: int = NEXT_BEST) -> tuple[PlannedStep, dict[str, PlannedStep], Arbitration]:
    """Arbitrate ``chosen`` (the model's plan, named "autoshard"), its next-best plans and ``classics``.

    Returns the plan to return under the name "autoshard" (the winner: a next-best or classic winner says so
    in its solver status, "kept X (compiled)" for a classic one), every classic step with its compiled price,
    and the contest. ``options`` are the planner's, without pins (the next-best plans are autoshard's own).
    """
    start = time.perf_counter()
    nexts = next_best_steps(chosen, options, k, starts=[step for _, step in classics])
    arbitration = arbitrate([("autoshard", chosen), *((s.plan.name, s) for s in nexts), *classics],
                            seconds_before=time.perf_counter() - start)
    winner = arbitration.winner
    status = chosen.plan.solver.status
    if winner.name == "autoshard":
        step = winner.step
    else:
        why = (f"compiled arbitration chose {winner.name}" if winner.name.startswith("autoshard")
               else f"kept {winner.name} (compiled)")
        step = replace(winner.step, plan=replace(winner.plan, name="autoshard",
                                                 solver=replace(chosen.plan.solver, status=f"{status}; {why}")))
    plan = replace(step.plan, arbitration=arbitration.table(),
                   checks={**step.plan.checks, CHECK_NAME: arbitration.summary()})
    priced = {c.name: c.step for c in arbitration.contenders if c.name in dict(classics)}
    return replace(step, plan=plan), priced, arbitration
