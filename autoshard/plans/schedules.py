"""Pipeline schedules: the dispatch order of forward and backward actions (pure Python, no jax).

``PipelineSchedule`` names the schedules the planner and runtime know:
GPipe (every forward, then every backward), 1F1B (warm-up forwards, then one
forward and one backward in turn) and interleaved 1F1B (Megatron-LM's: each of
p device groups holds v non-adjacent stage chunks, chunk c on group c mod p, so
the pipeline fill is a chunk's time rather than a stage's and the bubble is
divided by v; B must be a multiple of p). Plan data, below both users: the stage
DP (``passes/stages.py``, ``passes/interleave.py``) prices them, the pipeline
runtime (``runtime/pipeline.py``) runs ``schedule_actions``. A new schedule adds
its name to ``SCHEDULES`` and its order here, its in-flight count in
``passes/stage_problem.in_flight``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

PipelineSchedule: TypeAlias = Literal["1f1b", "gpipe", "interleaved"]
SCHEDULES: tuple[PipelineSchedule, ...] = ("1f1b", "gpipe", "interleaved")
Action: TypeAlias = tuple[Literal["F", "B"], int, int]  # (kind, stage, microbatch)


def schedule_actions(kind: PipelineSchedule, num_stages: int, num_microbatches: int, chunks: int = 1) -> list[Action]:
    """Dispatch order of forward (F) and backward (B) actions for GPipe, 1F1B or interleaved 1F1B.

    GPipe: every forward in microbatch order, then every backward. Otherwise each worker's own order
    (:func:`worker_orders`) merged by simulating time steps (every worker runs its next action when its inputs
    are ready), which is a valid order for one controller.
    """
    if kind == "gpipe":
        return ([("F", s, m) for m in range(num_microbatches) for s in range(num_stages)]
                + [("B", s, m) for m in range(num_microbatches) for s in reversed(range(num_stages))])
    return _merge(worker_orders(kind, num_stages, num_microbatches, chunks), num_stages, num_microbatches)


def worker_orders(kind: PipelineSchedule, num_stages: int, num_microbatches: int, chunks: int = 1
                  ) -> list[list[Action]]:
    """Each worker's actions in order: a worker is a stage (GPipe, 1F1B) or, interleaved (``chunks`` = v stage
    chunks per device group, S = p v), a device group, running stages g, g + p, ... (:func:`interleaved_order`).

    1F1B: stage s runs min(S - s - 1, B) warm-up forwards, then alternates one forward and one backward, then
    drains its backwards. GPipe: every forward, then every backward."""
    s_n, b_n = num_stages, num_microbatches
    if kind == "gpipe":
        return [[("F", s, m) for m in range(b_n)] + [("B", s, m) for m in range(b_n)] for s in range(s_n)]
    if kind == "interleaved":
        if chunks < 1 or s_n % chunks:
            raise ValueError(f"interleaved: {num_stages} stages are not {chunks} chunks per device group")
        groups = s_n // chunks
        if b_n % groups:
            raise ValueError(f"interleaved 1F1B needs the microbatch count ({b_n}) to be a multiple of the "
                             f"device groups ({groups})")
        return [interleaved_order(g, groups, chunks, b_n) for g in range(groups)]
    if kind != "1f1b":
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {kind!r}")
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
    return per_stage


def chunks_of(kind: PipelineSchedule, device_groups: Sequence[Sequence[int]]) -> int:
    """Stage chunks per device group of a plan whose stages run on ``device_groups`` (per stage, its device
    indices): interleaved, the stages over the distinct groups; otherwise 1."""
    if kind != "interleaved":
        return 1
    return len(device_groups) // max(1, len({tuple(g) for g in device_groups}))


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """What an action waits for: a forward, the stage before's forward of its microbatch; a backward, its own
    forward and the stage after's backward."""
    kind, s, m = action
    if kind == "F":
        return [("F", s - 1, m)] if s > 0 else []
    return [("F", s, m)] + ([("B", s + 1, m)] if s + 1 < num_stages else [])


