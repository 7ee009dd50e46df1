"""Hand-built plans for tests that must not solve an ILP: a traced graph with chosen storage specs."""
from __future__ import annotations

from collections.abc import Mapping

from autoshard.ir.graph import OpGraph
from autoshard.plans.plan import Ledger, Plan, SolverInfo
from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import get_cluster


def hand_plan(graph: OpGraph, specs: Mapping[int, Spec] | None = None, *, mesh_shape: tuple[int, ...] = (2, 4),
              axis_names: tuple[str, ...] = ("x", "y"), cluster: str = "1x8-a100", peak_bytes: float = 3e6,
              budget_bytes: float | None = None, stages: tuple = (), name: str = "hand") -> Plan:
    """A plan whose inputs are stored as ``specs`` (flat input index -> spec; replicated otherwise)."""
    specs = dict(specs or {})
    values = graph.values
    in_paths = [values[v].path for v in graph.inputs]
    in_specs = {p: specs.get(i, Spec.replicated(values[v].rank))
                for i, (p, v) in enumerate(zip(in_paths, graph.inputs))}
    out_specs = {}
    for k, (path, vid) in enumerate(zip(graph.output_paths, graph.outputs)):
        carried = graph.carried[k] if graph.carried else None
        out_specs[path] = in_specs[in_paths[carried]] if carried is not None else Spec.replicated(values[vid].rank)
    spec = get_cluster(cluster, num_devices=_prod(mesh_shape))
    ledger = Ledger(compute_s=1e-3, comm_s=2e-4, reshard_s=1e-4, bubble_s=0.0, peak_memory_bytes=peak_bytes,
                    memory_by_kind={"param": peak_bytes / 4, "opt_state": peak_bytes / 2, "activation": peak_bytes / 4},
                    collective_bytes={"all-reduce": 1e5}, compute_lower_bound_s=5e-4)
    return Plan(
        mesh_shape=mesh_shape, axis_names=axis_names, cluster=spec, input_specs=in_specs, output_specs=out_specs,
        input_roles={p: values[v].role.value for p, v in zip(in_paths, graph.inputs)},
        input_shapes={p: (values[v].shape, values[v].dtype) for p, v in zip(in_paths, graph.inputs)},
        op_out_specs={}, op_in_reshards={}, ledger=ledger,
        solver=SolverInfo("optimal", 0.0, 0.1, 10, 5, 20, 15, 4), planning_s={"trace": 0.5, "intra-op": 1.0},
        memory_budget_bytes=spec.memory_per_device_bytes if budget_bytes is None else budget_bytes,
        num_ops=len(graph.ops), name=name, stages=stages,
        output_shapes={p: (values[v].shape, values[v].dtype) for p, v in zip(graph.output_paths, graph.outputs)},
        in_tree=str(graph.in_tree),
    )


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
