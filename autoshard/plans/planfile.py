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
    op_deferred: {op index: {reduced: [[dim, other dim or -1, [axes]], ...], chain: [op, ...], stack: op,
                  operands: [spec, ...]}}  partial sums reduced after their scan                     optional
    ledger: {compute_s, comm_s, reshard_s, bubble_s, step_s, peak_memory_bytes,
             memory_by_kind: {param, opt_state, batch, activation, resharded, ...}, collective_bytes: {kind: bytes},
             compute_lower_bound_s, ..., flops_by_dtype: {peak dtype: FLOPs per device},
             compiled_step_s, compiled_compute_s, compiled_collectives_s (0: not compiled; optional)}
    solver: {status, gap, solve_s, num_nodes, num_classes, num_variables, num_constraints, num_edges}
    planning_s: {pass: seconds}   memory_budget_bytes   num_microbatches   schedule
    stages: [{kind: "pipeline-stage", index, first_layer, last_layer, submesh, device_indices, mesh_shape,
              axis_names, param_specs: {path: spec}, batch_specs: {path: spec}, time_s, compute_s, sync_s,
              transfer_out_s, memory: {params_bytes, grads_bytes, opt_state_bytes, activations_bytes,
              in_flight}, num_params, grad_specs, state_specs: {input path: spec} (optional: older files
              rebuild it), op_out_specs: {forward equation: [spec or null, ...]}, op_in_reshards:
              {forward equation: {input position: [spec, ...]}}, collective_bytes: {action: {kind: bytes}}
              (optional)}, ...]   (other objects are kept as they are)
    pipeline: {num_microbatches, schedule, step_s, first_microbatch_latency_s, bottleneck_s,
               bubble_fraction, layers, cost_model, intra_stage, spmd_step_s, spmd_mesh, notes,
               layer_eqns: [[[first, last] equation index runs] per layer] (optional)} or null
    alternatives: {mesh shape: step s}
    explanations: {op index: {primitive, source, shapes, num_strategies,                              v2
                              chosen: [strategy, compute_s, comm_s, reshard_s], alternatives: [[...], ...]}}
    baselines: {strategy: {step_s, peak_memory_bytes, fits, batch_ceiling, speedup, compiled_step_s}}  v2
    checks: {check: result}            e.g. numerics against one device (a launch bundle records it)    optional
    layer_times: [{name, flops_s, hbm_s, comm_s, reshard_s}, ...]   the step split per layer          optional
    arbitration: {candidate: {modeled_s, compiled_s, fits, chosen}}  check="compiled": plans compiled   optional

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
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import numpy as np

from autoshard.errors import PlanMismatchError, PlanningError
from autoshard.ir.graph import OpGraph
from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import ClusterSpec, ClusterSpecError
from autoshard.plans.annotations import PARTIAL_OPS, PARTIAL_VIEWS, Deferral
from autoshard.plans.breakdown import LayerTime
from autoshard.plans import json_fields as jf
from autoshard.plans.json_fields import PlanFileError
from autoshard.plans.ledger import Choice, Ledger, OpExplanation, SolverInfo
from autoshard.plans.stage_file import stage_from_json, stage_json
from autoshard.plans.stage_plan import PipelinePlan
from autoshard.version import __version__

# Functions here read a Plan's fields (``plans/plan.py`` imports this module, so it takes the plan as
# a plain object: ``PlanLike``); ``plan_fields`` returns the keyword arguments of ``Plan``.
PlanLike = Any

FORMAT = "autoshard-plan"
VERSION = 2


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
        "op_deferred": {str(k): {"reduced": [[a, b, list(axes)] for a, b, axes in d.reduced], "chain": list(d.chain),
                                 "stack": d.stack, "operands": [o.to_json() for o in d.operands]} for k, d in plan.op_deferred.items()},
        "ledger": {**asdict(plan.ledger), "step_s": plan.ledger.step_s},
        "solver": asdict(plan.solver),
        "planning_s": dict(plan.planning_s),
        "memory_budget_bytes": plan.memory_budget_bytes,
        "stages": [stage_json(s, i) for i, s in enumerate(plan.stages)],
        "pipeline": _pipeline_json(plan.pipeline),
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "alternatives": dict(plan.alternatives),
        "explanations": {str(k): _explanation_json(e) for k, e in plan.explanations.items()},
        "baselines": {k: dict(v) for k, v in plan.baselines.items()},
        "checks": dict(plan.checks),
        "layer_times": [asdict(t) for t in plan.layer_times],
        "arbitration": {k: dict(v) for k, v in plan.arbitration.items()},
    }


