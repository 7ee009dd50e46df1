"""Planning cost grows linearly with depth: the memory model's donation assignment against a brute-force
reference, and the work of each planning pass counted at two depths of a GPT."""
from __future__ import annotations

import cProfile
import dataclasses
import pstats
import random
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

from autoshard.compiler.target import resolve_target
from autoshard.errors import ObjectiveMismatchWarning
from autoshard.ir.trace import trace
from autoshard.passes.buffer_rules import Span, assign_to_donated
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.decode import decode, memory_profile
from autoshard.passes.plan_result import IlpStats
from autoshard.passes.simplify import find_tandem_repeats
from examples import gpt

T = TypeVar("T")


def _assign_by_scan(spans: list[Span], pools: list[tuple[float, list[tuple[int, int]]]]) -> list[Span]:
    """The rule as written: every span, largest first, into the first pool (by size) it fits for its life."""
    pools = sorted(((size, list(busy)) for size, busy in pools), key=lambda p: p[0])
    heap = []
    for s in sorted(spans, key=lambda s: (-s.nbytes, s.start)):
        for size, busy in pools:
            if size >= s.nbytes and all(s.stop < a or b < s.start for a, b in busy):
                busy.append((s.start, s.stop))
                break
        else:
            heap.append(s)
    return heap


@pytest.mark.parametrize("seed", range(12))
def test_assign_to_donated_matches_the_scan(seed: int) -> None:
    rng = random.Random(seed)
    end = rng.randint(20, 200)
    sizes = [rng.choice((4.0, 8.0, 16.0, 64.0)) for _ in range(rng.randint(1, 30) * (1 + 3 * (seed % 3 == 0)))]
    pools = []
    for k, size in enumerate(sizes):
        last, write = sorted(rng.randint(0, end) for _ in range(2))
        busy = [(0, last), (write, end)] if rng.random() < 0.8 else [(0, min(k + 1, end)), (write, end)]
        pools.append((size, busy))
    spans = []
    for _ in range(rng.randint(1, 300) * (1 + 5 * (seed % 3 == 0))):  # every third: many spans per pool
        start = rng.randint(0, end)
        spans.append(Span(start, min(end, start + rng.randint(0, end // 3)), rng.choice((2.0, 4.0, 8.0, 16.0, 64.0,
                                                                                          128.0)), "activation"))
    expected = _assign_by_scan(spans, pools)
    assert len(expected) < len(spans) or not pools  # the case places something
    assert assign_to_donated(spans, pools) == expected


def _tandem_by_scan(tokens: list[int], min_period: int) -> list[tuple[int, int, int]]:
    """Every period compared over the whole sequence: the definition find_tandem_repeats keeps."""
    seq = np.asarray(tokens, dtype=np.int64)
    n = len(seq)
    candidates = []
    for period in range(min_period, n // 2 + 1):
        match = np.concatenate(([False], seq[:-period] == seq[period:], [False]))
        edges = np.flatnonzero(match[1:] != match[:-1])
        for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
            if stop - start >= period:
                repeats = (stop - start + period) // period
                candidates.append(((repeats - 1) * period, period, start, repeats))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    taken = np.zeros(n, dtype=bool)
    chosen = []
    for _saved, period, start, repeats in candidates:
        if not taken[start:start + period * repeats].any():
            taken[start + period:start + period * repeats] = True
            chosen.append((start, period, repeats))
    return sorted(chosen)


@pytest.mark.parametrize("seed", range(40))
def test_tandem_repeats_match_the_full_scan(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.randint(1, 5)
    block = [rng.randint(0, alphabet) for _ in range(rng.randint(1, 40))]
    tokens = (block * rng.randint(1, 5) + [rng.randint(0, alphabet) for _ in range(rng.randint(0, 20))]
              + block[:rng.randint(0, 30)] * rng.randint(1, 4))
    min_period = rng.randint(1, 3)
    assert find_tandem_repeats(tokens, min_period) == _tandem_by_scan(tokens, min_period)


def test_tandem_repeats_of_a_layered_sequence() -> None:
    layer = list(range(100, 160))
    tokens = [1, 2, 3] + layer * 20 + [4, 5] + [t + 1000 for t in layer[::-1]] * 20 + [7, 8, 9] * 30
    found = find_tandem_repeats(tokens)
    assert found == _tandem_by_scan(tokens, 1)
    assert (3, 60, 20) in found and (3 + 1200 + 2, 60, 20) in found


def _calls(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()`` and the Python function calls it made (cProfile's count: exact, unlike seconds on a
    shared machine)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        out = fn()
    finally:
        profiler.disable()
    return out, pstats.Stats(profiler).total_calls


def _planning_work(layers: int) -> dict[str, int]:
    """Ops of a tiny GPT of ``layers`` layers and the calls two passes make planning it on (2, 4): decoding a
    plan (the first strategy of every class) and its memory profile."""
    workload = gpt.workload(dataclasses.replace(gpt.CONFIGS["tiny"], num_layers=layers), abstract=True)
    graph = trace(workload.step, *workload.args)
    mesh = resolve_target((2, 4), "1x8-a100", None).meshes[0]

    cg = CostGraph(graph, mesh, IntraOpOptions())
    choices = np.zeros(cg.classes.num_classes, dtype=np.int64)
    stats = IlpStats(0, 0, 0, 0, 0, 0, 0, "test", 0.0, 0.0, 0.0)  # no ILP objective: the check warns, ignored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ObjectiveMismatchWarning)
        result, decode_calls = _calls(lambda: decode(cg, choices, stats))
    _, memory_calls = _calls(lambda: memory_profile(graph, result.value_specs, cg.sizes, result.reshards,
                                                    result.node_strategies[cg.num_inputs:]))
    return {"ops": len(graph.ops), "decode": decode_calls - memory_calls,
            "memory": memory_calls}


def test_planning_work_grows_linearly_with_depth() -> None:
    """Decode's and the memory profile's calls grow no faster than the ops from 3 to 9 layers (10% slack):
    a pass that scans every op or value per op fails here (the donated-buffer assignment once did: its
    calls grew 1.22x the ops' growth from 3 to 9 layers, 1.42x from 4 to 16)."""
    small, large = _planning_work(3), _planning_work(9)
    growth = large["ops"] / small["ops"]
    assert growth > 2.5
    for name in ("decode", "memory"):
        assert large[name] / small[name] <= 1.1 * growth, (name, small, large)
