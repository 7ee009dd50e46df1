"""Pictures of a plan: the comparison, the time per layer, tensor layouts, memory per device, the pipeline Gantt.

- ``comparison_figure``: modeled step and per-device memory of autoshard and
  each classic strategy it was compared with, the budget line, batch ceilings;
- ``layer_time_figure``: each layer's share of the modeled step, stacked:
  FLOP-bound compute, HBM-bound compute, collectives, resharding;
- ``layout_figure``: the largest tensors as grids of shards, each dimension cut
  along the mesh axes that split it, a block labelled by the devices holding it;
- ``memory_figure``: one memory bar per device split by kind;
- ``gantt_figure``, when the plan has pipeline stages: the schedule.

``write_png`` puts the memory bars (and the Gantt) in one file;
``html_report.py`` puts them all in a self-contained page.

Stages are ``plans/stage_plan.PipelineStage`` (per-microbatch time,
split 1:2 into forward and backward; memory by kind; devices) or plain
mappings with ``name``, ``forward_s`` and ``backward_s`` (or ``time_s``),
``peak_memory_bytes``, ``memory_by_kind`` and ``num_devices``.
"""
from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autoshard.plans.breakdown import dotted, inner_path
from autoshard.plans.ledger import fmt_bytes, fmt_s
from autoshard.plans.plan import Plan
from autoshard.plans.schedules import chunks_of, dependencies, worker_orders
from autoshard.report import KIND_COLORS

TIME_COLORS = {"FLOP-bound compute": "#4c72b0", "HBM-bound compute": "#64b5cd", "collectives": "#dd8452",
               "resharding": "#c44e52"}


@dataclass(frozen=True)
class Slot:
    stage: int
    microbatch: int
    kind: Literal["F", "B"]
    start_s: float
    end_s: float


def pipeline_schedule(forward_s: Sequence[float], backward_s: Sequence[float], num_microbatches: int,
                      schedule: str = "1f1b", chunks: int = 1) -> list[Slot]:
    """Start and end of every forward and backward of every microbatch on every stage.

    Each worker (a stage; interleaved, a device group running ``chunks`` stages) runs its work in the
    schedule's order (``plans/schedules.worker_orders``), starting each piece when the worker is free and
    its inputs are done (the previous stage's forward, the next stage's backward).
    """
    stages = len(forward_s)
    order = worker_orders(schedule, stages, num_microbatches, chunks)  # type: ignore[arg-type]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(order)
    position = [0] * len(order)
    slots: list[Slot] = []
    while any(position[w] < len(order[w]) for w in range(len(order))):
        progressed = False
        for w, work in enumerate(order):
            if position[w] >= len(work):
                continue
            kind, s, m = act = work[position[w]]
            need = dependencies(act, stages)
            if any(n not in done for n in need):
                continue
            start = max([free[w]] + [done[n] for n in need])
            end = start + (forward_s[s] if kind == "F" else backward_s[s])
            done[act] = end
            free[w] = end
            position[w] += 1
            slots.append(Slot(s, m, kind, start, end))  # type: ignore[arg-type]
            progressed = True
        if not progressed:
            raise ValueError("pipeline schedule deadlocked (inconsistent stage order)")
    return slots


def stage_view(stage: Any, index: int) -> dict[str, Any]:
    """A stage as a mapping: a ``PipelineStage`` (plans/stage_plan.py) or a plain mapping from a plan file."""
    if isinstance(stage, Mapping):
        return dict(stage)
    memory = getattr(stage, "memory", None)
    kinds = {"param": memory.params_bytes, "grad": memory.grads_bytes, "opt_state": memory.opt_state_bytes,
             "activation": memory.activations_bytes} if memory is not None else {}
    return {"name": f"s{getattr(stage, 'index', index)} L{getattr(stage, 'first_layer', '?')}-"
                    f"{getattr(stage, 'last_layer', '?')}",
            "time_s": getattr(stage, "time_s", 0.0), "memory_by_kind": kinds,
            "num_devices": len(getattr(stage, "device_indices", ())) or 1,
            "device_indices": tuple(getattr(stage, "device_indices", ()))}


