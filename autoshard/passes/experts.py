"""Expert x data storage layouts: search starts in the expert-parallel basin (GShard, DeepSpeed-MoE).

An *expert weight* is a parameter that enters a ``dot_general`` with one of its
dimensions among the contraction's batch dimensions (``einsum("egcd,edf->egcf")``:
each expert's weights multiply only that expert's tokens), directly or through
dtype casts and copies. That is a structural fact of the jaxpr, whatever the
model calls its weights or how it routes (einsum masks or sort + gather/scatter).

Expert parallelism splits that dimension over mesh axes ``E``: each device holds
its experts whole, and the tokens move between a layout split by routing group
(the batch) and one split by expert with all-to-alls, which the resharding
model prices (``passes/resharding.py``) on the links those axes cross. The
batch stays split over every axis (data parallelism outside the experts), so
expert weight gradients are reduced only over the axes ``D`` outside ``E``. No rule forces this: the strategies and reshards
are the ordinary ones. These layouts only start the local search in that basin
(``passes/search_starts.py``), since from a data-parallel start moving one
expert weight alone to an expert split costs more than it saves.

``expert_layouts`` gives, for every choice of ``E`` (each mesh axis, and all
axes together) that divides every expert dimension: expert weights (and the
optimizer state that mirrors them) split over ``E``, the batch over all axes,
everything else replicated; and the same with the other parameters and state
sharded over all axes (ZeRO beside the experts).

What expert parallelism cannot remove: with fewer experts than devices, some
axis ``D`` lies outside ``E``, and every expert weight gradient is reduced over
it. For ``examples/moe.py`` "large" (8 experts, fp32) on two 8-A100 nodes,
``E = y`` (NVLink) and ``D = x`` (25 Gbit/s): 32 MiB of expert weights per
device and layer cost 5.4 ms to reduce-scatter and 5.4 ms to gather back over
``x``, 259 ms over 24 layers; moving the tokens over ``x`` instead (``E = x``)
costs 485 ms of all-to-alls. That floor is why SPMD plans of that model stay
within a few percent of one another there.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping

from autoshard.ir.graph import OpGraph, Role, ValueId
from autoshard.ir.primitives import Values, primitives
from autoshard.ir.spec import MeshAxes, Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.classic import batch_spec, largest_dim_spec, mirror_params

# the same values, maybe in another precision: a parameter's experts dim survives them
PASS_THROUGH = primitives(lambda f: f.values in (Values.COPY, Values.CAST, Values.BARRIER))


def expert_dims(graph: OpGraph) -> dict[int, int]:
    """Flat input index -> the dimension of that parameter that a dot_general batches over (its experts)."""
    producers = graph.producers()
    param_index = {vid: i for i, vid in enumerate(graph.inputs) if graph.values[vid].role == Role.PARAM}

    def source(vid: ValueId) -> ValueId:
        while vid not in param_index and vid in producers and producers[vid].primitive in PASS_THROUGH:
            vid = producers[vid].inputs[0]
        return vid

    found: dict[int, int] = {}
    for op in graph.ops:
        if op.primitive != "dot_general":
            continue
        (_contract, (lhs_batch, rhs_batch)) = op.params["dimension_numbers"]
        for operand, batch_dims in zip(op.inputs[:2], (lhs_batch, rhs_batch)):
            root = source(operand)
            if root in param_index and len(batch_dims) == 1:
                found.setdefault(param_index[root], int(batch_dims[0]))
    return found


def expert_layouts(graph: OpGraph, mesh: LogicalMesh) -> list[dict[int, Spec]]:
    """Expert x data storage layouts (module docstring); none when the step has no expert weights."""
    experts = expert_dims(graph)
    if not experts:
        return []
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    axes = [a for a in mesh.axis_names if sizes[a] > 1]
    choices: list[MeshAxes] = [(a,) for a in axes]
    if len(axes) > 1:
        choices.append(tuple(axes))
    layouts = []
    for expert_axes, shard_rest in itertools.product(choices, (False, True)):
        n = 1
        for a in expert_axes:
            n *= sizes[a]
        shapes = {i: graph.values[graph.inputs[i]].shape for i in experts}
        if any(shapes[i][d] % n for i, d in experts.items()):
            continue
        layouts.append(_layout(graph, experts, expert_axes, axes, sizes, shard_rest))
    return layouts


def _layout(graph: OpGraph, experts: Mapping[int, int], expert_axes: MeshAxes, axes: list[str],
            sizes: Mapping[str, int], shard_rest: bool) -> dict[int, Spec]:
    weights: dict[int, Spec] = {}
    for i, d in experts.items():
        rank = graph.values[graph.inputs[i]].rank
        weights[i] = Spec(tuple(expert_axes if k == d else () for k in range(rank)))
    layout: dict[int, Spec] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        if value.role == Role.BATCH:
            layout[i] = batch_spec(value.shape, axes, sizes)
        elif shard_rest and value.role in (Role.PARAM, Role.OPT_STATE):
            layout[i] = largest_dim_spec(value.shape, axes, sizes)
        else:
            layout[i] = Spec.replicated(value.rank)
    layout.update(weights)
    layout.update(mirror_params(graph, weights))
    return layout