def _pipeline_json(summary: Any) -> dict[str, Any] | None:
    if summary is None:
        return None
    data = asdict(summary)
    data["notes"] = list(data.get("notes", ()))
    data["layer_eqns"] = [_runs(eqns) for eqns in summary.layer_eqns]
    return data


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """Sorted indices as [first, last] runs: [3, 4, 5, 9] -> [[3, 5], [9, 9]]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = int(i)
        else:
            runs.append([int(i), int(i)])
    return runs


def _layer_eqns(data: Any, where: str) -> tuple[tuple[int, ...], ...]:
    runs_per_layer = jf.field({"layer_eqns": data}, "layer_eqns", list, where)
    layers = []
    for n, runs in enumerate(runs_per_layer):
        if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2
                                                 and all(isinstance(x, int) for x in r) for r in runs):
            raise PlanFileError(f"{where}.layer_eqns[{n}]: expected [[first, last], ...] equation index runs")
        layers.append(tuple(i for a, b in runs for i in range(a, b + 1)))
    return tuple(layers)


def _pipeline(data: Any, where: str) -> PipelinePlan | None:
    if data is None:
        return None
    data = jf.mapping(data, where)
    fields = dataclasses.fields(PipelinePlan)
    missing = [f.name for f in fields if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise PlanFileError(f"{where}: missing field(s) {missing}")
    for f in fields:
        if f.type in ("int", "float") or (f.type == "float | None" and data.get(f.name) is not None):
            jf.number(data.get(f.name, 0), f"{where}.{f.name}")
    known = {f.name for f in fields}
    return PipelinePlan(**{**{k: v for k, v in data.items() if k in known}, "notes": tuple(data.get("notes", ())),
                              "layer_eqns": _layer_eqns(data.get("layer_eqns", []), where)})


def _choice_json(c: Choice) -> list[Any]:
    return [c.strategy, *(float(f"{x:.4g}") for x in (c.compute_s, c.comm_s, c.reshard_s))]


def _explanation_json(e: OpExplanation) -> dict[str, Any]:
    return {"primitive": e.primitive, "source": e.source, "shapes": e.shapes, "num_strategies": e.num_strategies,
            "chosen": _choice_json(e.chosen), "alternatives": [_choice_json(c) for c in e.alternatives],
            **({"loop": e.loop} if e.loop else {})}


def _choice(data: Any, where: str) -> Choice:
    if not (isinstance(data, list) and len(data) == 4 and isinstance(data[0], str)
            and all(isinstance(x, (int, float)) for x in data[1:])):
        raise PlanFileError(f"{where}: a choice is [strategy, compute_s, comm_s, reshard_s], got {data!r}")
    return Choice(data[0], float(data[1]), float(data[2]), float(data[3]))


def _explanation(data: Any, where: str) -> OpExplanation:
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(data).__name__}")
    return OpExplanation(
        primitive=str(jf.field(data, "primitive", str, where)), source=str(data.get("source", "")),
        shapes=str(data.get("shapes", "")), chosen=_choice(jf.field(data, "chosen", list, where), f"{where}.chosen"),
        alternatives=tuple(_choice(c, f"{where}.alternatives") for c in data.get("alternatives", [])),
        num_strategies=int(data.get("num_strategies", 0)), loop=str(data.get("loop", "")),
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
        shape = jf.field(entry, "shape", list, here)
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape):
            raise PlanFileError(f"{here}: shape must be a list of non-negative integers, got {shape!r}")
        shapes[path] = (tuple(shape), str(jf.field(entry, "dtype", str, here)))
        if roles:
            found_roles[path] = str(entry.get("role", ""))
    return shapes, found_roles


def write_json(data: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=False))


def plan_fields(data: Any, source: str = "plan") -> dict[str, Any]:
    """The keyword arguments of ``Plan`` read from a plan file's JSON (every field checked)."""
    try:
        return _plan_fields(data, source)
    except (KeyError, ValueError, TypeError, OverflowError) as err:
        if isinstance(err, PlanningError):
            raise
        raise PlanFileError(f"{source} is malformed: {type(err).__name__}: {err}") from None