def stage_times(plan: Plan) -> tuple[list[float], list[float]]:
    fwd, bwd = [], []
    for i, stage in enumerate(plan.stages):
        data = stage_view(stage, i)
        if "forward_s" in data and "backward_s" in data:
            fwd.append(float(data["forward_s"]))
            bwd.append(float(data["backward_s"]))
        else:
            total = float(data.get("time_s", data.get("stage_time_s", 0.0)))
            fwd.append(total / 3)
            bwd.append(2 * total / 3)
    return fwd, bwd


def _memory_bars(plan: Plan) -> list[tuple[str, Mapping[str, float]]]:
    """One bar per device: SPMD devices all hold the ledger's split; a stage's devices hold the stage's."""
    bars: list[tuple[str, Mapping[str, float]]] = []
    if plan.stages:
        device = 0
        for i, stage in enumerate(plan.stages):
            data = stage_view(stage, i)
            kinds = data.get("memory_by_kind") or {"total": float(data.get("peak_memory_bytes", 0.0))}
            for _ in range(int(data.get("num_devices", 1))):
                bars.append((f"dev{device}\n{data.get('name', f'stage {i}')}", kinds))
                device += 1
        return bars
    count = math.prod(plan.mesh_shape)
    return [(f"dev{d}", plan.ledger.memory_by_kind) for d in range(count)]


def memory_figure(plan: Plan, ax: Any = None) -> Any:
    """Stacked per-device memory bars by kind, with the budget as a line."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    bars = _memory_bars(plan)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(bars) + 2), 4))
    kinds = list(dict.fromkeys(k for _, split in bars for k in split))
    scale, unit = next(((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
                        if max((sum(v.values()) for _, v in bars), default=0) >= s), (1, "B"))
    bottom = [0.0] * len(bars)
    for kind in kinds:
        heights = [split.get(kind, 0.0) / scale for _, split in bars]
        ax.bar(range(len(bars)), heights, bottom=bottom, label=kind, color=KIND_COLORS.get(kind))
        bottom = [b + h for b, h in zip(bottom, heights)]
    if plan.memory_budget_bytes / scale < 4 * max(bottom, default=0):
        ax.axhline(plan.memory_budget_bytes / scale, color="black", linestyle="--", label="budget")
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=7,
                  rotation=90 if len(bars) > 16 else 0)
    ax.set_ylabel(f"peak memory per device ({unit})")
    ax.set_title(f"memory per device at the peak: {plan.name}")
    ax.legend(fontsize=7)
    return ax.figure


def gantt_figure(plan: Plan, ax: Any = None) -> Any | None:
    """The pipeline schedule (None for a plan without stages)."""
    if not plan.stages:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fwd, bwd = stage_times(plan)
    chunks = chunks_of(plan.schedule, [tuple(stage_view(st, s).get("device_indices") or (s,))
                                       for s, st in enumerate(plan.stages)])
    slots = pipeline_schedule(fwd, bwd, max(1, plan.num_microbatches), plan.schedule, chunks)
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(fwd) + 1.5))
    for slot in slots:
        color = "#4c72b0" if slot.kind == "F" else "#dd8452"
        ax.barh(slot.stage, (slot.end_s - slot.start_s) * 1e3, left=slot.start_s * 1e3, color=color,
                edgecolor="white")
        ax.text((slot.start_s + slot.end_s) / 2 * 1e3, slot.stage, f"{slot.kind}{slot.microbatch}",
                ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(fwd)), [f"stage {s}" for s in range(len(fwd))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, modeled)")
    ax.set_title(f"{plan.schedule} schedule, {plan.num_microbatches} microbatches")
    return ax.figure


def figures(plan: Plan) -> list[tuple[str, Any]]:
    """(caption, figure) of every picture the plan has data for, in the report's order."""
    found = [("comparison", comparison_figure(plan)), ("time per layer", layer_time_figure(plan)),
             ("tensor layouts", layout_figure(plan)), ("memory per device", memory_figure(plan)),
             ("pipeline schedule", gantt_figure(plan))]
    return [(caption, fig) for caption, fig in found if fig is not None]