def flush_step_s(times: Sequence[float], transfers: Sequence[float], num_microbatches: int
                 ) -> tuple[float, float, float]:
    """(step, bottleneck, first-microbatch latency) of GPipe and 1F1B: stage s takes ``times[s]`` per microbatch
    (forward and backward, its once-per-step work spread over the microbatches) and ``transfers[s]`` to the
    next; the first microbatch passes every stage and transfer, the others follow one bottleneck apart:
    sum t + sum x + (B - 1) max(t, x). The stage DP's objective and a compiled pipeline's price
    (``compiler/verify_pipeline.compiled_pipeline_price``) both read it."""
    latency = sum(times) + sum(transfers)
    bottleneck = max((*times, *transfers))
    return latency + (num_microbatches - 1) * bottleneck, bottleneck, latency


def interleaved_step_s(times: Sequence[float], transfers: Sequence[float], num_microbatches: int,
                       groups: int) -> tuple[float, float]:
    """(step, busiest group's work per microbatch) of interleaved 1F1B: chunk c (time ``times[c]``, transfer
    ``transfers[c]`` to chunk c + 1) on device group c mod ``groups``; the busiest group's steady state plus
    the fill through the first p - 1 chunks: B max_g sum_{c on g} (t_c + x_c) + sum_{c < p - 1} (t_c + x_c)
    (``passes/interleave.py`` derives it)."""
    num_chunks = len(times)
    load = [0.0] * groups
    for c in range(num_chunks):
        load[c % groups] += times[c] + (transfers[c] if c < num_chunks - 1 else 0.0)
    busiest = max(load)
    fill = sum(times[c] + transfers[c] for c in range(min(groups - 1, num_chunks - 1)))
    return num_microbatches * busiest + fill, busiest


def interleaved_warmup(group: int, groups: int, chunks: int, num_microbatches: int) -> int:
    """Forwards device group ``group`` runs before its first backward in interleaved 1F1B (Megatron-LM's count):
    its chunk-microbatches in flight at peak are this plus one, at most B v."""
    return min((groups - group - 1) * 2 + (chunks - 1) * groups, num_microbatches * chunks)


def interleaved_order(group: int, groups: int, chunks: int, num_microbatches: int) -> list[Action]:
    """Device group ``group``'s actions in interleaved 1F1B: its k-th forward runs chunk (k // p) mod v on
    microbatch (k // (p v)) p + k mod p (p microbatches through each chunk in turn), its k-th backward the
    chunks in reverse; warm-up forwards, then one forward and one backward in turn, then the backwards left.
    Chunk j of group g is stage j p + g."""
    total = num_microbatches * chunks

    def at(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // groups) % chunks
        if not forward:
            chunk = chunks - 1 - chunk
        return chunk * groups + group, (k // (groups * chunks)) * groups + k % groups

    warm = interleaved_warmup(group, groups, chunks, num_microbatches)
    seq: list[Action] = [("F", *at(k, True)) for k in range(warm)]
    for i in range(total - warm):
        seq.append(("F", *at(warm + i, True)))
        seq.append(("B", *at(i, False)))
    seq += [("B", *at(k, False)) for k in range(total - warm, total)]
    return seq


def _merge(workers: list[list[Action]], s_n: int, b_n: int) -> list[Action]:
    """One dispatch order from per-worker action lists: each round, every worker whose next action's inputs
    are done (:func:`dependencies`) runs it."""
    done: set[Action] = set()
    order: list[Action] = []
    cursor = [0] * len(workers)
    while len(order) < 2 * s_n * b_n:
        ready = [(w, seq[cursor[w]]) for w, seq in enumerate(workers) if cursor[w] < len(seq)
                 and all(d in done for d in dependencies(seq[cursor[w]], s_n))]
        if not ready:
            raise RuntimeError(f"pipeline schedule deadlocked at {order[-3:]}")  # a bug, not a user error
        for w, act in ready:
            order.append(act)
            done.add(act)
            cursor[w] += 1
    return order