def _plan_fields(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: not a plan (expected a JSON object)")
    if data.get("format") != FORMAT:
        raise PlanFileError(f"{source}: not an autoshard plan file (format {data.get('format')!r})")
    version = jf.field(data, "version", int, source)
    if version < 1:
        raise PlanFileError(f"{source}: plan file version {version} is not a version autoshard ever wrote")
    if version > VERSION:
        raise PlanFileError(f"{source}: plan file version {version} is newer than this autoshard reads "
                            f"({VERSION}); upgrade autoshard")
    mesh = jf.field(data, "mesh", dict, source)
    shape = tuple(jf.field(mesh, "shape", list, f"{source}: mesh"))
    names = tuple(str(a) for a in jf.field(mesh, "axis_names", list, f"{source}: mesh"))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise PlanFileError(f"{source}: mesh shape must be a list of positive integers, got {list(shape)!r}")
    if len(shape) != len(names):
        raise PlanFileError(f"{source}: mesh shape {shape} and axis names {names} differ in length")
    try:
        cluster = ClusterSpec.from_dict(jf.field(data, "cluster", dict, source), source=f"{source}: cluster")
    except ClusterSpecError as err:
        raise PlanFileError(str(err)) from None
    if math.prod(shape) > cluster.num_devices:
        raise PlanFileError(f"{source}: mesh {list(shape)} needs {math.prod(shape):.4g} devices, more than the "
                            f"{cluster.num_devices} of the cluster it was planned for ({cluster.name})")
    sig = jf.field(data, "signature", dict, source)
    input_shapes, input_roles = _shapes(jf.field(sig, "inputs", dict, f"{source}: signature"),
                                        f"{source}: signature.inputs", roles=True)
    output_shapes, _ = _shapes(sig.get("outputs", {}), f"{source}: signature.outputs", roles=False)
    in_specs = {p: jf.spec(s, names, f"{source}: input_specs[{p}]")
                for p, s in jf.field(data, "input_specs", dict, source).items()}
    missing = sorted(set(input_shapes) - set(in_specs))
    if missing:
        raise PlanFileError(f"{source}: input_specs lacks {missing[:3]}")
    for path, spec in in_specs.items():
        if path in input_shapes and spec.rank != len(input_shapes[path][0]):
            raise PlanFileError(f"{source}: input_specs[{path}] has {spec.rank} dims, the argument has shape "
                                f"{list(input_shapes[path][0])}")
    out_specs = {p: jf.spec(s, names, f"{source}: output_specs[{p}]")
                 for p, s in jf.field(data, "output_specs", dict, source).items()}
    num_ops = jf.count(jf.field(sig, "num_ops", int, f"{source}: signature"), f"{source}: signature.num_ops")
    num_outputs = len(output_shapes) if output_shapes else None  # version 1 files do not record outputs
    op_out = {jf.index(k, num_ops, f"{source}: op_out_specs"): jf.specs(v, names, f"{source}: op_out_specs[{k}]")
              for k, v in jf.field(data, "op_out_specs", dict, source).items()}
    op_in = {jf.index(k, num_ops, f"{source}: op_in_reshards"):
             {jf.index(pos, None, f"{source}: op_in_reshards[{k}]"):
              jf.specs(chain, names, f"{source}: op_in_reshards[{k}]")
              for pos, chain in jf.mapping(v, f"{source}: op_in_reshards[{k}]").items()}
             for k, v in jf.field(data, "op_in_reshards", dict, source).items()}
    out_reshards = {jf.index(k, num_outputs, f"{source}: output_reshards"):
                    jf.specs(chain, names, f"{source}: output_reshards[{k}]")
                    for k, chain in jf.optional_dict(data, "output_reshards", source).items()}
    deferred = {jf.index(k, num_ops, f"{source}: op_deferred"): _deferral(v, names, num_ops, f"{source}: op_deferred[{k}]")
                for k, v in jf.optional_dict(data, "op_deferred", source).items()}
    led = jf.field(data, "ledger", dict, source)
    sol = jf.field(data, "solver", dict, source)
    ledger = Ledger(**jf.record(Ledger, {k: v for k, v in led.items() if k != "step_s"}, f"{source}: ledger"))
    for key in ("memory_by_kind", "collective_bytes", "flops_by_dtype"):
        jf.numbers(getattr(ledger, key), f"{source}: ledger.{key}")
    solver = SolverInfo(**jf.record(SolverInfo, sol, f"{source}: solver"))
    return dict(
        mesh_shape=shape, axis_names=names, cluster=cluster, input_specs=in_specs, output_specs=out_specs,
        input_roles=input_roles, input_shapes=input_shapes, op_out_specs=op_out, op_in_reshards=op_in,
        ledger=ledger, solver=solver,
        planning_s=jf.numbers(jf.optional_dict(data, "planning_s", source), f"{source}: planning_s"),
        memory_budget_bytes=jf.number(jf.field(data, "memory_budget_bytes", (int, float), source),
                                    f"{source}: memory_budget_bytes", positive=True),
        num_ops=num_ops, name=str(data.get("name", "plan")),
        stages=tuple(stage_from_json(s, f"{source}: stages[{i}]") for i, s in enumerate(data.get("stages", ()))),
        pipeline=_pipeline(data.get("pipeline"), f"{source}: pipeline"), num_microbatches=int(data.get("num_microbatches", 1)),
        schedule=str(data.get("schedule", "spmd")),
        alternatives=jf.numbers(jf.optional_dict(data, "alternatives", source), f"{source}: alternatives"),
        output_reshards=out_reshards, op_deferred=deferred, output_shapes=output_shapes, in_tree=str(sig.get("in_tree", "")),
        explanations={jf.index(k, num_ops, f"{source}: explanations"): _explanation(v, f"{source}: explanations[{k}]")
                      for k, v in jf.optional_dict(data, "explanations", source).items()},
        origin={str(k): str(v) for k, v in jf.optional_dict(data, "origin", source).items()},
        baselines={str(k): _baseline(v, f"{source}: baselines[{k}]")
                   for k, v in jf.optional_dict(data, "baselines", source).items()},
        checks={str(k): str(v) for k, v in jf.optional_dict(data, "checks", source).items()},
        layer_times=_layer_times(data.get("layer_times", []), f"{source}: layer_times"),
        arbitration={str(k): jf.numbers(jf.mapping(v, f"{source}: arbitration[{k}]"), f"{source}: arbitration[{k}]")
                     for k, v in jf.optional_dict(data, "arbitration", source).items()},
    )


def _layer_times(data: Any, where: str) -> tuple[LayerTime, ...]:
    if not isinstance(data, list):
        raise PlanFileError(f"{where}: expected a list of {{name, flops_s, hbm_s, comm_s, reshard_s}}, "
                            f"got {type(data).__name__}")
    out = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise PlanFileError(f"{where}[{i}]: expected an object, got {entry!r}")
        out.append(LayerTime(**jf.record(LayerTime, entry, f"{where}[{i}]")))
    return tuple(out)


def _baseline(data: Any, where: str) -> dict[str, Any]:
    """A compared strategy's figures: step_s (and peak_memory_bytes) numbers, fits a bool, batch_ceiling."""
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(data).__name__}")
    jf.number(jf.field(data, "step_s", (int, float), where), f"{where}.step_s")
    for key in ("peak_memory_bytes", "compiled_step_s"):
        if key in data:
            jf.number(data[key], f"{where}.{key}")
    if not isinstance(data.get("fits", True), bool):
        raise PlanFileError(f"{where}.fits should be true or false, got {data['fits']!r}")
    ceiling = data.get("batch_ceiling")
    if ceiling is not None and (isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 0):
        raise PlanFileError(f"{where}.batch_ceiling should be a non-negative integer or null, got {ceiling!r}")
    return dict(data)


