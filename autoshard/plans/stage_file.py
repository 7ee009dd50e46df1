"""Pipeline stages in plan files (``plans/planfile.py``): a ``PipelineStage`` as JSON and back, its specs checked
against the stage's mesh axes; fields older files lack (grad, state and per-equation specs, predicted
collectives) load empty."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from autoshard.plans import json_fields as jf
from autoshard.plans.json_fields import PlanFileError
from autoshard.plans.stage_plan import PipelineStage, StageMemory


def stage_json(stage: Any, index: int) -> dict[str, Any]:
    """A pipeline stage as JSON: PipelineStage fields with specs as lists, or a plain mapping as is."""
    if isinstance(stage, PipelineStage):
        data: dict[str, Any] = {"kind": "pipeline-stage"}
        for f in dataclasses.fields(PipelineStage):
            value = getattr(stage, f.name)
            if f.name in ("param_specs", "batch_specs", "grad_specs", "state_specs"):
                value = {k: s.to_json() for k, s in value.items()}
            elif f.name == "op_out_specs":
                value = {str(k): [s.to_json() if s is not None else None for s in v] for k, v in value.items()}
            elif f.name == "op_in_reshards":
                value = {str(k): {str(pos): [s.to_json() for s in chain] for pos, chain in v.items()}
                         for k, v in value.items()}
            elif f.name == "edge_pins":
                value = {":".join(map(str, k)): [a.to_json(), b.to_json()] for k, (a, b) in value.items()}
            elif f.name == "collective_bytes":
                value = {a: dict(kinds) for a, kinds in value.items()}
            elif isinstance(value, StageMemory):
                value = asdict(value)
            elif isinstance(value, tuple):
                value = list(value)
            data[f.name] = value
        return data
    if isinstance(stage, Mapping):
        return dict(stage)
    raise PlanFileError(f"stage {index} is a {type(stage).__name__}, which a plan file cannot hold")


def stage_from_json(data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(data).__name__}")
    if data.get("kind") != "pipeline-stage":
        return dict(data)
    body = {k: v for k, v in data.items() if k != "kind"}
    fields = jf.record(PipelineStage, {k: v for k, v in body.items() if k != "num_params"}, where, partial=True)
    names = tuple(jf.field(body, "axis_names", list, where))
    for key in ("param_specs", "batch_specs"):
        fields[key] = {p: jf.spec(s, names, f"{where}.{key}[{p}]") for p, s in jf.field(body, key, dict, where).items()}
    if "grad_specs" in body:  # older files: gradients accumulate in the parameter's layout
        fields["grad_specs"] = {p: jf.spec(s, names, f"{where}.grad_specs[{p}]")
                                for p, s in jf.field(body, "grad_specs", dict, where).items()}
    if "state_specs" in body:  # older files: none (the optimizer state follows its parameter's gradient)
        fields["state_specs"] = {p: jf.spec(s, names, f"{where}.state_specs[{p}]")
                                 for p, s in jf.field(body, "state_specs", dict, where).items()}
    fields.update(_stage_op_specs(body, names, where))
    fields["memory"] = StageMemory(**jf.record(StageMemory, jf.field(body, "memory", dict, where), f"{where}.memory"))
    for key in ("submesh", "device_indices", "mesh_shape", "axis_names"):
        fields[key] = tuple(fields[key])
    return PipelineStage(**fields, num_params=int(body.get("num_params", 0)))


def _stage_op_specs(body: Mapping[str, Any], names: Sequence[str], where: str) -> dict[str, Any]:
    """A stage's per-equation specs and predicted collectives (fields older files lack: they load empty)."""
    out: dict[str, Any] = {}
    op_out = jf.optional_dict(body, "op_out_specs", where)
    out["op_out_specs"] = {
        jf.index(k, None, f"{where}.op_out_specs"): tuple(
            None if s is None else jf.spec(s, names, f"{where}.op_out_specs[{k}]")
            for s in jf.field(op_out, k, list, f"{where}.op_out_specs"))
        for k in op_out}
    op_in = jf.optional_dict(body, "op_in_reshards", where)
    out["op_in_reshards"] = {
        jf.index(k, None, f"{where}.op_in_reshards"): {
            jf.index(pos, None, f"{where}.op_in_reshards[{k}]"): jf.specs(chain, names, f"{where}.op_in_reshards[{k}]")
            for pos, chain in jf.mapping(v, f"{where}.op_in_reshards[{k}]").items()}
        for k, v in op_in.items()}
    edges = jf.optional_dict(body, "edge_pins", where)
    out["edge_pins"] = {}
    for key, pair in edges.items():
        parts = key.split(":")
        if len(parts) != 3 or not isinstance(pair, list) or len(pair) != 2:
            raise PlanFileError(f"{where}.edge_pins: expected 'equation:side:position': [forward spec, cotangent "
                                f"spec], got {key!r}: {pair!r}")
        index = tuple(jf.index(x, None, f"{where}.edge_pins[{key}]") for x in parts)
        out["edge_pins"][index] = tuple(jf.spec(x, names, f"{where}.edge_pins[{key}]") for x in pair)
    collectives = jf.optional_dict(body, "collective_bytes", where)
    out["collective_bytes"] = {str(a): jf.numbers(jf.mapping(kinds, f"{where}.collective_bytes[{a}]"),
                                                  f"{where}.collective_bytes[{a}]")
                               for a, kinds in collectives.items()}
    return out
