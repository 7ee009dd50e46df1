"""The classic strategies' storage layouts: DP, FSDP/ZeRO-3, ZeRO-2, HSDP, Megatron TP and DP x TP.

``baseline_pins`` gives the storage spec of every input leaf under one classic
strategy (the table in ``compiler/baselines.py`` says what each fixes);
``classic_layouts`` gives them all, the starting points from which the
intra-op search begins in each strategy's basin. Megatron's column/row kernels
come from ``passes/megatron.py``.
"""
from __future__ import annotations

import enum
import logging
import math
import re
from collections.abc import Mapping, Sequence

from autoshard.ir.graph import OpGraph, Role
from autoshard.ir.spec import MeshAxes, Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.megatron import MegatronRoles, megatron_roles

log = logging.getLogger(__name__)


class Baseline(str, enum.Enum):
    DP = "dp"
    FSDP = "fsdp"
    ZERO2 = "zero2"
    HSDP = "hsdp"
    TP = "megatron-tp"
    DP_TP = "dp-tp"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {Baseline.DP: "DP", Baseline.FSDP: "FSDP/ZeRO-3", Baseline.ZERO2: "ZeRO-2", Baseline.HSDP: "HSDP",
           Baseline.TP: "Megatron TP", Baseline.DP_TP: "DP x TP"}
ALL_BASELINES: tuple[Baseline, ...] = tuple(Baseline)


# ----------------------------------------------------------------------------- layouts


def divisible_axes(size: int, axes: Sequence[str], sizes: Mapping[str, int]) -> MeshAxes:
    """The most devices from ``axes`` (kept in mesh order) whose product divides ``size``; () if none."""
    axes = [a for a in axes if sizes[a] > 1]
    best: MeshAxes = ()
    best_n = 1
    for mask in range(1, 1 << len(axes)):
        chosen = tuple(a for i, a in enumerate(axes) if mask >> i & 1)
        n = math.prod(sizes[a] for a in chosen)
        # ties: prefer the inner axes (later in the mesh), which are the faster links
        if size % n == 0 and (n > best_n or (n == best_n and chosen > best)):
            best, best_n = chosen, n
    return best


def largest_dim_spec(shape: Sequence[int], axes: Sequence[str], sizes: Mapping[str, int]) -> Spec:
    """Split the largest dimension that ``axes`` divide (FSDP's flat-shard analogue); replicated if none."""
    dims: list[MeshAxes] = [()] * len(shape)
    total = math.prod(sizes[a] for a in axes if sizes[a] > 1)
    order = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    for d in order:  # all the axes on one dimension, the largest that takes them
        if total > 1 and shape[d] % total == 0:
            dims[d] = tuple(a for a in axes if sizes[a] > 1)
            return Spec(tuple(dims))
    for d in order:  # else as many devices as divide the largest dimension that takes any
        chosen = divisible_axes(shape[d], axes, sizes)
        if chosen:
            dims[d] = chosen
            return Spec(tuple(dims))
    return Spec(tuple(dims))


def batch_spec(shape: Sequence[int], axes: Sequence[str], sizes: Mapping[str, int]) -> Spec:
    """Split dim 0 (the batch) over as many of ``axes`` as divide it."""
    if not shape:
        return Spec(())
    return Spec((divisible_axes(shape[0], axes, sizes),) + ((),) * (len(shape) - 1))


def node_axes(mesh: LogicalMesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(intra-node axes, axes that cross nodes); on one node the last axis plays the node."""
    crossing = tuple(a.name for a in mesh.axes if a.size > 1 and a.crosses_nodes)
    inside = tuple(a.name for a in mesh.axes if a.size > 1 and a.name not in crossing)
    if not crossing:
        return mesh.axis_names[-1:], mesh.axis_names[:-1]
    return inside, crossing


# ----------------------------------------------------------------------------- pins


def mirror_params(graph: OpGraph, param_specs: Mapping[int, Spec]) -> dict[int, Spec]:
    """Optimizer-state leaves that mirror a parameter (same shape, path ending in its path) get its spec.

    Where several parameters' paths end a leaf's path, the first parameter given wins. Each leaf looks up
    the suffixes of its own path, so the cost is linear in the number of leaves (times a path's length).
    """
    by_suffix: dict[tuple[str, tuple[int, ...]], tuple[int, Spec]] = {}  # -> (first given, last spec)
    for i, spec in param_specs.items():
        value = graph.values[graph.inputs[i]]
        key = (re.sub(r"^\[\d+\]", "", value.path or ""), value.shape)
        by_suffix[key] = (by_suffix[key][0] if key in by_suffix else len(by_suffix), spec)
    out: dict[int, Spec] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        if value.role != Role.OPT_STATE:
            continue
        path = value.path or ""
        found = [by_suffix[(path[k:], value.shape)] for k in range(len(path))
                 if (path[k:], value.shape) in by_suffix]
        if found:
            out[i] = min(found, key=lambda f: f[0])[1]
    return out


def baseline_pins(graph: OpGraph, mesh: LogicalMesh, kind: Baseline,
                  roles: MegatronRoles | None = None) -> dict[int, Spec]:
    """The storage spec of every flat input under a classic strategy (see the module docstring)."""
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    all_axes = tuple(a for a in mesh.axis_names if sizes[a] > 1)
    inside, _crossing = node_axes(mesh)
    data_axes: tuple[str, ...] = all_axes
    if kind == Baseline.TP:
        data_axes = ()
    elif kind == Baseline.DP_TP:
        data_axes = all_axes[:1] if len(all_axes) > 1 else ()
    model_axes = all_axes if kind == Baseline.TP else all_axes[-1:]
    pins: dict[int, Spec] = {}
    state: dict[int, Spec] = {}
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        replicated = Spec.replicated(value.rank)
        if value.role == Role.BATCH:
            pins[i] = batch_spec(value.shape, data_axes, sizes)
        elif value.role == Role.PARAM:
            if kind == Baseline.FSDP:
                pins[i] = largest_dim_spec(value.shape, all_axes, sizes)
            elif kind == Baseline.HSDP:
                pins[i] = largest_dim_spec(value.shape, inside, sizes)
            else:
                pins[i] = replicated
        elif value.role == Role.OPT_STATE:
            if kind in (Baseline.FSDP, Baseline.ZERO2):
                pins[i] = largest_dim_spec(value.shape, all_axes, sizes)
            elif kind == Baseline.HSDP:
                pins[i] = largest_dim_spec(value.shape, inside, sizes)
            else:
                pins[i] = replicated
        else:
            pins[i] = replicated
    if kind in (Baseline.TP, Baseline.DP_TP):
        roles = roles or megatron_roles(graph)
        for i, dim in {**roles.column, **roles.row, **roles.bias}.items():
            shape = graph.values[graph.inputs[i]].shape
            axes = divisible_axes(shape[dim], model_axes, sizes)
            dims = [()] * len(shape)
            dims[dim] = axes
            state[i] = Spec(tuple(dims))
        pins.update(state)
        pins.update(mirror_params(graph, state))
    return pins


def classic_layouts(graph: OpGraph, mesh: LogicalMesh) -> list[dict[int, Spec]]:
    """Every classic strategy's storage layouts: starting points for autoshard's own search
    (``IntraOpOptions.start_layouts``), so it begins in each strategy's basin."""
    layouts = []
    for kind in ALL_BASELINES:
        try:
            layouts.append(baseline_pins(graph, mesh, kind))
        except Exception as err:  # noqa: BLE001 — a start is optional; the search goes on without it
            log.debug("no %s start layout: %s", kind.label, err)
    return layouts
