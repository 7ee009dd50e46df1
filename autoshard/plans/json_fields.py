"""Checked readers of plan-file JSON: each returns the value or raises ``PlanFileError`` naming the field.

``plans/planfile.py`` reads a plan file with these: a field of the right type (``field``), a spec over
the plan's mesh axes (``spec``), a dataclass record (``record``), a finite non-negative number
(``number``), an op or output index in range (``index``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from autoshard.errors import PlanningError
from autoshard.ir.spec import Spec


class PlanFileError(PlanningError):
    """A plan file is unreadable or malformed; the message names the field."""


def field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise PlanFileError(f"{where}: missing field {key!r}")
    value = data[key]
    if not isinstance(value, kind):
        names = "/".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise PlanFileError(f"{where}: field {key!r} should be {names}, got {type(value).__name__}")
    return value


def spec(data: Any, axis_names: Sequence[str], where: str) -> Spec:
    if not isinstance(data, list) or not all(isinstance(d, list) and all(isinstance(a, str) for a in d)
                                             for d in data):
        raise PlanFileError(f"{where}: a spec is a list of lists of mesh axis names, got {data!r}")
    parsed = Spec.from_json(data)
    unknown = [a for a in parsed.used_axes if a not in axis_names]
    if unknown:
        raise PlanFileError(f"{where}: spec {parsed} uses mesh axes {unknown} not in the plan's mesh {list(axis_names)}")
    if len(set(parsed.used_axes)) != len(parsed.used_axes):
        raise PlanFileError(f"{where}: spec {parsed} uses a mesh axis twice")
    return parsed


def record(cls: type, data: Mapping[str, Any], where: str, *, partial: bool = False) -> dict[str, Any]:
    """The fields of dataclass ``cls`` from ``data``, each present and of a plausible type.

    ``partial``: only the number, string and mapping fields are type-checked (the caller converts the rest).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]  # fields with defaults may be absent (older files)
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
        if expected == (int, float):
            number(value, f"{where}: field {f.name!r}", infinite=f.name == "gap")  # gap: inf when no bound
    return dict(data)


def number(value: Any, where: str, *, positive: bool = False, infinite: bool = False) -> float:
    """A non-negative (``positive``: > 0) number, finite unless ``infinite``; PlanFileError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanFileError(f"{where} should be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise PlanFileError(f"{where} is too large for a number of bytes or seconds ({str(value)[:12]}...)") \
            from None
    if math.isnan(number) or number < 0 or (positive and number == 0) or (math.isinf(number) and not infinite):
        raise PlanFileError(f"{where} should be a {'positive' if positive else 'non-negative'} finite number, "
                            f"got {value!r}")
    return number


def numbers(data: Mapping[str, Any], where: str) -> dict[str, float]:
    return {str(k): number(v, f"{where}[{k}]") for k, v in data.items()}


def count(value: int, where: str) -> int:
    if value < 0:
        raise PlanFileError(f"{where} should be a non-negative integer, got {value}")
    return value


def index(key: str, bound: int | None, where: str) -> int:
    """A JSON object key that indexes ops, outputs or operands: an integer in 0..bound-1 (None: any >= 0)."""
    try:
        index = int(key)
    except ValueError:
        raise PlanFileError(f"{where}: key {key!r} should be an integer index") from None
    if index < 0 or (bound is not None and index >= bound):
        valid = ">= 0" if bound is None else f"0..{bound - 1}" if bound else "none"
        raise PlanFileError(f"{where}: index {key} is out of range (valid: {valid})")
    return index


def specs(data: Any, axis_names: Sequence[str], where: str) -> tuple[Spec, ...]:
    if not isinstance(data, list):
        raise PlanFileError(f"{where}: expected a list of specs, got {type(data).__name__}")
    return tuple(spec(s, axis_names, where) for s in data)


def optional_dict(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """An optional object field ({} when absent)."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise PlanFileError(f"{where}: field {key!r} should be an object, got {type(value).__name__}")
    return value


def mapping(value: Any, where: str) -> dict[str, Any]:
    """``value``, which must be a JSON object."""
    if not isinstance(value, dict):
        raise PlanFileError(f"{where}: expected an object, got {type(value).__name__}")
    return value
