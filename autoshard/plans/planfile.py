"""Plan files: a versioned JSON schema (never pickle: loading runs no code).

Top-level fields (version 2; version 1 files, without the fields marked v2, still load)::

    format: "autoshard-plan", version, autoshard_version, jax_version, created (ISO time), name
    origin: {target, config, ...}      how the step was built (the CLI fills it; `verify plan.json` uses it)  v2
    mesh: {shape, axis_names}          cluster: ClusterSpec fields
    signature: {inputs: {path: {shape, dtype, role}}, outputs: {path: {shape, dtype}} (v2),
                in_tree: str(PyTreeDef) (v2), num_ops}
    input_specs / output_specs: {path: [[mesh axes per dim], ...]}   ([] per replicated dim)
    op_out_specs: {op index: [spec, ...]}    op_in_reshards: {op index: {input position: [spec, ...]}}
    output_reshards: {flat output index: [spec, ...]}
    ledger: {compute_s, comm_s, reshard_s, bubble_s, step_s, peak_memory_bytes,
             memory_by_kind: {param, opt_state, batch, activation, resharded, ...}, collective_bytes: {kind: bytes},
             compute_lower_bound_s}
    solver: {status, gap, solve_s, num_nodes, num_classes, num_variables, num_constraints, num_edges}
    planning_s: {pass: seconds}   memory_budget_bytes   num_microbatches   schedule
    stages: [{kind: "pipeline-stage", index, first_layer, last_layer, submesh, device_indices, mesh_shape,
              axis_names, param_specs: {path: spec}, batch_specs: {path: spec}, time_s, compute_s, sync_s,
              transfer_out_s, memory: {params_bytes, grads_bytes, opt_state_bytes, activations_bytes,
              in_flight}, num_params}, ...]   (other objects are kept as they are)
    pipeline: {num_microbatches, schedule, step_s, first_microbatch_latency_s, bottleneck_s,
               bubble_fraction, layers, cost_model, intra_stage, spmd_step_s, spmd_mesh, notes} or null
    alternatives: {mesh shape: step s}
    explanations: {op index: {primitive, source, shapes, num_strategies,                              v2
                              chosen: [strategy, compute_s, comm_s, reshard_s], alternatives: [[...], ...]}}
    baselines: {strategy: {step_s, peak_memory_bytes, fits, batch_ceiling, speedup}}                  v2
    checks: {check: result}            e.g. numerics against one device (a launch bundle records it)    optional
    layer_times: [{name, flops_s, hbm_s, comm_s, reshard_s}, ...]   the step split per layer          optional

Fields marked optional are absent from older files (and ignored by older readers); they load as empty.

Every spec is checked against the mesh's axis names on load; a missing or
mistyped field raises ``PlanFileError`` naming it.

``check_signature`` compares a plan with a freshly traced graph and says
exactly what differs (which argument, which shape, which mesh axis).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax

from autoshard.errors import PlanMismatchError, PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import ClusterSpec, ClusterSpecError
from autoshard.plans.breakdown import LayerTime
from autoshard.plans.ledger import Choice, Ledger, OpExplanation, SolverInfo
from autoshard.plans.stage_plan import PipelineStage, PipelineSummary, StageMemory
from autoshard.version import __version__

# Functions here read a Plan's fields (``plans/plan.py`` imports this module, so it takes the plan as
# a plain object: ``PlanLike``); ``plan_fields`` returns the keyword arguments of ``Plan``.
PlanLike = Any

FORMAT = "autoshard-plan"
VERSION = 2


class PlanFileError(PlanningError):
    """A plan file is unreadable or malformed; the message names the field."""


def _specs_json(specs: Mapping[Any, Spec]) -> dict[str, list[list[str]]]:
    return {str(k): s.to_json() for k, s in specs.items()}


def plan_to_json(plan: PlanLike) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "autoshard_version": __version__,
        "jax_version": jax.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "name": plan.name,
        "origin": dict(plan.origin),
        "mesh": {"shape": list(plan.mesh_shape), "axis_names": list(plan.axis_names)},
        "cluster": plan.cluster.to_dict(),
        "signature": {
            "inputs": {p: {"shape": list(shape), "dtype": dtype, "role": plan.input_roles.get(p, "")}
                       for p, (shape, dtype) in plan.input_shapes.items()},
            "outputs": {p: {"shape": list(shape), "dtype": dtype} for p, (shape, dtype) in plan.output_shapes.items()},
            "in_tree": plan.in_tree,
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
        "stages": [_stage_json(s, i) for i, s in enumerate(plan.stages)],
        "pipeline": _pipeline_json(plan.pipeline),
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "alternatives": dict(plan.alternatives),
        "explanations": {str(k): _explanation_json(e) for k, e in plan.explanations.items()},
        "baselines": {k: dict(v) for k, v in plan.baselines.items()},
        "checks": dict(plan.checks),
        "layer_times": [asdict(t) for t in plan.layer_times],
    }


def _stage_json(stage: Any, index: int) -> dict[str, Any]:
    """A pipeline stage as JSON: PipelineStage fields with specs as lists, or a plain mapping as is."""
    if isinstance(stage, PipelineStage):
        data: dict[str, Any] = {"kind": "pipeline-stage"}
        for f in dataclasses.fields(PipelineStage):
            value = getattr(stage, f.name)
            if f.name in ("param_specs", "batch_specs"):
                value = {k: s.to_json() for k, s in value.items()}
            elif isinstance(value, StageMemory):
                value = asdict(value)
            elif isinstance(value, tuple):
                value = list(value)
            data[f.name] = value
        return data
    if isinstance(stage, Mapping):
        return dict(stage)
    raise PlanFileError(f"stage {index} is a {type(stage).__name__}, which a plan file cannot hold")


def _stage(data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(data).__name__}")
    if data.get("kind") != "pipeline-stage":
        return dict(data)
    body = {k: v for k, v in data.items() if k != "kind"}
    fields = _record(PipelineStage, {k: v for k, v in body.items() if k != "num_params"}, where, partial=True)
    names = tuple(_field(body, "axis_names", list, where))
    for key in ("param_specs", "batch_specs"):
        fields[key] = {p: _spec(s, names, f"{where}.{key}[{p}]") for p, s in _field(body, key, dict, where).items()}
    fields["memory"] = StageMemory(**_record(StageMemory, _field(body, "memory", dict, where), f"{where}.memory"))
    for key in ("submesh", "device_indices", "mesh_shape", "axis_names"):
        fields[key] = tuple(fields[key])
    return PipelineStage(**fields, num_params=int(body.get("num_params", 0)))


def _pipeline_json(summary: Any) -> dict[str, Any] | None:
    if summary is None:
        return None
    data = asdict(summary)
    data["notes"] = list(data.get("notes", ()))
    return data


def _pipeline(data: Any, where: str) -> PipelineSummary | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(data).__name__}")
    required = [f.name for f in dataclasses.fields(PipelineSummary)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanFileError(f"{where}: missing field(s) {missing}")
    known = {f.name for f in dataclasses.fields(PipelineSummary)}
    return PipelineSummary(**{**{k: v for k, v in data.items() if k in known},
                              "notes": tuple(data.get("notes", ()))})


def _choice_json(c: Choice) -> list[Any]:
    return [c.strategy, *(float(f"{x:.4g}") for x in (c.compute_s, c.comm_s, c.reshard_s))]


def _explanation_json(e: OpExplanation) -> dict[str, Any]:
    return {"primitive": e.primitive, "source": e.source, "shapes": e.shapes, "num_strategies": e.num_strategies,
            "chosen": _choice_json(e.chosen), "alternatives": [_choice_json(c) for c in e.alternatives]}


def _choice(data: Any, where: str) -> Choice:
    if not (isinstance(data, list) and len(data) == 4 and isinstance(data[0], str)
            and all(isinstance(x, (int, float)) for x in data[1:])):
        raise PlanFileError(f"{where}: a choice is [strategy, compute_s, comm_s, reshard_s], got {data!r}")
    return Choice(data[0], float(data[1]), float(data[2]), float(data[3]))


def _explanation(data: Any, where: str) -> OpExplanation:
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(data).__name__}")
    return OpExplanation(
        primitive=str(_field(data, "primitive", str, where)), source=str(data.get("source", "")),
        shapes=str(data.get("shapes", "")), chosen=_choice(_field(data, "chosen", list, where), f"{where}.chosen"),
        alternatives=tuple(_choice(c, f"{where}.alternatives") for c in data.get("alternatives", [])),
        num_strategies=int(data.get("num_strategies", 0)),
    )


def _shapes(data: Any, where: str, *, roles: bool) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, str]]:
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object of path -> {{shape, dtype}}, got {type(data).__name__}")
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    found_roles: dict[str, str] = {}
    for path, entry in data.items():
        here = f"{where}[{path}]"
        if not isinstance(entry, dict):
            raise PlanFileError(f"{here}: expected {{shape, dtype}}, got {entry!r}")
        shape = _field(entry, "shape", list, here)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise PlanFileError(f"{here}: shape must be a list of non-negative integers, got {shape!r}")
        shapes[path] = (tuple(shape), str(_field(entry, "dtype", str, here)))
        if roles:
            found_roles[path] = str(entry.get("role", ""))
    return shapes, found_roles


def write_json(data: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=False))


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


def plan_fields(data: Any, source: str = "plan") -> dict[str, Any]:
    """The keyword arguments of ``Plan`` read from a plan file's JSON (every field checked)."""
    try:
        return _plan_fields(data, source)
    except (KeyError, ValueError, TypeError) as err:
        if isinstance(err, PlanningError):
            raise
        raise PlanFileError(f"{source} is malformed: {type(err).__name__}: {err}") from None


