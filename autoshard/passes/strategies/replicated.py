"""Primitives of ``jax.lax`` planned replicated on purpose, each family with the reason.

Every primitive that ``jax.lax`` and the ``jax._src.lax`` modules define has
a strategy rule (the other modules here), is inlined by the tracer
(``ir/trace.py``'s ``INLINED``), or is declared here; tests/unit/test_primitives.py
checks that for the jax installed, so a primitive a new jax adds fails that
test until someone classifies it. A declared primitive is planned replicated
(correct, maybe slower) and its one warning quotes the reason. Names of
several jax versions are listed: a name the installed jax lacks costs nothing.
"""
from __future__ import annotations

from autoshard.passes.strategies.base import declare_replicated

# Collectives over named axes only run inside shard_map / pmap bodies, which the user has already sharded
# (the planner keeps a shard_map whole). The *_start / *_done pairs and the cast / vary primitives are their
# asynchronous and type-system companions; several were renamed between jax 0.10 and 0.12.
COLLECTIVES = (
    "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all", "reduce_scatter", "ragged_all_to_all",
    "axis_index", "pbroadcast", "pbroadcast_dynamic", "pvary", "psend", "precv", "preduced",
    "psum_invariant", "all_gather_invariant", "all_gather_reduced", "unreduced_psum", "unreduced_pmax",
    "unreduced_pmin", "unreduced_reduce_scatter", "reduced_vary_cast", "reduced_vary_cast_p",
    "vary_unreduced_cast", "vary_unreduced_cast_p",
    "psum_start", "psum_done", "psum_invariant_start", "all_gather_start", "all_gather_done",
    "all_gather_reduced_start", "all_to_all_start", "all_to_all_done", "ppermute_start", "ppermute_done",
    "reduce_scatter_start", "reduce_scatter_done", "pbroadcast_start", "pbroadcast_done",
    "unreduced_psum_start", "unreduced_reduce_scatter_start",
)
LINEAR_ALGEBRA = (
    "cholesky", "cholesky_update", "eig", "eigh", "geqp3", "geqrf", "hessenberg", "householder_product", "lu",
    "lu_pivots_to_permutation", "ormqr", "qr", "schur", "svd", "symmetric_product", "triangular_solve",
    "tridiagonal", "tridiagonal_solve",
)
SPECIAL_DOTS = ("ragged_dot_general", "scaled_dot")
CALLS_KEPT_WHOLE = ("custom_linear_solve", "composite", "eval_jaxpr", "program_order")  # program_order: jax 0.11
TOKENS_AND_TYPES = ("after_all", "create_token", "dce_sink", "tie", "stage", "from_edtype", "to_edtype",
                    "eq_to", "le_to", "lt_to")

declare_replicated("a collective over named axes: it belongs inside shard_map or pmap, whose body the user "
                   "has sharded already", *COLLECTIVES)
declare_replicated("a factorization or solve reads whole matrices; no rule splits its batch dims yet",
                   *LINEAR_ALGEBRA)
declare_replicated("an FFT mixes the dims it transforms; no rule splits its other dims yet", "fft")
declare_replicated("a ragged or scaled dot (grouped / low-precision matmul) has no factor rule yet", *SPECIAL_DOTS)
declare_replicated("a call whose body autoshard keeps whole (not inlined)", *CALLS_KEPT_WHOLE)
declare_replicated("an effect token, an ordering tie, an extended-dtype cast or a dynamic-shape comparison: "
                   "nothing worth splitting", *TOKENS_AND_TYPES)
