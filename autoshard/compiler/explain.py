"""Why a plan is what it is: each op's strategy against its alternatives.

``op_explanations`` prices, for each op of a solved graph, every strategy the
rule table offers as the op's *contribution to the objective* with the rest of
the plan held fixed (``passes/objective.PlanObjective``, the function the
objective itself is summed from): its compute (the fused roofline) and its
collectives as the ILP prices them (a late reduction's latency paid once by its
combined group), and the resharding charged to it; for an alternative, plus the
change it makes to every reshard it touches, its consumers' included, with the
same runs and one-copy-per-layout rules. The chosen contributions of all ops,
with the write-backs, combined latencies and inputs, sum to the objective; two
strategies' totals differ as the step would. The chosen
strategy is usually the cheapest such; when it is not, the op is tied to
others (a repeated layer or an elementwise chain solved as one ILP variable)
or the memory budget forbade the cheaper one. The plan file keeps the chosen
strategy and the ``top_k`` cheapest alternatives per op, for every op with a
choice except elementwise and shape ops that neither communicate nor reshard
(they follow their producer; keeping them would make files of megabytes).

Inside a loop (a scan's body, flattened by ``ir/trace.py``) prices count every
run, and each explanation says how the loop was planned (``loop_notes``):
its trip count, the layout each carry keeps across iterations, and the layout
each stacked input is read in (leading layer axis whole, sliced per iteration).
"""
from __future__ import annotations

import collections
import re

from autoshard.ir.graph import OpGraph
from autoshard.ir.primitives import Family, facts
from autoshard.passes.objective import Contribution, PlanObjective
from autoshard.passes.strategies import Strategy, strategies_for
from autoshard.plans.ledger import Choice, OpExplanation

_FOLLOWS = (Family.ELEMENTWISE, Family.SHAPE)  # elementwise and shape ops: they follow their producer


def _short(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "bool": "pred"}.get(dtype, dtype)


def _short_source(source: str) -> str:
    return re.sub(r"^.*/", "", source)


def _typed(value) -> str:
    return f"{_short(value.dtype)}[{','.join(map(str, value.shape))}]"


def op_explanations(result, top_k: int = 5) -> dict[int, OpExplanation]:  # result: passes.intra_op.IntraOpResult
    """Every op with more than one strategy: the chosen one and the ``top_k`` cheapest others, each priced as
    the op's contribution to the objective with the rest of the plan fixed (``objective.PlanObjective``)."""
    graph: OpGraph = result.graph
    terms = PlanObjective(graph, result.mesh, result.node_strategies)
    cache: dict[tuple, list[Strategy]] = {}
    out: dict[int, OpExplanation] = {}
    notes = loop_notes(result)
    loop_of = graph.loop_of()
    for j, op in enumerate(graph.ops):
        ins = [graph.values[v] for v in op.inputs]
        outs = [graph.values[v] for v in op.outputs]
        key = (op.primitive, repr(sorted(op.params.items(), key=lambda kv: kv[0]))[:400],
               tuple((v.shape, v.dtype) for v in ins), tuple((v.shape, v.dtype) for v in outs), op.trip_count)
        if key not in cache:
            cache[key] = strategies_for(op, ins, outs, result.mesh)
        options = cache[key]
        if len(options) < 2:
            continue
        chosen_s = terms.op_strategy(j)
        chosen = _choice(chosen_s, terms.contribution(j))
        if facts(op.primitive).family in _FOLLOWS and not chosen.comm_s and not chosen.reshard_s:
            continue
        others = sorted((_choice(s, terms.contribution(j, s)) for s in options
                         if (s.in_specs, s.out_specs) != (chosen_s.in_specs, chosen_s.out_specs)),
                        key=lambda c: c.total_s)
        shapes = " x ".join(map(_typed, ins)) + " -> " + ", ".join(map(_typed, outs))
        out[j] = OpExplanation(op.primitive, _short_source(op.source), shapes, chosen, tuple(others[:top_k]),
                               len(options), _loop_note(graph, j, loop_of, notes))
    return out


def _choice(strategy: Strategy, part: Contribution) -> Choice:
    return Choice(str(strategy), part.compute_s, part.comm_s, part.reshard_s)


def _loop_note(graph: OpGraph, j: int, loop_of: list[int], notes: tuple[str, ...]) -> str:
    k = loop_of[j]
    if k < 0:  # a loop's own pseudo-ops sit outside its body
        k = next((i for i, r in enumerate(graph.loops) if r.start <= j < r.stop), -1)
    if k < 0:
        return ""
    where = "in the body of" if loop_of[j] == k else "at the boundary of"
    return f"{where} {notes[k]}"


def _counted(specs) -> str:
    counts = collections.Counter(specs)
    return ", ".join(f"{spec}" + (f" x{n}" if n > 1 else "") for spec, n in counts.most_common()) or "none"


def loop_notes(result) -> tuple[str, ...]:  # result: passes.intra_op.IntraOpResult
    """Per flattened loop or cond of the graph, one line on how it was planned."""
    graph: OpGraph = result.graph
    notes = []
    for region in graph.loops:
        ops = graph.ops
        where = _short_source(region.source) or "?"
        carries = _counted(str(result.value_specs[ops[t].outputs[0]]) for t in region.carry_ops)
        if region.kind == "cond":
            merged = _counted(str(result.value_specs[ops[t].outputs[0]]) for t in region.final_ops)
            sizes = ", ".join(str(hi - lo) for lo, hi in region.branches)
            notes.append(
                f"the cond at {where}: {len(region.branches)} branches ({sizes} ops) planned like any, operands "
                f"and results shared by every branch in one layout each (operands: {carries}; results: "
                f"{merged}); priced as its costliest branch, branch {region.priced_branch} by FLOPs and bytes "
                f"(the predicate may be data-dependent: the step costs at most that), the others' ops adding "
                f"nothing; memory holds each branch's temporaries only while it runs")
            continue
        if region.kind == "while":
            how = {"derived": "derived from its counter", "bound": "as stated by while_trip_count",
                   "guess": "a guess (set while_trip_count= to state it)"}[region.trip_source]
            notes.append(
                f"the while loop at {where}: trip count {region.length}, {how}; its "
                f"{region.cond_stop - region.body_start} cond ops and {region.body_stop - region.cond_stop} body "
                f"ops planned like any and priced per iteration; carries kept in one layout across iterations "
                f"({carries})")
            continue
        stacked = _counted(str(result.op_strategy(t).in_specs[0]) for t in region.slice_ops)
        notes.append(
            f"the scan at {where}: {region.length} iterations, its "
            f"{region.body_stop - region.body_start} body ops planned like any and priced {region.length} times; "
            f"carries kept in one layout across iterations ({carries}); stacked inputs read with the layer axis "
            f"whole, one slice per iteration ({stacked})")
    return tuple(notes)
