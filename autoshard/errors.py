"""Typed errors; each message says what to change."""
from __future__ import annotations


class PlanningError(Exception):
    """autoshard could not produce a plan; the message says why and what to change."""


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


class PlanMismatchError(PlanningError):
    """A plan does not match the function, arguments or mesh it is applied to."""


class OverBudgetWarning(UserWarning):
    """The chosen plan's modeled peak memory exceeds the memory budget (the message gives both figures)."""


class UnusedDevicesWarning(UserWarning):
    """A mesh covers fewer devices than are present: the step runs on that many only."""


class TripCountGuessWarning(UserWarning):
    """A while loop's trip count could not be derived: it is priced at a guess (the message says how to set it)."""
