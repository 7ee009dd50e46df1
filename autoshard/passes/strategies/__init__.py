"""Per-primitive strategy rules, one module per family, registered into one table.

Importing this package registers every rule.
"""
from autoshard.passes.strategies.base import (  # noqa: F401
    RULES, Factor, Strategy, UnsupportedPrimitiveWarning, elementwise_factors, factor_strategies,
    register, replicated_strategy, strategies_for,
)