def _plan_fields(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: not a plan (expected a JSON object)")
    if data.get("format") != FORMAT:
        raise PlanFileError(f"{source}: not an autoshard plan file (format {data.get('format')!r})")
    version = _field(data, "version", int, source)
    if version < 1:
        raise PlanFileError(f"{source}: plan file version {version} is not a version autoshard ever wrote")
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
    input_shapes, input_roles = _shapes(_field(sig, "inputs", dict, f"{source}: signature"),
                                        f"{source}: signature.inputs", roles=True)
    output_shapes, _ = _shapes(sig.get("outputs", {}), f"{source}: signature.outputs", roles=False)
    in_specs = {p: _spec(s, names, f"{source}: input_specs[{p}]")
                for p, s in _field(data, "input_specs", dict, source).items()}
    missing = sorted(set(input_shapes) - set(in_specs))
    if missing:
        raise PlanFileError(f"{source}: input_specs lacks {missing[:3]}")
    for path, spec in in_specs.items():
        if path in input_shapes and spec.rank != len(input_shapes[path][0]):
            raise PlanFileError(f"{source}: input_specs[{path}] has {spec.rank} dims, the argument has shape "
                                f"{list(input_shapes[path][0])}")
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
    ledger = Ledger(**_record(Ledger, {k: v for k, v in led.items() if k != "step_s"}, f"{source}: ledger"))
    solver = SolverInfo(**_record(SolverInfo, sol, f"{source}: solver"))
    return dict(
        mesh_shape=shape, axis_names=names, cluster=cluster, input_specs=in_specs, output_specs=out_specs,
        input_roles=input_roles, input_shapes=input_shapes, op_out_specs=op_out, op_in_reshards=op_in,
        ledger=ledger, solver=solver, planning_s=dict(data.get("planning_s", {})),
        memory_budget_bytes=float(_field(data, "memory_budget_bytes", (int, float), source)),
        num_ops=int(_field(sig, "num_ops", int, f"{source}: signature")), name=str(data.get("name", "plan")),
        stages=tuple(_stage(s, f"{source}: stages[{i}]") for i, s in enumerate(data.get("stages", ()))),
        pipeline=_pipeline(data.get("pipeline"), f"{source}: pipeline"), num_microbatches=int(data.get("num_microbatches", 1)),
        schedule=str(data.get("schedule", "spmd")), alternatives=dict(data.get("alternatives", {})),
        output_reshards=out_reshards, output_shapes=output_shapes, in_tree=str(sig.get("in_tree", "")),
        explanations={int(k): _explanation(v, f"{source}: explanations[{k}]")
                      for k, v in _dict(data, "explanations", source).items()},
        origin={str(k): str(v) for k, v in _dict(data, "origin", source).items()},
        baselines={str(k): dict(v) for k, v in _dict(data, "baselines", source).items()},
        checks={str(k): str(v) for k, v in _dict(data, "checks", source).items()},
        layer_times=_layer_times(data.get("layer_times", []), f"{source}: layer_times"),
    )


def _layer_times(data: Any, where: str) -> tuple[LayerTime, ...]:
    if not isinstance(data, list):
        raise PlanFileError(f"{where}: expected a list of {{name, flops_s, hbm_s, comm_s, reshard_s}}, "
                            f"got {type(data).__name__}")
    out = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise PlanFileError(f"{where}[{i}]: expected an object, got {entry!r}")
        out.append(LayerTime(**_record(LayerTime, entry, f"{where}[{i}]")))
    return tuple(out)


def _record(cls: type, data: Mapping[str, Any], where: str, *, partial: bool = False) -> dict[str, Any]:
    """The fields of dataclass ``cls`` from ``data``, each present and of a plausible type.

    ``partial``: only the number, string and mapping fields are type-checked (the caller converts the rest).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanFileError(f"{where}: missing field(s) {missing}")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise PlanFileError(f"{where}: unknown field(s) {unknown}; this autoshard knows {names}")
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        if partial and str(f.type) not in ("float", "int", "str") and "Mapping" not in str(f.type):
            continue
        value = data[f.name]
        expected = (dict,) if "Mapping" in str(f.type) else (str,) if f.type in ("str", str) else (int, float)
        if not isinstance(value, expected) or isinstance(value, bool):
            raise PlanFileError(f"{where}: field {f.name!r} should be {'/'.join(t.__name__ for t in expected)}, "
                                f"got {value!r}")
    return dict(data)


def _dict(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """An optional object field ({} when absent)."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise PlanFileError(f"{where}: field {key!r} should be an object, got {type(value).__name__}")
    return value


def read_json(path: str | Path) -> Any:
    """The JSON of a plan file; ``PlanFileError`` when it is missing or does not parse."""
    path = Path(path)
    if not path.exists():
        raise PlanFileError(f"plan file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PlanFileError(f"plan file {path} is not valid JSON (truncated or hand-edited?): {err}") from None
    return data


def read_header(path: str | Path) -> dict[str, str]:
    """The version fields of a plan file (format version, autoshard and jax versions, creation time)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: str(data[k]) for k in ("version", "autoshard_version", "jax_version", "created") if k in data}


def check_signature(plan: PlanLike, graph: OpGraph) -> None:
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
    if not problems and plan.in_tree and graph.in_tree is not None and str(graph.in_tree) != plan.in_tree:
        problems.append(f"the arguments' pytree structure changed (same leaves, other containers):\n    plan     "
                        f"{plan.in_tree[:300]}\n    function {str(graph.in_tree)[:300]}")
    if not problems and len(graph.ops) != plan.num_ops:
        problems.append(f"the traced step has {len(graph.ops)} operations, the plan was made for {plan.num_ops}: "
                        "the model code changed; plan again")
    if problems:
        more = [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        raise PlanMismatchError("the plan does not match this train step (plan again for the changed model):\n  "
                                + "\n  ".join(problems[:20] + more))


def check_mesh(plan: PlanLike, shape: Sequence[int], axis_names: Sequence[str]) -> None:
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
