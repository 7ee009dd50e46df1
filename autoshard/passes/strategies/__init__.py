"""Per-primitive strategy rules, one module per family, registered into one table.

Importing this package registers every rule: elementwise, dot (dot_general,
conv), reduce (reductions, cumulative ops, sort, top_k, pooling), shape,
indexing (gather/scatter/dynamic slices) and control (control flow, random,
identities); replicated declares the primitives planned replicated on purpose.
"""
from autoshard.passes.strategies import control, dot, elementwise, indexing, reduce, replicated, shape  # noqa: F401
from autoshard.passes.strategies.base import (  # noqa: F401
    LOCALIZERS, REPLICATED, RULES, Factor, Strategy, UnsupportedPrimitiveWarning, elementwise_factors,
    factor_strategies, localize_params, register, register_localizer, replicated_strategy, strategies_for,
)
