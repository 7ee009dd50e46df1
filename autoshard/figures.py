"""Pictures of a plan: memory bars per device, the pipeline schedule as a Gantt chart; PNG and HTML files.

``memory_figure`` shows one memory bar per device split by kind and
``gantt_figure``, when the plan has pipeline stages, the schedule;
``write_png`` and ``write_html`` put them in files (the HTML with the explain
tables of ``report.py``, self-contained).

Stages are ``plans/stage_plan.PipelineStage`` (per-microbatch time,
split 1:2 into forward and backward; memory by kind; devices) or plain
mappings with ``name``, ``forward_s`` and ``backward_s`` (or ``time_s``),
``peak_memory_bytes``, ``memory_by_kind`` and ``num_devices``.
"""
from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console, Group

from autoshard.plans.plan import Plan
from autoshard.report import KIND_COLORS, explain_renderables


@dataclass(frozen=True)
class Slot:
    stage: int
    microbatch: int
    kind: Literal["F", "B"]
    start_s: float
    end_s: float


def pipeline_schedule(forward_s: Sequence[float], backward_s: Sequence[float], num_microbatches: int,
                      schedule: str = "1f1b") -> list[Slot]:
    """Start and end of every forward and backward of every microbatch on every stage.

    Each stage runs its work in the schedule's order (GPipe: all forwards, then all
    backwards; 1F1B: S - s - 1 warm-up forwards, then one forward one backward),
    starting each piece when the stage is free and its input has arrived
    (the previous stage's forward, the next stage's backward).
    """
    stages = len(forward_s)
    order: list[list[tuple[str, int]]] = []
    for s in range(stages):
        if schedule == "gpipe":
            work = [("F", m) for m in range(num_microbatches)] + [("B", m) for m in range(num_microbatches)]
        else:
            warm = min(stages - s - 1, num_microbatches)
            work = [("F", m) for m in range(warm)]
            f, b = warm, 0
            while b < num_microbatches:
                if f < num_microbatches:
                    work.append(("F", f))
                    f += 1
                work.append(("B", b))
                b += 1
        order.append(work)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    slots: list[Slot] = []
    while any(position[s] < len(order[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] >= len(order[s]):
                continue
            kind, m = order[s][position[s]]
            if kind == "F":
                need = [("F", s - 1, m)] if s > 0 else []
            else:
                need = [("F", s, m)] + ([("B", s + 1, m)] if s + 1 < stages else [])
            if any(n not in done for n in need):
                continue
            start = max([free[s]] + [done[n] for n in need])
            end = start + (forward_s[s] if kind == "F" else backward_s[s])
            done[(kind, s, m)] = end
            free[s] = end
            position[s] += 1
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
            "num_devices": len(getattr(stage, "device_indices", ())) or 1}


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
    slots = pipeline_schedule(fwd, bwd, max(1, plan.num_microbatches), plan.schedule)
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


def figures(plan: Plan) -> list[Any]:
    found = [memory_figure(plan)]
    gantt = gantt_figure(plan)
    if gantt is not None:
        found.append(gantt)
    return found


def _png_bytes(fig: Any) -> bytes:
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
    Path(path).write_bytes(_png_bytes(fig))
    plt.close(fig)


def write_html(plan: Plan, path: str | Path, renderables: Sequence[Any] | None = None) -> None:
    """A self-contained HTML report: the explain tables and the pictures (inline PNG)."""
    import matplotlib.pyplot as plt

    console = Console(record=True, width=140, file=io.StringIO())
    console.print(Group(*(renderables if renderables is not None else explain_renderables(plan))))
    tables = console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace\">{code}</pre>")
    images = []
    for fig in figures(plan):
        data = base64.b64encode(_png_bytes(fig)).decode()
        images.append(f'<img alt="plan figure" src="data:image/png;base64,{data}">')
        plt.close(fig)
    Path(path).write_text(
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f"<title>autoshard plan {html.escape(plan.name)}</title></head><body>"
        f"<h1>autoshard plan {html.escape(plan.name)}</h1>{''.join(images)}{tables}</body></html>")
