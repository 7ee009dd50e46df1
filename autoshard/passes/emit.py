"""Emission: the only place (with runtime/) where plan specs become ``jax.sharding`` objects.

``Annotations`` is the plain-data result of planning that the runtime needs:
a spec per flat input and output, and per op the specs of its outputs and the
specs its inputs must be resharded to (only where they differ from how the
producer left them). ``annotations_from`` lowers an IntraOpResult to it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
    op_in_reshards: Mapping[int, Mapping[int, Spec]]  # op index -> {input position: spec to reshard to}


def annotations_from(result) -> Annotations:  # result: passes.intra_op.IntraOpResult
    graph = result.graph
    op_out = {j: tuple(result.value_specs[v] for v in op.outputs) for j, op in enumerate(graph.ops)}
    reshard: dict[int, dict[int, Spec]] = {}
    for site in result.reshards:
        if site.op_index >= 0:
            reshard.setdefault(site.op_index, {})[site.input_pos] = site.dst
    return Annotations(result.input_specs, result.output_specs, op_out, reshard)


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
