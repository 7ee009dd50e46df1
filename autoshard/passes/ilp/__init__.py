"""The intra-op sharding ILP: plain data in (``problem``), CP-SAT (``cpsat``), local search (``search``).

``problem`` holds the solver boundary (``IlpProblem`` in, ``IlpSolution`` out, ``evaluate``,
``brute_force``); ``presolve`` the exact reductions; ``cpsat`` the formulation and the entry points
``solve`` and ``min_peak_memory``; ``search`` the deterministic local search that improves the hint.
"""
from autoshard.passes.ilp.cpsat import min_peak_memory, min_peak_plan, solve
from autoshard.passes.ilp.problem import Evaluation, IlpProblem, IlpSolution, brute_force, evaluate
from autoshard.passes.ilp.search import local_search

__all__ = ["Evaluation", "IlpProblem", "IlpSolution", "brute_force", "evaluate", "local_search",
           "min_peak_memory", "min_peak_plan", "solve"]
