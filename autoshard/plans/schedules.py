"""Pipeline schedules: the dispatch order of forward and backward actions (pure Python, no jax).

``PipelineSchedule`` names the two schedules the planner and runtime know:
GPipe (every forward, then every backward) and 1F1B (warm-up forwards, then one
forward and one backward in turn). Plan data, below both users: the stage DP
(``passes/stages.py``) prices them, the pipeline runtime (``runtime/pipeline.py``)
runs ``schedule_actions``. A new schedule adds its name to ``SCHEDULES`` and its
order here, its in-flight count in ``passes/stage_problem.in_flight``.
"""
from __future__ import annotations

from typing import Literal, TypeAlias

PipelineSchedule: TypeAlias = Literal["1f1b", "gpipe"]
SCHEDULES: tuple[PipelineSchedule, ...] = ("1f1b", "gpipe")
Action: TypeAlias = tuple[Literal["F", "B"], int, int]  # (kind, stage, microbatch)


def schedule_actions(kind: PipelineSchedule, num_stages: int, num_microbatches: int) -> list[Action]:
    """Dispatch order of forward (F) and backward (B) actions for GPipe or 1F1B.

    1F1B: stage s runs min(S - s - 1, B) warm-up forwards, then alternates one
    forward and one backward, then drains its backwards. The per-stage lists
    are merged by simulating time steps (every stage runs its next action when
    its inputs are ready), which is a valid order for one controller.
    """
    s_n, b_n = num_stages, num_microbatches
    if kind == "gpipe":
        return ([("F", s, m) for m in range(b_n) for s in range(s_n)]
                + [("B", s, m) for m in range(b_n) for s in reversed(range(s_n))])
    if kind != "1f1b":
        raise ValueError(f"schedule must be '1f1b' or 'gpipe'; got {kind!r}")
    per_stage: list[list[Action]] = []
    for s in range(s_n):
        warm = min(s_n - s - 1, b_n)
        seq: list[Action] = [("F", s, m) for m in range(warm)]
        f, b = warm, 0
        while b < b_n:
            if f < b_n:
                seq.append(("F", s, f))
                f += 1
            seq.append(("B", s, b))
            b += 1
        per_stage.append(seq)
    done: set[Action] = set()
    order: list[Action] = []
    cursor = [0] * s_n
    while len(order) < 2 * s_n * b_n:
        ready = []
        for s in range(s_n):
            if cursor[s] == len(per_stage[s]):
                continue
            kind_, _, m = act = per_stage[s][cursor[s]]
            deps = [("F", s - 1, m)] if kind_ == "F" and s > 0 else []
            if kind_ == "B":
                deps = [("F", s, m)] + ([("B", s + 1, m)] if s + 1 < s_n else [])
            if all(d in done for d in deps):
                ready.append(act)
        if not ready:
            raise RuntimeError(f"1F1B schedule deadlocked at {order[-3:]}")  # a bug, not a user error
        for act in ready:
            order.append(act)
            done.add(act)
            cursor[act[1]] += 1
    return order
