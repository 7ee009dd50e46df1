"""Typed errors; each message says what to change."""
from __future__ import annotations

import re


class PlanningError(Exception):
    """autoshard could not produce a plan; the message says why and what to change."""


class ArgumentError(PlanningError, ValueError):
    """An argument of ``autoshard.autoshard`` / ``autoshard.plan`` or a command's flag is wrong; raised before
    any tracing or planning, naming the argument as the caller wrote it and what to give instead."""


class InfeasibleMemoryError(PlanningError):
    """No plan fits the memory budget; carries the smallest budget that would fit.

    ``budget_bytes`` is the budget that was asked for and ``liveness_point`` the
    point where the smallest plan peaks, when the raiser knows them.
    """

    def __init__(
        self,
        message: str,
        smallest_budget_bytes: float | None = None,
        *,
        budget_bytes: float | None = None,
        liveness_point: int | None = None,
    ) -> None:
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes
        self.budget_bytes = budget_bytes
        self.liveness_point = liveness_point

    def naming(self, budget_name: str) -> str:
        """The message with the budget named as the caller typed it: the API's ``memory_budget`` becomes,
        for one, the command line's ``--memory-budget``."""
        return re.sub(r"\bmemory_budget\b", budget_name, str(self))


class SolverTimeoutError(PlanningError):
    """The solver reached its time limit without any plan (with a memory budget, no plan it found fits);
    the message names ``time_limit_s`` to raise. The memory budget search reads it as "no plan at this
    budget", as it reads an infeasible one."""


class CutOffError(PlanningError):
    """The solve proved that no plan costs less than the cutoff it was given (``IlpProblem.cutoff_s``: the
    best plan found elsewhere, which this one could only match); ``bound_s`` is the bound that proved it. A
    search that compares candidates reads it as "this one cannot win" and goes on without it."""

    def __init__(self, message: str, bound_s: float) -> None:
        super().__init__(message)
        self.bound_s = bound_s


class PipelineError(PlanningError):
    """The step cannot run as a pipeline; the message says why and what to change."""


class MicrobatchTraceError(PipelineError):
    """The step does not trace at a microbatch with the leaves taken for its batch cut (the message names them):
    it cannot run as a pipeline; a searched stage count plans it as one SPMD stage."""


class PlanMismatchError(PlanningError):
    """A plan does not match the function, arguments or mesh it is applied to."""


class OverBudgetWarning(UserWarning):
    """The chosen plan's modeled peak memory exceeds the memory budget (the message gives both figures)."""


class UnusedDevicesWarning(UserWarning):
    """A mesh covers fewer devices than are present: the step runs on that many only."""


class TripCountGuessWarning(UserWarning):
    """A while loop's trip count could not be derived: it is priced at a guess (the message says how to set it)."""


class ReplanWarning(UserWarning):
    """A decorated step was called with arguments of new shapes: it is planned and compiled again for them (the
    message names the arguments that changed)."""


class MicrobatchRandomnessWarning(UserWarning):
    """A pipeline runs the step a microbatch at a time and its loss draws random bits over the batch (a dropout
    mask) that a microbatch cannot draw its slice of (``runtime/microbatch_bits.py``: another key type than
    threefry, ``jax_threefry_partitionable`` off, or a shape the microbatches do not cut along one axis): each
    microbatch draws its own, not its slice of the bits one device draws for the whole batch."""


class MicrobatchCouplingWarning(UserWarning):
    """A pipeline runs the step a microbatch at a time and its loss couples the examples of its batch (a batch
    statistic used per example, such as ``nn.BatchNorm``'s mean and variance in training,
    ``ir/batch_coupling.py``): each microbatch computes its own statistic, so the step is not one device's."""


class ObjectiveMismatchWarning(UserWarning):
    """A plan's cost recomputed on the whole graph differs from the ILP's objective or the ledger: a bug in
    the planner (the message gives the three figures). The test suite turns it into an error."""
