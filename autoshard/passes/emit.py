"""Emission: the only place (with runtime/) where plan specs become ``jax.sharding`` objects.

``Annotations`` is the plain-data result of planning that the runtime needs:
a spec per flat input and output, and per op the specs of its outputs and the
specs its inputs must be resharded to (only where they differ from how the
producer left them). ``annotations_from`` lowers an IntraOpResult to it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoshard.compiler.spec import Spec
from autoshard.meshes.logical import LogicalMesh


@dataclass(frozen=True)
class Annotations:
    input_specs: tuple[Spec, ...]
    output_specs: tuple[Spec, ...]
    op_out_specs: Mapping[int, tuple[Spec, ...]]  # op index -> spec of each output
    # op index -> {input position: layouts to pin in order, the last being the spec the op reads}
    op_in_reshards: Mapping[int, Mapping[int, tuple[Spec, ...]]]
    # flat output index -> layouts to pin before returning (state written back to its storage layout)
    output_reshards: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)


def annotations_from(result) -> Annotations:  # result: passes.intra_op.IntraOpResult
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
    return Annotations(result.input_specs, result.output_specs, op_out, reshard, outputs)


def partition_spec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*spec.partition_entries())


def named_sharding(spec: Spec, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(spec))


def make_jax_mesh(logical: LogicalMesh | tuple[int, ...], axis_names: Sequence[str] | None = None,
                  devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A jax Mesh with Auto axis types (GSPMD-style planning; see JAX-NOTES) over ``devices``."""
    if isinstance(logical, LogicalMesh):
        shape, names = logical.shape, logical.axis_names
    else:
        shape, names = tuple(logical), tuple(axis_names or ())
    devices = list(devices) if devices is not None else jax.devices()[: int(np.prod(shape))]
    if len(devices) != int(np.prod(shape)):
        raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, got {len(devices)}")
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