def png_bytes(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def write_png(plan: Plan, path: str | Path) -> None:
    """The memory bars (and the Gantt chart, when there are stages) in one PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = 2 if plan.stages else 1
    fig, axes = plt.subplots(rows, 1, figsize=(max(8, 0.6 * len(_memory_bars(plan)) + 2), 4 * rows), squeeze=False)
    memory_figure(plan, axes[0][0])
    if plan.stages:
        gantt_figure(plan, axes[1][0])
    fig.tight_layout()
    Path(path).write_bytes(png_bytes(fig))
    plt.close(fig)


# ----------------------------------------------------------------------------- comparison, time, layouts


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _time_unit(seconds: float) -> tuple[float, str]:
    return next(((s, u) for s, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")) if seconds >= s), (1e-9, "ns"))


def comparison_figure(plan: Plan) -> Any | None:
    """Modeled step and peak memory per device of every compared strategy (None without a comparison)."""
    if not plan.baselines:
        return None
    plt = _pyplot()
    rows = list(plan.baselines.items())
    names = [name for name, _ in rows]
    step = [float(r["step_s"]) for _, r in rows]
    peak = [float(r["peak_memory_bytes"]) for _, r in rows]
    fits = [bool(r.get("fits", True)) for _, r in rows]
    safer = plan.caveats.safer_choice
    colors = ["#55a868" if n == "autoshard" else "#4c72b0" if ok else "#c44e52" for n, ok in zip(names, fits)]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.8), sharey=True)
    tscale, tunit = _time_unit(max(step))
    ax_t.barh(range(len(rows)), [t / tscale for t in step], color=colors)
    for y, (t, name) in enumerate(zip(step, names)):
        ratio = "" if name == "autoshard" or plan.step_s <= 0 else f"  {t / plan.step_s:.2f}x autoshard"
        ax_t.text(t / tscale, y, f" {fmt_s(t)}{ratio}", va="center", fontsize=8)
    ax_t.set_xlabel(f"modeled step ({tunit}, lower is better)")
    ax_t.set_xlim(0, max(step) / tscale * 1.6)
    mscale, munit = next(((v, u) for v, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if max(peak) >= v),
                         (1, "B"))
    ax_m.barh(range(len(rows)), [m / mscale for m in peak], color=colors, hatch=None)
    for y, (m, (_name, r)) in enumerate(zip(peak, rows)):
        ceiling = r.get("batch_ceiling")
        text = "batch ceiling unbounded" if ceiling is None else f"batch ceiling {int(ceiling):,}"
        ax_m.text(m / mscale, y, f" {fmt_bytes(m)}; {text}" + ("" if r.get("fits", True) else " (over budget)"),
                  va="center", fontsize=8)
    budget = plan.memory_budget_bytes / mscale
    right = max(peak) / mscale * 1.9
    if budget <= right:
        ax_m.axvline(budget, color="black", linestyle="--", linewidth=1)
        ax_m.text(budget, len(rows) - 0.4, " budget", fontsize=8)
    else:
        ax_m.set_title(f"budget {fmt_bytes(plan.memory_budget_bytes)} per device, off the scale", fontsize=8,
                       loc="right")
    ax_m.set_xlim(0, right)
    ax_m.set_xlabel(f"peak memory per device ({munit})")
    ax_t.set_yticks(range(len(rows)), [n + (" (safer choice)" if n == safer else "") for n in names])
    ax_t.invert_yaxis()
    fig.suptitle("autoshard against the classic strategies, same cost model (green: autoshard, red: does not fit)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def layer_time_figure(plan: Plan) -> Any | None:
    """Each layer's modeled time, stacked by what bounds it (None for a plan without per-layer times)."""
    if not plan.layer_times:
        return None
    plt = _pyplot()
    layers = list(plan.layer_times)
    parts = {"FLOP-bound compute": [t.flops_s for t in layers], "HBM-bound compute": [t.hbm_s for t in layers],
             "collectives": [t.comm_s for t in layers], "resharding": [t.reshard_s for t in layers]}
    scale, unit = _time_unit(max(t.total_s for t in layers))
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(layers) + 1.6))
    left = [0.0] * len(layers)
    for what, values in parts.items():
        widths = [v / scale for v in values]
        ax.barh(range(len(layers)), widths, left=left, color=TIME_COLORS[what], label=what)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(layers)), [t.name for t in layers], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"modeled time per step ({unit})")
    ax.set_title(f"where the modeled step ({fmt_s(plan.step_s)}) goes, layer by layer")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def largest_tensors(plan: Plan, count: int = 4) -> list[str]:
    """The paths of the ``count`` largest inputs, one per distinct (layer-free path, spec): repeated layers once."""
    def nbytes(path: str) -> float:
        shape, dtype = plan.input_shapes[path]
        try:
            import numpy as np

            return math.prod(shape) * np.dtype(dtype).itemsize
        except TypeError:
            return math.prod(shape) * 4.0

    chosen, seen = [], set()
    for path in sorted(plan.input_specs, key=lambda p: (-nbytes(p), p)):
        # a parameter's optimizer state laid out like it, and its repeats in other layers, are drawn once
        key = (re.sub(r"\[\d+\]", "#", inner_path(path)), str(plan.input_specs[path]))
        if key in seen or not plan.input_shapes[path][0]:
            continue
        seen.add(key)
        chosen.append(path)
        if len(chosen) == count:
            break
    return chosen


