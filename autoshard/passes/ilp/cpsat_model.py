"""The CP-SAT model's building blocks (``passes/ilp/cpsat.py`` writes out the formulation and uses them):
the model and its variables, the integer scaling of costs, constraints (a), (e), (e') and (f), running
CP-SAT and reading its choices back."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
from ortools.sat.python import cp_model

from autoshard.errors import PlanningError
from autoshard.passes.ilp.presolve import Reduced
from autoshard.passes.ilp.problem import IlpProblem, NodeIndex

VarIndex: TypeAlias = int  # index of a variable in the CP-SAT model proto

TICKS_FOR_LARGEST_COST = 1e9


def to_ticks(seconds: np.ndarray, ticks_per_s: float) -> np.ndarray:
    """Integer ticks; inf becomes 0 (a forbidden entry gets no variable); a positive cost stays >= 1."""
    finite = np.isfinite(seconds)
    ticks = np.round(np.where(finite, seconds, 0.0) * ticks_per_s).astype(np.int64)
    ticks[(ticks == 0) & finite & (seconds > 0)] = 1
    return ticks


def ticks_scale(red: Reduced) -> float:
    """q: the largest finite reduced cost becomes TICKS_FOR_LARGEST_COST ticks."""
    largest = max([float(c.max()) for c in red.node_cost]
                  + [float(m[np.isfinite(m)].max(initial=0.0)) for _, _, m in red.edges]
                  + [cost for cost, _ in red.charges] + [float(c.max()) for _, c, _ in red.reshards], default=0.0)
    return TICKS_FOR_LARGEST_COST / largest if largest > 0 else 1.0


# ---------------------------------------------------------------------------------------------
# model builders, one per constraint family


@dataclass
class Model:
    """A CP-SAT model under construction and where each node's booleans s[i, .] live in it."""
    cp: cp_model.CpModel
    red: Reduced
    names: tuple[str, ...]
    first_var: np.ndarray  # per node: proto index of s[i, 0]; -1 for a node fixed by presolve
    num_vars: int = 0
    charge_vars: list[VarIndex] = dataclasses.field(default_factory=list)  # z[k] per open shared charge

    @property
    def proto(self) -> cp_model.cp_model_helper.CpModelProto:
        return self.cp.proto

    def s(self, node: NodeIndex, a: int) -> VarIndex:
        return int(self.first_var[node]) + a


def add_var(model: Model, lower: int, upper: int, name: str) -> VarIndex:
    var = model.proto.variables.add()
    var.domain.extend((lower, upper))
    var.name = name
    model.num_vars += 1
    return model.num_vars - 1


def add_bools(model: Model, names: list[str]) -> VarIndex:
    """Add one boolean per name; returns the index of the first."""
    add = model.proto.variables.add
    for name in names:
        var = add()
        var.domain.extend((0, 1))
        var.name = name
    model.num_vars += len(names)
    return model.num_vars - len(names)


def add_linear(model: Model, name: str, variables: list[int], coeffs: list[int], lower: int, upper: int) -> None:
    # Written into the proto directly (named like .with_name would): 4x faster to build than LinearExpr.
    constraint = model.proto.constraints.add()
    constraint.name = name
    constraint.linear.vars.extend(variables)
    constraint.linear.coeffs.extend(coeffs)
    constraint.linear.domain.extend([lower, upper])


def new_model(problem: IlpProblem, red: Reduced) -> Model:
    model = Model(cp_model.CpModel(), red, problem.node_names, np.full(problem.num_nodes, -1, dtype=np.int64))
    for i, allowed in enumerate(red.allowed):
        if len(allowed) > 1:
            model.first_var[i] = add_bools(model, [f"s[{problem.node_names[i]},{a}]" for a in allowed])
    return model


def add_one_hot(model: Model) -> None:  # (a)
    for i, first in enumerate(model.first_var):
        if first >= 0:
            constraint = model.proto.constraints.add()
            constraint.name = f"one_hot[{model.names[i]}]"
            constraint.exactly_one.literals.extend(range(first, first + len(model.red.allowed[i])))


def add_forbidden_pairs(model: Model) -> None:  # (f), min-peak model only
    for u, v, matrix in model.red.edges:
        for b in np.flatnonzero(~np.isfinite(matrix).all(axis=0)):
            constraint = model.proto.constraints.add()
            constraint.name = f"forbid[{model.names[u]}->{model.names[v]},{model.red.allowed[v][b]}]"
            constraint.at_most_one.literals.extend(
                [model.s(v, b)] + [model.s(u, a) for a in np.flatnonzero(~np.isfinite(matrix[:, b]))])


def memory_row(model: Model, p: int) -> tuple[list[int], list[int]]:
    variables: list[int] = []
    coeffs: list[int] = []
    for node, nbytes in model.red.point_terms[p]:
        nonzero = np.flatnonzero(nbytes)
        variables += [model.s(node, a) for a in nonzero]
        coeffs += nbytes[nonzero].tolist()
    return variables, coeffs


def add_memory_budget(model: Model, budget_bytes: float) -> bool:  # (e)
    """Add (e); False if some point is over budget whatever the choices."""
    budget = math.floor(budget_bytes)
    for p, terms in enumerate(model.red.point_terms):
        room = budget - model.red.point_const[p]
        if room < 0:
            return False
        if sum(int(nbytes.max()) for _, nbytes in terms) > room:  # else it can never bind
            add_linear(model, f"memory[{p}]", *memory_row(model, p), 0, room)
    return True


def add_peak_memory(model: Model) -> VarIndex:  # (e')
    red = model.red
    lower = max(red.point_const, default=0)
    upper = max((red.point_const[p] + sum(int(b.max()) for _, b in terms) for p, terms in enumerate(red.point_terms)),
                default=0)
    peak = add_var(model, lower, upper, "peak")
    for p in range(len(red.point_terms)):
        variables, coeffs = memory_row(model, p)
        if variables:
            add_linear(model, f"peak[{p}]", variables + [peak], coeffs + [-1], cp_model.INT_MIN, -red.point_const[p])
    return peak


def run(model: Model, problem: IlpProblem) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = problem.time_limit_s
    solver.parameters.random_seed = problem.seed
    solver.parameters.num_workers = problem.num_workers
    solver.parameters.linearization_level = 2  # LP cuts pay off on (c)-(d); measured 2x on ilp_scale
    solver.parameters.cp_model_probing_level = 0  # probing 100k+ y booleans costs more than it finds
    solver.parameters.hint_conflict_limit = 0  # a complete hint is taken as is; searching near it cost 2x
    status = solver.solve(model.cp)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {model.cp.validate()}")
    return solver, status


def decode_choices(model: Model, solver: cp_model.CpSolver) -> np.ndarray:
    values = np.asarray(solver.response_proto.solution, dtype=np.int64)
    choices = np.empty(len(model.first_var), dtype=np.int64)
    for i, (first, allowed) in enumerate(zip(model.first_var, model.red.allowed)):
        choices[i] = allowed[0] if first < 0 else allowed[int(np.argmax(values[first:first + len(allowed)]))]
    return choices


def timeout_error(problem: IlpProblem, what: str) -> PlanningError:
    return PlanningError(f"CP-SAT found no {what} for {problem.num_nodes} nodes within time_limit_s="
                         f"{problem.time_limit_s:g}s, and could not prove there is none; raise time_limit_s")


def forbidden_error(problem: IlpProblem) -> PlanningError:
    return PlanningError(f"no combination of strategies for the {problem.num_nodes} nodes avoids every forbidden "
                         "choice and pair (infinite costs); the strategy rules are inconsistent")
