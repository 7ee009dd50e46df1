"""Emission: the solver's result in the one shape the runtime reads (``plans.annotations.Annotations``).

``annotations_from`` lowers an IntraOpResult: per op the specs of its outputs
and the layout chain each resharded input is pinned through, per carried
output the chain that writes it back to its storage layout, and the reductions
left to the end of their scan (``passes/deferral.py``). The driver stores
these in the Plan (``compiler/driver.build_plan``); ``runtime/applied.py`` turns
a Plan back into Annotations for the runtime, which alone makes
``jax.sharding`` objects of them.
"""
from __future__ import annotations

from autoshard.ir.spec import Spec
from autoshard.passes.deferral import deferral, stack_sites
from autoshard.passes.intra_op import IntraOpResult
from autoshard.plans.annotations import Annotations, Deferral


def annotations_from(result: IntraOpResult) -> Annotations:
    graph = result.graph
    op_out = {j: tuple(result.value_specs[v] for v in op.outputs) for j, op in enumerate(graph.ops)}
    reshard: dict[int, dict[int, tuple[Spec, ...]]] = {}
    carried_chain: dict[int, tuple[Spec, ...]] = {}
    for site in result.reshards:
        if site.op_index >= 0:
            reshard.setdefault(site.op_index, {})[site.input_pos] = site.chain
        else:
            carried_chain[site.value] = site.chain
    outputs = {k: carried_chain[v] for k, v in enumerate(graph.outputs) if v in carried_chain}
    return Annotations(result.input_specs, result.output_specs, op_out, reshard, outputs, deferrals(result))


def deferrals(result: IntraOpResult) -> dict[int, Deferral]:
    """The chosen deferred reductions (``passes/deferral.py``), each as the runtime emits it."""
    graph = result.graph
    chosen = [j for j in range(len(graph.ops)) if result.op_strategy(j).deferred_over]
    if not chosen:
        return {}
    sites = stack_sites(graph)
    return {j: deferral(graph, j, result.op_strategy(j), sites[j]) for j in chosen}
