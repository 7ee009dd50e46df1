"""Build and solve time of the intra-op ILP (passes/ilp/) on synthetic sharding problems.

    python benchmarks/ilp_scale.py [--nodes 2000] [--edges 3000] [--time-limit 20] [--no-hint]

The problem imitates a transformer-like graph on a 2 x 4 mesh: every node is a 2-D
value whose strategies are the ways to place mesh axes x (2) and y (4) on its dims
(RR, S(x)R, ..., S(x)S(y), and partial-sum variants); a strategy is an (output layout,
needed input layout) pair, so edge matrices repeat rows and columns as real ones do; a
node costs its compute over the devices that share it; an edge costs the all-reduce and
all-gathers that turn the producer's layout into the one the consumer needs (slicing
is free); memory points are sliding liveness windows; the hint is the most-sharded
plan. Prints the model size, solver status, objective, gap and time (the build time is
in the DEBUG log line of autoshard.passes.ilp).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import numpy as np

from autoshard.passes.ilp import IlpProblem, evaluate, solve
from autoshard.plans.ledger import fmt_gap

AXES = {"x": 2, "y": 4}
LINK_S_PER_BYTE = {"x": 1 / 100e9, "y": 1 / 300e9}
LATENCY_S = 5e-6
PEAK_FLOPS = 300e12


def _layouts() -> list[tuple[tuple[str, ...], tuple[str, ...], str | None]]:
    """(axes on dim 0, axes on dim 1, partial axis) for a 2-D value."""
    options = [(), ("x",), ("y",), ("x", "y")]
    placed = [(d0, d1) for d0 in options for d1 in options if not set(d0) & set(d1)]
    partial = [(d0, d1, p) for d0, d1 in placed for p in AXES if p not in d0 + d1 and len(d0 + d1) < 2]
    return [(d0, d1, None) for d0, d1 in placed] + partial[:16 - len(placed)]


def _shards(layout) -> int:
    return int(np.prod([AXES[a] for a in layout[0] + layout[1]]))


def _reshard_s(src, dst) -> tuple[float, float]:
    """(seconds per byte of the value, latency seconds): all-reduce a pending partial sum, then
    all-gather every axis dst does not keep on the same dim; slicing is free."""
    if dst[2] is not None and src[2] != dst[2]:
        return np.inf, np.inf  # a consumer cannot ask for a partial sum it did not produce
    per_byte = latency = 0.0
    if src[2] is not None and src[2] != dst[2]:
        n = AXES[src[2]]
        per_byte += 2 * (n - 1) / n / _shards(src) * LINK_S_PER_BYTE[src[2]]
        latency += 2 * (n - 1) * LATENCY_S
    for dim in (0, 1):
        for axis in src[dim]:
            if axis not in dst[dim]:
                n = AXES[axis]
                per_byte += (n - 1) / n / _shards(dst) * LINK_S_PER_BYTE[axis]
                latency += (n - 1) * LATENCY_S
    return per_byte, latency


def make_problem(num_nodes: int, num_edges: int, seed: int = 0, strategies: int = 20,
                 window: int = 40) -> IlpProblem:
    """Node strategy j = (output layout out[j], layout it needs of its input in[j]); as for a real
    op, several strategies share an output or an input layout, so edge matrices repeat rows/columns."""
    rng = np.random.default_rng(seed)
    layouts = _layouts()
    table = np.array([[_reshard_s(a, b) for b in layouts] for a in layouts])  # [layout, layout, (per byte, latency)]
    shards = np.array([_shards(s) for s in layouts], dtype=float)
    partial = np.array([s[2] is not None for s in layouts])
    size = rng.choice([2**20, 2**22, 2**24, 2**26], size=num_nodes).astype(float)
    flops = size * rng.uniform(10, 2000, size=num_nodes)
    outs, ins, node_costs = [], [], []
    for i in range(num_nodes):
        out_set = rng.choice(len(layouts), size=8, replace=False)
        in_set = rng.choice(np.flatnonzero(~partial), size=6, replace=False)
        pairs = rng.permutation(len(out_set) * len(in_set))[:strategies]
        out, need = out_set[pairs // len(in_set)], in_set[pairs % len(in_set)]
        cost = flops[i] / PEAK_FLOPS / shards[out] * np.where(partial[out], 0.5, 1.0) * rng.uniform(1, 1.5, size=len(out))
        outs.append(out)
        ins.append(need)
        node_costs.append(cost)
    chain = [(i, i + 1) for i in range(num_nodes - 1)]
    extra = num_edges - len(chain)
    src = rng.integers(0, num_nodes - 2, size=extra)
    dst = np.minimum(src + rng.integers(2, 12, size=extra), num_nodes - 1)
    edges = chain + [(int(u), int(v)) for u, v in zip(src, dst)]
    edge_costs = [table[np.ix_(outs[u], ins[v])][:, :, 0] * size[u] + table[np.ix_(outs[u], ins[v])][:, :, 1]
                  for u, v in edges]
    mem = [size[i] / shards[outs[i]] for i in range(num_nodes)]
    points = tuple(tuple((j, mem[j]) for j in range(p, min(p + window, num_nodes)))
                   for p in range(0, num_nodes, window // 2))
    budget = 0.5 * max(sum(float(mem[j].max()) for j, _ in terms) for terms in points)
    hint = np.array([int(np.argmax(shards[out] - 0.01 * np.arange(len(out)))) for out in outs])
    return IlpProblem(
        node_names=tuple(f"op{i}" for i in range(num_nodes)), node_costs=tuple(node_costs),
        edges=tuple(edges), edge_costs=tuple(edge_costs), memory_points=points,
        memory_budget_bytes=budget, hint=hint,  # hint: the most-sharded output (a cheap-memory start)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--edges", type=int, default=3000)
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hint", action="store_true", help="do not give the solver the most-sharded plan")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("autoshard.passes.ilp").setLevel(logging.DEBUG)
    start = time.perf_counter()
    problem = make_problem(args.nodes, args.edges, args.seed)
    hint = evaluate(problem, problem.hint)
    problem = dataclasses.replace(problem, time_limit_s=args.time_limit, hint=None if args.no_hint else problem.hint)
    made = time.perf_counter()
    solution = solve(problem)
    check = evaluate(problem, solution.choices)
    print(f"problem: {args.nodes} nodes x {len(problem.node_costs[0])} strategies, {len(problem.edges)} edges, "
          f"{len(problem.memory_points)} memory points (made in {made - start:.2f}s)")
    print(f"solve: {solution.status}, objective {solution.objective_s * 1e3:.4f} ms (most-sharded plan {hint.objective_s * 1e3:.4f} ms), "
          f"gap {fmt_gap(solution.gap)}, {solution.solve_s:.2f}s total, {solution.num_variables} variables, "
          f"{solution.num_constraints} constraints, violations {len(check.violations)}")


if __name__ == "__main__":
    main()
