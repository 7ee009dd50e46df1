"""Plan files: a versioned JSON schema (never pickle: loading runs no code).

Top-level fields (version 1)::

    format, version, autoshard_version, jax_version, name
    mesh: {shape, axis_names}          cluster: ClusterSpec fields
    signature: {inputs: {path: {shape, dtype, role}}, num_ops}
    input_specs / output_specs: {path: [[mesh axes per dim], ...]}
    op_out_specs: {op index: [spec, ...]}    op_in_reshards: {op index: {input position: spec}}
    ledger, solver, planning_s, memory_budget_bytes, stages, num_microbatches, schedule, alternatives

``check_signature`` compares a plan with a freshly traced graph and says
exactly what differs (which argument, which shape, which mesh axis).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax

from autoshard.compiler.graph import OpGraph
from autoshard.compiler.plan import Ledger, Plan, SolverInfo
from autoshard.compiler.spec import Spec
from autoshard.errors import PlanMismatchError, PlanningError
from autoshard.meshes.cluster import ClusterSpec, ClusterSpecError

FORMAT = "autoshard-plan"
VERSION = 1


class PlanFileError(PlanningError):
    """A plan file is unreadable or malformed; the message names the field."""


def _specs_json(specs: Mapping[Any, Spec]) -> dict[str, list[list[str]]]:
    return {str(k): s.to_json() for k, s in specs.items()}


def plan_to_json(plan: Plan) -> dict[str, Any]:
    from autoshard import __version__

    return {
        "format": FORMAT,
        "version": VERSION,
        "autoshard_version": __version__,
        "jax_version": jax.__version__,
        "name": plan.name,
        "mesh": {"shape": list(plan.mesh_shape), "axis_names": list(plan.axis_names)},
        "cluster": plan.cluster.to_dict(),
        "signature": {
            "inputs": {p: {"shape": list(shape), "dtype": dtype, "role": plan.input_roles.get(p, "")}
                       for p, (shape, dtype) in plan.input_shapes.items()},
            "num_ops": plan.num_ops,
        },
        "input_specs": _specs_json(plan.input_specs),
        "output_specs": _specs_json(plan.output_specs),
        "op_out_specs": {str(k): [s.to_json() for s in v] for k, v in plan.op_out_specs.items()},
        "op_in_reshards": {str(k): {str(pos): [s.to_json() for s in chain] for pos, chain in v.items()}
                           for k, v in plan.op_in_reshards.items()},
        "output_reshards": {str(k): [s.to_json() for s in chain] for k, chain in plan.output_reshards.items()},
        "ledger": {**asdict(plan.ledger), "step_s": plan.ledger.step_s},
        "solver": asdict(plan.solver),
        "planning_s": dict(plan.planning_s),
        "memory_budget_bytes": plan.memory_budget_bytes,
        "stages": list(plan.stages),
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "alternatives": dict(plan.alternatives),
    }


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan_to_json(plan), indent=1, sort_keys=False))


def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise PlanFileError(f"{where}: missing field {key!r}")
    value = data[key]
    if not isinstance(value, kind):
        raise PlanFileError(f"{where}: field {key!r} should be {getattr(kind, '__name__', kind)}, "
                            f"got {type(value).__name__}")
    return value


def _spec(data: Any, axis_names: Sequence[str], where: str) -> Spec:
    if not isinstance(data, list) or not all(isinstance(d, list) and all(isinstance(a, str) for a in d)
                                             for d in data):
        raise PlanFileError(f"{where}: a spec is a list of lists of mesh axis names, got {data!r}")
    spec = Spec.from_json(data)
    unknown = [a for a in spec.used_axes if a not in axis_names]
    if unknown:
        raise PlanFileError(f"{where}: spec {spec} uses mesh axes {unknown} not in the plan's mesh {list(axis_names)}")
    if len(set(spec.used_axes)) != len(spec.used_axes):
        raise PlanFileError(f"{where}: spec {spec} uses a mesh axis twice")
    return spec


def plan_from_json(data: Any, source: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: not a plan (expected a JSON object)")
    if data.get("format") != FORMAT:
        raise PlanFileError(f"{source}: not an autoshard plan file (format {data.get('format')!r})")
    version = _field(data, "version", int, source)
    if version > VERSION:
        raise PlanFileError(f"{source}: plan file version {version} is newer than this autoshard reads "
                            f"({VERSION}); upgrade autoshard")
    mesh = _field(data, "mesh", dict, source)
    shape = tuple(int(s) for s in _field(mesh, "shape", list, f"{source}: mesh"))
    names = tuple(str(a) for a in _field(mesh, "axis_names", list, f"{source}: mesh"))
    if len(shape) != len(names):
        raise PlanFileError(f"{source}: mesh shape {shape} and axis names {names} differ in length")
    try:
        cluster = ClusterSpec.from_dict(_field(data, "cluster", dict, source), source=f"{source}: cluster")
    except ClusterSpecError as err:
        raise PlanFileError(str(err)) from None
    sig = _field(data, "signature", dict, source)
    inputs = _field(sig, "inputs", dict, f"{source}: signature")
    input_shapes = {p: (tuple(int(s) for s in v["shape"]), str(v["dtype"])) for p, v in inputs.items()}
    input_roles = {p: str(v.get("role", "")) for p, v in inputs.items()}
    in_specs = {p: _spec(s, names, f"{source}: input_specs[{p}]")
                for p, s in _field(data, "input_specs", dict, source).items()}
    missing = sorted(set(input_shapes) - set(in_specs))
    if missing:
        raise PlanFileError(f"{source}: input_specs lacks {missing[:3]}")
    out_specs = {p: _spec(s, names, f"{source}: output_specs[{p}]")
                 for p, s in _field(data, "output_specs", dict, source).items()}
    op_out = {int(k): tuple(_spec(s, names, f"{source}: op_out_specs[{k}]") for s in v)
              for k, v in _field(data, "op_out_specs", dict, source).items()}
    op_in = {int(k): {int(pos): tuple(_spec(s, names, f"{source}: op_in_reshards[{k}]") for s in chain)
                      for pos, chain in v.items()}
             for k, v in _field(data, "op_in_reshards", dict, source).items()}
    out_reshards = {int(k): tuple(_spec(s, names, f"{source}: output_reshards[{k}]") for s in chain)
                    for k, chain in data.get("output_reshards", {}).items()}
    led = _field(data, "ledger", dict, source)
    sol = _field(data, "solver", dict, source)
    try:
        ledger = Ledger(**{k: v for k, v in led.items() if k != "step_s"})
        solver = SolverInfo(**sol)
    except TypeError as err:
        raise PlanFileError(f"{source}: ledger/solver fields do not match this autoshard: {err}") from None
    return Plan(
        mesh_shape=shape, axis_names=names, cluster=cluster, input_specs=in_specs, output_specs=out_specs,
        input_roles=input_roles, input_shapes=input_shapes, op_out_specs=op_out, op_in_reshards=op_in,
        ledger=ledger, solver=solver, planning_s=dict(data.get("planning_s", {})),
        memory_budget_bytes=float(_field(data, "memory_budget_bytes", (int, float), source)),
        num_ops=int(_field(sig, "num_ops", int, f"{source}: signature")), name=str(data.get("name", "plan")),
        stages=tuple(data.get("stages", ())), num_microbatches=int(data.get("num_microbatches", 1)),
        schedule=str(data.get("schedule", "spmd")), alternatives=dict(data.get("alternatives", {})),
        output_reshards=out_reshards,
    )


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.exists():
        raise PlanFileError(f"plan file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PlanFileError(f"plan file {path} is not valid JSON (truncated or hand-edited?): {err}") from None
    try:
        return plan_from_json(data, str(path))
    except (KeyError, ValueError, TypeError) as err:
        if isinstance(err, PlanningError):
            raise
        raise PlanFileError(f"plan file {path} is malformed: {type(err).__name__}: {err}") from None


def check_signature(plan: Plan, graph: OpGraph) -> None:
    """Raise PlanMismatchError naming each input whose path, shape or dtype differs from the plan's."""
    got = {graph.values[v].path: (graph.values[v].shape, graph.values[v].dtype) for v in graph.inputs}
    problems: list[str] = []
    for path, (shape, dtype) in plan.input_shapes.items():
        if path not in got:
            problems.append(f"argument {path} is in the plan but not in the function's arguments")
        elif got[path] != (shape, dtype):
            problems.append(f"argument {path}: plan has {dtype}{list(shape)}, function has "
                            f"{got[path][1]}{list(got[path][0])}")
    for path in got:
        if path not in plan.input_shapes:
            problems.append(f"argument {path} is new: the plan has no spec for it")
    if not problems and len(graph.ops) != plan.num_ops:
        problems.append(f"the traced step has {len(graph.ops)} operations, the plan was made for {plan.num_ops}: "
                        "the model code changed; plan again")
    if problems:
        raise PlanMismatchError("the plan does not match this train step:\n  " + "\n  ".join(problems[:20]))


def check_mesh(plan: Plan, shape: Sequence[int], axis_names: Sequence[str]) -> None:
    problems = []
    if tuple(axis_names) != plan.axis_names:
        problems.append(f"mesh axes are {tuple(axis_names)}, the plan's are {plan.axis_names}")
    for name, planned, size in zip(plan.axis_names, plan.mesh_shape, shape):
        if planned != size:
            problems.append(f"mesh axis {name!r} has {size} devices, the plan needs {planned}")
    if len(shape) != len(plan.mesh_shape):
        problems.append(f"mesh has {len(shape)} axes, the plan has {len(plan.mesh_shape)}")
    if problems:
        raise PlanMismatchError("the plan does not match this mesh: " + "; ".join(problems))
