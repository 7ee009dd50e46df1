"""Pipeline stages in plan files (``plans/planfile.py``): a ``PipelineStage`` as JSON and back, its specs checked
against the stage's mesh axes; fields older files lack (grad, state and per-equation specs, predicted
collectives, train-graph pins) load empty."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from autoshard.ir.spec import Spec
from autoshard.plans import json_fields as jf
from autoshard.plans.json_fields import PlanFileError
from autoshard.plans.stage_plan import PipelineStage, StageMemory
from autoshard.plans.annotations import Annotations, TrainPins


def stage_json(stage: Any, index: int) -> dict[str, Any]:
    """A pipeline stage as JSON: PipelineStage fields with specs as lists, or a plain mapping as is."""
    if isinstance(stage, PipelineStage):
        data: dict[str, Any] = {"kind": "pipeline-stage"}
        for f in dataclasses.fields(PipelineStage):
            value = getattr(stage, f.name)
            if f.name in ("param_specs", "batch_specs", "grad_specs", "state_specs"):
                value = {k: s.to_json() for k, s in value.items()}
            elif f.name == "op_out_specs":
                value = _out_specs_json(value)
            elif f.name == "op_in_reshards":
                value = _reshards_json(value)
            elif f.name == "train_pins":
                value = _train_pins_json(value)
            elif f.name == "edge_pins":
                value = {":".join(map(str, k)): {"forward": [s.to_json() for s in a],
                                                 "backward": [s.to_json() for s in b]}
                         for k, (a, b) in value.items()}
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
    if body.get("batch_axes") is not None:  # older files: none (the runtime reads the batch specs' axes)
        axes = tuple(jf.field(body, "batch_axes", list, where))
        unknown = [a for a in axes if a not in names]
        if unknown:
            raise PlanFileError(f"{where}.batch_axes: {unknown} are not axes of the stage's mesh {list(names)}")
        fields["batch_axes"] = axes
    return PipelineStage(**fields, num_params=int(body.get("num_params", 0)))


def _stage_op_specs(body: Mapping[str, Any], names: Sequence[str], where: str) -> dict[str, Any]:
    """A stage's per-equation specs and predicted collectives (fields older files lack: they load empty)."""
    out: dict[str, Any] = {}
    out["op_out_specs"] = _out_specs_from_json(jf.optional_dict(body, "op_out_specs", where), names,
                                               f"{where}.op_out_specs")
    out["op_in_reshards"] = _reshards_from_json(jf.optional_dict(body, "op_in_reshards", where), names,
                                                f"{where}.op_in_reshards")
    out["train_pins"] = _train_pins_from_json(jf.optional_dict(body, "train_pins", where), names,
                                              f"{where}.train_pins")
    edges = jf.optional_dict(body, "edge_pins", where)
    out["edge_pins"] = {}
    for key, pin in edges.items():
        parts = key.split(":")
        at = f"{where}.edge_pins[{key}]"
        if isinstance(pin, list) and len(pin) == 2:  # older files: one spec a side
            chains = tuple((jf.spec(x, names, at),) for x in pin)
        elif isinstance(pin, dict) and set(pin) == {"forward", "backward"}:
            chains = tuple(jf.specs(pin[side], names, f"{at}.{side}") for side in ("forward", "backward"))
        else:
            chains = ()
        if len(parts) != 3 or len(chains) != 2 or not all(chains):
            raise PlanFileError(f"{where}.edge_pins: expected 'equation:side:position': {{\"forward\": [spec, ...], "
                                f"\"backward\": [spec, ...]}} (each at least one spec), got {key!r}: {pin!r}")
        index = tuple(jf.index(x, None, at) for x in parts)
        out["edge_pins"][index] = chains
    collectives = jf.optional_dict(body, "collective_bytes", where)
    out["collective_bytes"] = {str(a): jf.numbers(jf.mapping(kinds, f"{where}.collective_bytes[{a}]"),
                                                  f"{where}.collective_bytes[{a}]")
                               for a, kinds in collectives.items()}
    return out


