"""Why a plan is what it is: each op's strategy against its alternatives.

``op_explanations`` prices, for each op of a solved graph, every strategy the
rule table offers *locally*: its own compute (the fused roofline of the cost
model, ``passes/hbm_traffic.py``) and collectives, plus the
resharding it would need from the layouts its producers were given and to
the layouts its consumers read (the rest of the plan held fixed). The chosen
strategy is usually the cheapest such; when it is not, the op is tied to
others (a repeated layer or an elementwise chain solved as one ILP variable)
or the memory budget forbade the cheaper one. The plan file keeps the chosen
strategy and the ``top_k`` cheapest alternatives per op, for every op with a
choice except elementwise and view ops that neither communicate nor reshard
(they follow their producer; keeping them would make files of megabytes).

Inside a loop (a scan's body, flattened by ``ir/trace.py``) prices count every
iteration, and each explanation says how the loop was planned (``loop_notes``):
its trip count, the layout each carry keeps across iterations, and the layout
each stacked input is read in (leading layer axis whole, sliced per iteration).
"""
from __future__ import annotations

import collections
import re

import numpy as np

from autoshard.ir.graph import OpGraph, ValueId
from autoshard.plans.ledger import Choice, OpExplanation
from autoshard.ir.spec import Spec
from autoshard.passes.liveness import FUSIBLE
from autoshard.meshes.cost import roofline_s
from autoshard.passes.hbm_traffic import compute_dtype, op_traffic, strategy_hbm_bytes
from autoshard.passes.resharding import reshard
from autoshard.passes.strategies import Strategy, strategies_for

_VIEWS = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "slice", "concatenate", "pad", "select_n"})


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize if dtype in np.sctypeDict else 4


def _short(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "bool": "pred"}.get(dtype, dtype)


def _short_source(source: str) -> str:
    return re.sub(r"^.*/", "", source)


def _typed(value) -> str:
    return f"{_short(value.dtype)}[{','.join(map(str, value.shape))}]"


def op_explanations(result, top_k: int = 5) -> dict[int, OpExplanation]:  # result: passes.intra_op.IntraOpResult
    """Every op with more than one strategy: the chosen one and the ``top_k`` cheapest others, priced locally."""
    graph: OpGraph = result.graph
    mesh = result.mesh
    num_inputs = len(graph.inputs)
    readers: dict[ValueId, list[tuple[Spec, ValueId]]] = collections.defaultdict(list)
    for j, op in enumerate(graph.ops):
        chosen = result.node_strategies[num_inputs + j]
        for pos, vid in enumerate(op.inputs):
            if vid in result.value_specs:
                readers[vid].append((chosen.in_specs[pos], vid))
    for k, vid in enumerate(graph.outputs):
        carried = graph.carried[k] if graph.carried else None
        if carried is not None:
            readers[vid].append((result.input_specs[carried], vid))
    cache: dict[tuple, list[Strategy]] = {}
    out: dict[int, OpExplanation] = {}
    notes = loop_notes(result)
    loop_of = graph.loop_of()
    traffic = op_traffic(graph)
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    for j, op in enumerate(graph.ops):
        ins = [graph.values[v] for v in op.inputs]
        outs = [graph.values[v] for v in op.outputs]
        key = (op.primitive, repr(sorted(op.params.items(), key=lambda kv: kv[0]))[:400],
               tuple((v.shape, v.dtype) for v in ins), tuple((v.shape, v.dtype) for v in outs), op.trip_count)
        if key not in cache:
            cache[key] = strategies_for(op, ins, outs, mesh)
        options = cache[key]
        chosen_s = result.node_strategies[num_inputs + j]
        if len(options) < 2:
            continue

        def price(s: Strategy) -> Choice:
            seconds = 0.0
            for pos, value in enumerate(ins):
                src = result.value_specs.get(value.id)
                if src is not None and src != s.in_specs[pos]:
                    seconds += reshard(value.shape, _itemsize(value.dtype), src, s.in_specs[pos], mesh).seconds
            for k, value in enumerate(outs):
                for dst, _vid in readers.get(value.id, ()):
                    if dst != s.out_specs[k]:
                        seconds += reshard(value.shape, _itemsize(value.dtype), s.out_specs[k], dst, mesh).seconds
            hbm = op.trip_count * strategy_hbm_bytes(graph, op, traffic[j], s.in_specs, s.out_specs, sizes)
            compute = float(roofline_s(mesh.cluster, s.flops, hbm, compute_dtype(op, graph)))
            return Choice(str(s), compute, s.comm_s * op.trip_count, seconds * op.trip_count)

        chosen = price(chosen_s)
        if op.primitive in FUSIBLE | _VIEWS and not chosen.comm_s and not chosen.reshard_s:
            continue
        others = sorted((price(s) for s in options
                         if (s.in_specs, s.out_specs) != (chosen_s.in_specs, chosen_s.out_specs)),
                        key=lambda c: c.total_s)
        shapes = " x ".join(map(_typed, ins)) + " -> " + ", ".join(map(_typed, outs))
        out[j] = OpExplanation(op.primitive, _short_source(op.source), shapes, chosen, tuple(others[:top_k]),
                               len(options), _loop_note(graph, j, loop_of, notes))
    return out


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