def read_json(path: str | Path) -> Any:
    """The JSON of a plan file; ``PlanFileError`` when it is missing or does not parse."""
    path = Path(path)
    if not path.exists():
        raise PlanFileError(f"plan file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanFileError(f"plan file {path} is not valid JSON (truncated or hand-edited?): {err}") from None
    except OSError as err:
        raise PlanFileError(f"plan file {path} cannot be read: {err.strerror or err}") from None
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
    if not problems:
        problems += _layout_problems(plan, graph)
    if problems:
        more = [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        raise PlanMismatchError("the plan does not match this train step (plan again for the changed model):\n  "
                                + "\n  ".join(problems[:20] + more))


def check_args(plan: PlanLike, args: Sequence[Any]) -> None:
    """Raise PlanMismatchError naming each argument leaf whose shape or dtype differs from the plan's.

    What ``check_signature`` checks of a trace, checked on the arguments of a call (no tracing: cheap
    enough for every call of an applied plan).
    """
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    got = {jax.tree_util.keystr(path): (tuple(np.shape(x)), _dtype(x)) for path, x in leaves}
    problems = [f"argument {p}: plan has {dtype}{list(shape)}, the call passes {got[p][1]}{list(got[p][0])}"
                for p, (shape, dtype) in plan.input_shapes.items() if p in got and got[p] != (tuple(shape), dtype)]
    problems += [f"argument {p} is missing from the call" for p in plan.input_shapes if p not in got]
    problems += [f"argument {p} is new: the plan has no spec for it" for p in got if p not in plan.input_shapes]
    if problems:
        more = [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        raise PlanMismatchError("the call's arguments do not match the plan (it was made for other shapes; plan "
                                "again for these, or call with the planned ones):\n  " + "\n  ".join(problems[:20] + more))


def _dtype(x: Any) -> str:
    """The dtype name a trace gives ``x`` (canonical: float64 is float32 unless x64 is on)."""
    dtype = jax.numpy.result_type(x)
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes such as PRNG keys
        return str(dtype)


def _deferral(data: Any, names: Sequence[str], num_ops: int, where: str) -> Deferral:
    """One ``op_deferred`` entry: {reduced: [[dim, other dim or -1, [axes]], ...], chain: [op, ...], stack: op,
    operands: [spec, ...]}."""
    body = jf.mapping(data, where)
    reduced = []
    for entry in jf.field(body, "reduced", list, where):
        if (not isinstance(entry, list) or len(entry) != 3 or not all(isinstance(x, int) for x in entry[:2])
                or not isinstance(entry[2], list) or not entry[2] or not set(entry[2]) <= set(names)):
            raise PlanFileError(f"{where}.reduced: each entry is [dim, other dim or -1, [mesh axes of "
                                f"{list(names)}]], got {entry!r}")
        reduced.append((entry[0], entry[1], tuple(entry[2])))
    chain = tuple(jf.index(str(t), num_ops, f"{where}.chain") for t in jf.field(body, "chain", list, where))
    stack = jf.index(str(jf.field(body, "stack", int, where)), num_ops, f"{where}.stack")
    return Deferral(tuple(reduced), chain, stack, jf.specs(jf.field(body, "operands", list, where), names,
                                                           f"{where}.operands"))


def _layout_problems(plan: PlanLike, graph: OpGraph) -> list[str]:
    """Per-op layouts of the plan that do not fit the traced ops (a hand-edited file): count and rank."""
    problems = []

    def check(where: str, specs: Sequence[Spec], vids: Sequence[int]) -> None:
        ranks = [graph.values[v].rank for v in vids]
        if [s.rank for s in specs] != ranks:
            problems.append(f"{where}: specs {', '.join(map(str, specs)) or 'none'} do not fit the ranks {ranks}")

    for k, specs in plan.op_out_specs.items():
        check(f"op {k} ({graph.ops[k].primitive}) outputs", specs, graph.ops[k].outputs)
    for k, moves in plan.op_in_reshards.items():
        op = graph.ops[k]
        for pos, chain in moves.items():
            if pos >= len(op.inputs):
                problems.append(f"op {k} ({op.primitive}) has {len(op.inputs)} operands; the plan reshards operand {pos}")
            else:
                check(f"op {k} ({op.primitive}) operand {pos}", chain, [op.inputs[pos]] * len(chain))
    for k, d in plan.op_deferred.items():
        ops = [graph.ops[t].primitive for t in (k, *d.chain, d.stack)]
        if (ops[0] not in PARTIAL_OPS or ops[-1] != "loop_stack"
                or any(p not in PARTIAL_VIEWS for p in ops[1:-1])):
            problems.append(f"op {k}: the plan reduces its partial sums after its loop through ops {ops}, "
                            "which are not a reduction, views and a loop's stacked output")
    for k, chain in plan.output_reshards.items():
        if k >= len(graph.outputs):
            problems.append(f"the step has {len(graph.outputs)} outputs; the plan reshards output {k}")
        else:
            check(f"output {k}", chain, [graph.outputs[k]] * len(chain))
    return problems


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
