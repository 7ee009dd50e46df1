"""Decoding: one class choice per ILP variable becomes a plan on the whole graph (``IntraOpResult``).

``decode`` maps each class choice back to every node's own strategy, derives the spec of every value and
the reshard on every edge whose producer and consumer disagree, prices the plan (per-op compute and
collectives, the reshards, the batch's arrival), simulates its memory as XLA lays it out
(``memory_profile``) and checks the objective on the unsimplified graph (``passes/objective.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from autoshard.ir.graph import OpGraph, ValueId, dtype_itemsize
from autoshard.ir.spec import Spec
from autoshard.passes import objective
from autoshard.passes.cost_graph import CostGraph
from autoshard.passes.deferral import partial_sum_spans
from autoshard.passes.memory_model import MemorySimulation, simulate
from autoshard.passes.objective import op_comm_s
from autoshard.passes.plan_result import IlpStats, IntraOpResult, PassClock, ReshardSite
from autoshard.passes.resharding import reshard
from autoshard.passes.strategies import Strategy

__all__ = ["decode", "memory_profile", "memory_simulation"]


def decode(cg: CostGraph, choices: np.ndarray, stats: IlpStats, clock: PassClock | None = None) -> IntraOpResult:
    """The plan of ``choices`` (module docstring); ``clock`` times the ``decode`` and ``memory`` passes."""
    clock = clock or PassClock()
    with clock.timing("decode"):
        chosen, value_specs, input_specs, reshards, output_specs = _specs_and_reshards(cg, choices)
    with clock.timing("memory"):
        profile, by_role = memory_profile(cg.graph, value_specs, cg.sizes, reshards, chosen[cg.num_inputs:],
                                          f32_compute_dtypes=cg.mesh.cluster.f32_compute_dtypes)
    with clock.timing("decode", new_run=False):
        result = _priced(cg, choices, stats, chosen, value_specs, input_specs, tuple(output_specs), tuple(reshards),
                         profile, by_role)
    return dataclasses.replace(result, ilp=dataclasses.replace(result.ilp, pass_times=clock.snapshot()))


def _specs_and_reshards(cg: CostGraph, choices: np.ndarray) -> tuple[
        tuple[Strategy, ...], dict[ValueId, Spec], tuple[Spec, ...], list[ReshardSite], list[Spec]]:
    """Every node's chosen strategy, every value's spec, the inputs' and outputs' specs, the reshards."""
    graph, cls = cg.graph, cg.classes
    chosen = tuple(cg.strategies[node][cls.strategy_map[node][choices[cls.node_class[node]]]]
                   for node in range(len(cg.strategies)))
    value_specs: dict[ValueId, Spec] = {}
    for vid, (node, k) in cg.producer.items():
        value_specs[vid] = chosen[node].out_specs[k]
    input_specs = tuple(chosen[i].out_specs[0] for i in range(cg.num_inputs))
    reshards: list[ReshardSite] = []
    for p, k, c, pos, vid in cg.edge_sites():
        src = chosen[p].out_specs[k]
        dst = chosen[c].out_specs[0] if pos < 0 else chosen[c].in_specs[pos]
        if src != dst:
            value = graph.values[vid]
            r = reshard(value.shape, dtype_itemsize(value.dtype), src, dst, cg.mesh)
            op_index = -1 if pos < 0 else c - cg.num_inputs
            runs = cg.edge_weight(c, pos)
            reshards.append(ReshardSite(op_index, pos, vid, src, dst, r.seconds * runs, tuple(r.collectives),
                                        tuple(r.path), runs))
    output_specs = []
    for out_index, vid in enumerate(graph.outputs):
        carried = graph.carried[out_index] if graph.carried else None
        if carried is not None:
            output_specs.append(input_specs[carried])
        else:
            output_specs.append(value_specs.get(vid, Spec.replicated(graph.values[vid].rank)))
    return chosen, value_specs, input_specs, reshards, output_specs


def _priced(cg: CostGraph, choices: np.ndarray, stats: IlpStats, chosen: tuple[Strategy, ...],
            value_specs: dict[ValueId, Spec], input_specs: tuple[Spec, ...], output_specs: tuple[Spec, ...],
            reshards: tuple[ReshardSite, ...], profile: np.ndarray, by_role: dict[str, float]) -> IntraOpResult:
    """The plan priced (compute, collectives, reshards) and its objective checked on the whole graph."""
    graph, cls = cg.graph, cg.classes
    own = [int(cls.strategy_map[cg.num_inputs + j][choices[cls.node_class[cg.num_inputs + j]]])
           for j in range(len(graph.ops))]
    work = [cg.op_work(j) for j in range(len(graph.ops))]
    op_compute = tuple(float(w[0][a]) for w, a in zip(work, own))
    op_bytes = tuple(float(w[1][a]) for w, a in zip(work, own))
    op_comm = op_comm_s(graph, cg.mesh, chosen[cg.num_inputs:], cg.late)
    result = IntraOpResult(
        graph=graph, mesh=cg.mesh, node_strategies=chosen, value_specs=value_specs, input_specs=input_specs,
        output_specs=output_specs, reshards=reshards,
        compute_s=float(sum(op_compute)), comm_s=float(sum(op_comm)), op_comm_s=op_comm,
        reshard_s=float(sum(r.seconds for r in {(r.value, r.src, r.dst, r.runs): r for r in reshards}.values())),
        memory_profile=profile, memory_by_role=by_role, ilp=stats, op_compute_s=op_compute, op_hbm_bytes=op_bytes,
        input_s=float(sum(chosen[i].compute_s for i in range(cg.num_inputs))), class_choices=np.asarray(choices),
    )
    recomputed = objective.check(graph, cg.mesh, chosen, stats.objective_s, result.step_s, traffic=cg.traffic)
    return dataclasses.replace(result, objective=recomputed)


def memory_profile(graph: OpGraph, value_specs: Mapping[ValueId, Spec], sizes: Mapping[str, int],
                   reshards: Sequence[ReshardSite] = (), op_strategies: Sequence[Strategy] | None = None,
                   f32_compute_dtypes: Sequence[str] = ()) -> tuple[np.ndarray, dict[str, float]]:
    """Per-device bytes at each point of XLA:CPU's schedule, and the split by kind at the peak.

    ``passes/liveness.py`` says which XLA behaviour each rule models: fusion,
    the breadth-first schedule, collectives and their combining, donation.
    The profile is arguments + non-donated outputs + live temporaries, the
    figure ``compiled.memory_analysis()`` reports. ``op_strategies`` (one per
    op) supply the partial-sum all-reduces and reduce-scatters of the chosen
    strategies.
    """
    sim = memory_simulation(graph, value_specs, sizes, reshards, op_strategies, f32_compute_dtypes)
    profile = sim.profile()
    return profile, sim.by_kind_at(int(np.argmax(profile)))


def memory_simulation(graph: OpGraph, value_specs: Mapping[ValueId, Spec], sizes: Mapping[str, int],
                      reshards: Sequence[ReshardSite] = (), op_strategies: Sequence[Strategy] | None = None,
                      f32_compute_dtypes: Sequence[str] = ()) -> MemorySimulation:
    """The simulation behind :func:`memory_profile`, its buffers (``MemorySimulation.spans``) kept."""
    collectives: dict[int, tuple] = {}
    reductions: dict[int, str | None] = {}
    for t, strategy in enumerate(op_strategies or ()):
        if strategy.collectives:
            collectives[t] = strategy.collectives
            reductions[t] = strategy.reduction
    return simulate(graph, value_specs, sizes, reshards, collectives, reductions, f32_compute_dtypes,
                    held=partial_sum_spans(graph, op_strategies or (), sizes))
