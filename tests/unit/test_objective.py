"""The objective is the truth: the planner's plan costs what the whole graph says, and no plan is cheaper.

``passes/objective.py`` recomputes a decoded plan's cost on the unsimplified graph; every plan the suite
makes is checked against the ILP objective and the ledger (``ObjectiveMismatchWarning`` is an error under
pytest, pyproject.toml). Here: small programs (at most a dozen ops) planned with every simplification
on (followers, tied layers, presolve, the hint) against an exhaustive search of the unsimplified graph.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.compiler.target import resolve_target
from autoshard.errors import ObjectiveMismatchWarning
from autoshard.ir.trace import trace
from autoshard.passes import objective
from autoshard.passes.cost_graph import CostGraph, IntraOpOptions
from autoshard.passes.ilp import brute_force, evaluate
from autoshard.passes.ilp.problem import IlpProblem, exhaustive
from autoshard.passes.intra_op import build_problem, plan_intra_op

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _mlp(w1, w2, x):
    return jnp.sum(jax.nn.relu(x @ w1) @ w2)


def _sgd(w, x, y):
    g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g


def _broadcast_scalar(x, w):  # a scalar broadcast to the batch: it must not force the batch replicated
    return jnp.sum((x @ w) * jnp.mean(x))


def _residual(w, x):
    return jnp.sum(jnp.tanh(x @ w) + x)


def _two_layers(w1, w2, x):  # a tandem repeat: the two layers are tied
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))


def _follower(w, x):  # exp(w) follows w's layout
    return jnp.sum(x @ jnp.exp(w))


def _momentum(w, m, x):  # state written back to its storage
    g = x.T @ jnp.tanh(x @ w)
    m = 0.9 * m + g
    return w - 0.1 * m, m


def _softmax(x, w):
    h = x @ w
    return jnp.sum(jax.nn.softmax(h, axis=-1) * h)


PROGRAMS = {
    "mlp": (_mlp, (S((64, 256), F32), S((256, 64), F32), S((4096, 64), F32))),
    "sgd": (_sgd, (S((128, 128), F32), S((8192, 128), F32), S((8192, 128), F32))),
    "broadcast-scalar": (_broadcast_scalar, (S((8192, 128), F32), S((128, 128), F32))),
    "residual": (_residual, (S((256, 256), F32), S((8192, 256), F32))),
    "two-layers": (_two_layers, (S((128, 128), F32), S((128, 128), F32), S((4096, 128), F32))),
    "follower": (_follower, (S((256, 256), F32), S((64, 256), F32))),
    "momentum": (_momentum, (S((128, 128), F32), S((128, 128), F32), S((4096, 128), F32))),
    "softmax": (_softmax, (S((4096, 128), F32), S((128, 512), F32))),
}
# (mesh, cluster): one axis inside a node; two axes across two nodes (the slow link in the model)
MESHES = {"4-a100": ((4,), "1x8-a100"), "2x2-two-nodes": ((2, 2), "2x8-a100")}
TOO_BIG = {("momentum", "2x2-two-nodes"), ("softmax", "2x2-two-nodes")}  # beyond the exhaustive search's limit
LONG = {("sgd", "2x2-two-nodes")}  # 1.6e7 combinations: a minute
CASES = [pytest.param(name, mesh, marks=pytest.mark.slow if (name, mesh) in LONG else ())
         for name in PROGRAMS for mesh in MESHES if (name, mesh) not in TOO_BIG]


def _unsimplified(graph, mesh) -> IlpProblem:
    """The ILP of the whole graph: one variable per node, nothing tied, merged, hinted or bounded."""
    cg = CostGraph(graph, mesh, IntraOpOptions(tie_layers=False, merge_followers=False))
    return dataclasses.replace(build_problem(cg), hint=None, memory_budget_bytes=None)


@pytest.mark.parametrize("name, mesh_name", CASES)
def test_small_programs_plan_the_exact_optimum(name: str, mesh_name: str) -> None:
    fn, args = PROGRAMS[name]
    graph = trace(fn, *args)
    assert len(graph.ops) <= 12
    mesh_shape, cluster = MESHES[mesh_name]
    mesh = resolve_target(mesh_shape, cluster, None).meshes[0]
    planned = plan_intra_op(graph, mesh, IntraOpOptions())
    best = exhaustive(_unsimplified(graph, mesh), max_combinations=20_000_000)
    assert planned.step_s == pytest.approx(best.objective_s, rel=1e-9, abs=1e-15), (name, mesh_name)
    # the three figures of the chosen plan agree
    check = planned.objective
    assert check is not None and check.agrees()
    assert check.recomputed_s == pytest.approx(planned.step_s, rel=1e-9)


def test_exhaustive_agrees_with_brute_force_on_random_problems() -> None:
    from autoshard.passes.ilp.problem import SharedReshard
    rng = np.random.default_rng(11)
    for instance in range(40):
        n = int(rng.integers(2, 7))
        sizes = rng.integers(1, 5, size=n)
        edges = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.5]
        problem = IlpProblem(
            node_names=tuple(f"n{i}" for i in range(n)),
            node_costs=tuple(rng.uniform(0, 1, size=k) for k in sizes),
            edges=tuple(edges),
            edge_costs=tuple(np.where(rng.random((sizes[u], sizes[v])) < 0.1, np.inf,
                                      rng.uniform(0, 1, size=(sizes[u], sizes[v]))) for u, v in edges),
            memory_points=(),
        )
        if instance % 2:  # with shared reshards: a producer and two or three readers
            producer = int(rng.integers(n))
            readers = [i for i in range(n) if i != producer][:int(rng.integers(1, 4))]
            layouts = int(rng.integers(1, 4))
            problem = dataclasses.replace(problem, reshards=(SharedReshard(
                "r", producer, rng.uniform(0, 1, size=(sizes[producer], layouts)),
                tuple((r, rng.integers(-1, layouts, size=sizes[r])) for r in readers)),))
        try:
            want = brute_force(problem)
        except Exception as error:  # noqa: BLE001 - both must refuse alike
            with pytest.raises(type(error)):
                exhaustive(problem)
            continue
        got = exhaustive(problem)
        assert got.objective_s == pytest.approx(want.objective_s, rel=1e-12), instance
        assert evaluate(problem, got.choices).objective_s == pytest.approx(got.objective_s, rel=1e-12)


def test_a_mismatch_is_reported() -> None:
    fn, args = PROGRAMS["mlp"]
    graph = trace(fn, *args)
    mesh = resolve_target((4,), "1x8-a100", None).meshes[0]
    planned = plan_intra_op(graph, mesh, IntraOpOptions())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ObjectiveMismatchWarning)
        objective.check(graph, mesh, planned.node_strategies, planned.step_s, planned.step_s)  # agrees: silent
        with pytest.raises(ObjectiveMismatchWarning, match="ILP"):
            objective.check(graph, mesh, planned.node_strategies, planned.step_s * 1.01, planned.step_s)
        # a plan with another strategy somewhere costs something else than the chosen plan's figures
        other = list(planned.node_strategies)
        j = len(graph.inputs)  # the first op, a dot: take another of its strategies
        alternatives = [s for s in CostGraph(graph, mesh, IntraOpOptions()).strategies[j] if s != other[j]]
        other[j] = alternatives[0]
        with pytest.raises(ObjectiveMismatchWarning):
            objective.check(graph, mesh, other, planned.step_s, planned.step_s)


def test_a_combined_group_pays_the_largest_latency_among_its_chosen_members() -> None:
    """Two late reductions over one axis (two gradient dots): an all-reduce and a reduce-scatter chosen
    together pay the all-reduce's latency once; the reduce-scatters alone, a reduce-scatter's."""
    def two_gradients(w1, w2, x):
        return x.T @ (x @ w1), x.T @ (x @ w2)

    graph = trace(two_gradients, S((64, 64), F32), S((64, 64), F32), S((4096, 64), F32))
    mesh = resolve_target((4,), "1x8-a100", None).meshes[0]
    cg = CostGraph(graph, mesh, IntraOpOptions())
    ops = cg.strategies[cg.num_inputs:]
    grads = [j for j, op in enumerate(graph.ops) if j in cg.late and op.primitive == "dot_general"]
    assert len(grads) == 2

    def pick(j: int, kind: str) -> int:
        return next(a for a, s in enumerate(ops[j]) if [c.kind for c in s.collectives] == [kind])

    def latency(kinds: tuple[str, str]) -> float:
        chosen = [[s[0]] for s in ops]
        for j, kind in zip(grads, kinds):
            chosen[j] = [ops[j][pick(j, kind)]]
        return sum(c.cost_s for c in objective.latency_charges(graph, mesh, chosen, cg.late))

    from autoshard.ir.spec import Collective
    from autoshard.meshes import cost
    ar = cost.latency_s(mesh, Collective("all-reduce", ("x",), 0.0))
    rs = cost.latency_s(mesh, Collective("reduce-scatter", ("x",), 0.0))
    assert ar > rs > 0
    assert latency(("all-reduce", "reduce-scatter")) == pytest.approx(ar)
    assert latency(("all-reduce", "all-reduce")) == pytest.approx(ar)
    assert latency(("reduce-scatter", "reduce-scatter")) == pytest.approx(rs)
