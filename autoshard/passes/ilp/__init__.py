"""The intra-op sharding ILP: plain data in (``problem``), HiGHS (``mip``) or CP-SAT (``cpsat``).

``problem`` holds the solver boundary (``IlpProblem`` in, ``IlpSolution`` out, ``evaluate``,
``brute_force``); ``presolve`` the exact reductions; ``mip`` and ``cpsat`` the two backends of one
formulation (written out in ``cpsat``); ``solvers`` the entry points ``solve``, ``min_peak_plan`` and
``min_peak_memory``; ``search`` the deterministic local search that improves the hint.
"""
from autoshard.passes.ilp.solvers import min_peak_memory, min_peak_plan, solve
from autoshard.passes.ilp.problem import Evaluation, IlpProblem, IlpSolution, brute_force, evaluate
from autoshard.passes.ilp.search import local_search

__all__ = ["Evaluation", "IlpProblem", "IlpSolution", "brute_force", "evaluate", "local_search",
           "min_peak_memory", "min_peak_plan", "solve"]