def _grid_dims(shape: Sequence[int], spec: Any) -> tuple[int | None, int]:
    """(row dim or None, column dim) to draw a tensor with: split dims first, then the largest."""
    order = sorted(range(len(shape)), key=lambda d: (not spec.dims[d], -shape[d], d))
    if len(shape) == 1:
        return None, 0
    rows, cols = sorted(order[:2])
    return rows, cols


def _draw_layout(ax: Any, plan: Plan, path: str) -> None:
    from matplotlib.patches import Rectangle

    shape, dtype = plan.input_shapes[path]
    spec = plan.input_specs[path]
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    row_dim, col_dim = _grid_dims(shape, spec)
    row_axes = spec.dims[row_dim] if row_dim is not None else ()
    col_axes = spec.dims[col_dim]
    rows = math.prod(sizes[a] for a in row_axes)
    cols = math.prod(sizes[a] for a in col_axes)
    height = 1.0 if row_dim is None else min(3.0, max(0.35, shape[row_dim] / max(shape[col_dim], 1)))
    cmap = _pyplot().get_cmap("tab20")

    def coords(axes: tuple[str, ...], index: int) -> str:
        out = []
        for a in reversed(axes):  # the last axis varies fastest
            out.append(f"{a}{index % sizes[a]}")
            index //= sizes[a]
        return "".join(reversed(out))

    for r in range(rows):
        for c in range(cols):
            ax.add_patch(Rectangle((c / cols, height * (1 - (r + 1) / rows)), 1 / cols, height / rows,
                                   facecolor=cmap((r * cols + c) % 20), edgecolor="white", linewidth=1.5))
            label = " ".join(x for x in (coords(row_axes, r), coords(col_axes, c)) if x)
            if rows * cols <= 32:
                ax.text((c + 0.5) / cols, height * (1 - (r + 0.5) / rows), label or "all devices", ha="center",
                        va="center", fontsize=7)
    others = [a for a in plan.axis_names if sizes[a] > 1 and a not in spec.used_axes]
    split = [f"dim {d} ({shape[d]}) over {'+'.join(axes)}" for d, axes in enumerate(spec.dims) if axes]
    ax.set_xlim(0, 1)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"dim {col_dim} ({shape[col_dim]})" + ("" if col_axes else ", whole"), fontsize=8)
    if row_dim is not None:
        ax.set_ylabel(f"dim {row_dim} ({shape[row_dim]})" + ("" if row_axes else ", whole"), fontsize=8)
    local = spec.shard_shape(shape, sizes)
    role = plan.input_roles.get(path, "")
    ax.set_title(f"{role} {dotted(inner_path(path))}\n{dtype}{list(shape)} {spec}: "
                 + ("; ".join(split) if split else "replicated")
                 + (f"; copies over {', '.join(others)}" if others else "")
                 + f"\nper device {list(local)}", fontsize=8)


def layout_figure(plan: Plan, count: int = 4) -> Any | None:
    """The largest tensors over the mesh axes: which dims split over which axis (None without inputs)."""
    paths = largest_tensors(plan, count)
    if not paths:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(paths), figsize=(3.6 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths):
        _draw_layout(ax, plan, path)
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    fig.suptitle(f"the largest tensors on mesh ({mesh}): each block is one shard, labelled by the mesh coordinates "
                 "that hold it", fontsize=10)
    fig.tight_layout()
    return fig
