"""Typed errors; each message says what to change."""
from __future__ import annotations


class PlanningError(Exception):
    """autoshard could not produce a plan; the message says why and what to change."""


class InfeasibleMemoryError(PlanningError):
    """No plan fits the memory budget; carries the smallest budget that would fit."""

    def __init__(self, message: str, smallest_budget_bytes: float | None = None) -> None:
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes


class PlanMismatchError(PlanningError):
    """A plan does not match the function, arguments or mesh it is applied to."""