def _out_specs_json(specs: Mapping[int, Sequence[Spec | None]]) -> dict[str, Any]:
    return {str(k): [s.to_json() if s is not None else None for s in v] for k, v in specs.items()}


def _reshards_json(reshards: Mapping[int, Mapping[int, Sequence[Spec]]]) -> dict[str, Any]:
    return {str(k): {str(pos): [s.to_json() for s in chain] for pos, chain in v.items()} for k, v in reshards.items()}


def _out_specs_from_json(data: Mapping[str, Any], names: Sequence[str], where: str) -> dict[int, tuple[Spec | None, ...]]:
    return {jf.index(k, None, where): tuple(None if s is None else jf.spec(s, names, f"{where}[{k}]")
                                            for s in jf.field(data, k, list, where))
            for k in data}


def _reshards_from_json(data: Mapping[str, Any], names: Sequence[str], where: str
                        ) -> dict[int, dict[int, tuple[Spec, ...]]]:
    return {jf.index(k, None, where): {jf.index(pos, None, f"{where}[{k}]"): jf.specs(chain, names, f"{where}[{k}]")
                                       for pos, chain in jf.mapping(v, f"{where}[{k}]").items()}
            for k, v in data.items()}


def _train_pins_json(pins: Mapping[int, TrainPins]) -> dict[str, Any]:
    """``{"layers": {layer: class key}, "plans": {class key: its annotations}}``: each layer class's plan once."""
    plans: dict[str, Any] = {}
    for p in pins.values():
        ann = p.annotations
        plans.setdefault(p.key, {
            "num_ops": p.num_ops,
            "input_specs": [s.to_json() for s in ann.input_specs],
            "output_specs": [s.to_json() for s in ann.output_specs],
            "op_out_specs": _out_specs_json(ann.op_out_specs),
            "op_in_reshards": _reshards_json(ann.op_in_reshards),
            "output_reshards": {str(k): [s.to_json() for s in chain] for k, chain in ann.output_reshards.items()}})
    return {"layers": {str(layer): p.key for layer, p in pins.items()}, "plans": plans} if pins else {}


def _train_pins_from_json(data: Mapping[str, Any], names: Sequence[str], where: str) -> dict[int, TrainPins]:
    if not data:
        return {}
    layers = jf.mapping(jf.field(data, "layers", dict, where), f"{where}.layers")
    plans = jf.mapping(jf.field(data, "plans", dict, where), f"{where}.plans")
    loaded: dict[str, TrainPins] = {}
    for key, body in plans.items():
        at = f"{where}.plans[{key}]"
        body = jf.mapping(body, at)
        num_ops = jf.field(body, "num_ops", int, at)
        ann = Annotations(
            input_specs=jf.specs(jf.field(body, "input_specs", list, at), names, f"{at}.input_specs"),
            output_specs=jf.specs(jf.field(body, "output_specs", list, at), names, f"{at}.output_specs"),
            op_out_specs=_out_specs_from_json(jf.field(body, "op_out_specs", dict, at), names, f"{at}.op_out_specs"),
            op_in_reshards=_reshards_from_json(jf.field(body, "op_in_reshards", dict, at), names,
                                               f"{at}.op_in_reshards"),
            output_reshards={jf.index(k, None, f"{at}.output_reshards"): jf.specs(c, names, f"{at}.output_reshards[{k}]")
                             for k, c in jf.field(body, "output_reshards", dict, at).items()})
        loaded[key] = TrainPins(key, jf.count(num_ops, f"{at}.num_ops"), ann)
    out = {}
    for layer, key in layers.items():
        if key not in loaded:
            raise PlanFileError(f"{where}.layers[{layer}]: names the layer plan {key!r}, which {where}.plans lacks")
        out[jf.index(layer, None, f"{where}.layers")] = loaded[key]
    return out
