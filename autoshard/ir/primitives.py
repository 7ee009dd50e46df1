"""One table of what every pass needs to know about a jax primitive, keyed by its name.

Each primitive has one ``PrimitiveFacts`` row: its *family* (what it computes: elementwise, contraction,
reduction, shape, indexing, identity, control, random, call), how the memory model treats it (``OpKind``,
XLA:CPU's fusion: ``passes/liveness.py``), its FLOP rule (``ir/flops.py``), what becomes of its operand's
values (``Values``: cast, copied, rearranged...) and a few flags the passes read (expensive to recompute,
an activation nonlinearity, an order comparison, additive). Every other table of primitives derives from
this one (``primitives(pred)``); ``facts(name)`` answers for a primitive absent from the table with
``UNKNOWN``: opaque, one FLOP per output element, a family of its own.

The strategy registry (``passes/strategies``) is built against it: the elementwise family is registered with
the pointwise rule from here, and tests/unit/test_primitive_table.py checks every other rule against its
primitive's row (a rule without a row, or a row whose family contradicts its rule, fails), and that no
module keeps a second list of elementwise, reduction or shape primitives.

Rows are declared by family (``_declare``): a family's usual facts, and each group's departures from them.
Names of several jax versions are listed; a name the installed jax lacks costs nothing.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

__all__ = ["CALLS", "CONTRACTIONS", "ELEMENTWISE", "INLINED_CALLS", "UNKNOWN", "Family", "FlopRule", "OpKind",
           "PrimitiveFacts", "Values", "facts", "primitives", "table"]


class Family(enum.Enum):
    """What a primitive computes; the strategy rules are grouped the same way (``passes/strategies``)."""

    ELEMENTWISE = "elementwise"  # out[i] = f(operands[i]), scalars broadcast: runs shard by shard in any layout
    CONTRACTION = "contraction"  # dot_general, conv_general_dilated: reduces a dim two operands share
    REDUCTION = "reduction"  # reduces or scans along dims: reduce_*, argmax, cumsum, sort, windows
    SHAPE = "shape"  # moves data without arithmetic at static positions: reshape, transpose, slice, pad, ...
    INDEXING = "indexing"  # reads or writes at data-dependent positions: gather, scatter, dynamic slices
    IDENTITY = "identity"  # the operand itself, annotated: barriers, sharding constraints, names
    CONTROL = "control"  # loops and conds, and the pseudo-ops a flattened loop is planned with (ir/trace.py)
    RANDOM = "random"  # keys and random bits
    CALL = "call"  # a pure call: the tracer inlines its body and loses nothing
    AD_CALL = "ad_call"  # a call with a differentiation rule (custom_jvp/vjp, remat): inlined to plan it
    OTHER = "other"  # anything else (collectives, linear algebra, callbacks): opaque to every pass


class OpKind(enum.Enum):
    """How XLA:CPU's fusion treats an op, as the memory model and the HBM traffic read it
    (``passes/liveness.py``, rules 1-2)."""

    ELEMENTWISE = "elementwise"  # fused into its consumers: elementwise math, broadcasts, slices, gathers
    VIEW = "view"  # a bitcast of its operand when it must exist on its own: shares the operand's buffer
    REDUCTION = "reduction"  # absorbs elementwise producers, materialises its result
    OPAQUE = "opaque"  # reads materialised operands, materialises its result


class FlopRule(enum.Enum):
    """How XLA's cost analysis counts an op's FLOPs (``ir/flops.py``)."""

    ZERO = "zero"  # data movement: reshapes, slices, gathers, converts, selects
    PER_OUTPUT = "per_output"  # ``flops_per_element`` per output element
    PER_INPUT = "per_input"  # one per element of its largest operand: reductions, cumulative ops, scatter-add
    DOT = "dot"  # 2 * batch * M * N * K
    CONV = "conv"  # 2 * batch * features * valid taps
    POLYNOMIAL = "polynomial"  # Horner's rule: a multiply and an add per further coefficient
    BODIES = "bodies"  # its control-flow bodies: scan length times, while once, cond the costliest branch


class Values(enum.Enum):
    """What becomes of the (first) operand's values."""

    NEW = "new"  # computed: arithmetic, selection, indexing, reduction
    SAME = "same"  # passed through unchanged, nothing left of it in the compiled program
    COPY = "copy"  # copied unchanged (an XLA copy, or elided)
    BARRIER = "barrier"  # passed through a scheduling barrier XLA does not look through
    CAST = "cast"  # converted to another dtype or precision
    REARRANGED = "rearranged"  # the same elements in another shape or order (bitcast or transpose)
    BROADCAST = "broadcast"  # repeated along new or size-1 dims


@dataclass(frozen=True)
class PrimitiveFacts:
    family: Family
    kind: OpKind  # how the memory model treats it (XLA:CPU fusion)
    flops: FlopRule
    flops_per_element: float = 1.0  # PER_OUTPUT: FLOPs per output element (log2 lowers to log(x) * (1 / ln 2))
    values: Values = Values.NEW
    expensive: bool = False  # XLA's InstructionFusion::IsExpensive: not recomputed in several fusions
    own_layout: bool = False  # its output's layout is a choice of its own, never merged into its operand's class
    activation: bool = False  # a nonlinearity a Megatron column kernel feeds (activations, softmax's max and exp)
    order: str | None = None  # an order comparison: "<", "<=", ">" or ">="
    additive: bool = False  # its output is the sum or difference of its operands (a bias add)

    @property
    def fusible(self) -> bool:
        """An elementwise op: it runs in its operands' layout, so it may follow its producer (one ILP class,
        ``passes/simplify.py``) and needs no explanation when it costs nothing (``compiler/explain.py``)."""
        return self.family is Family.ELEMENTWISE


_DEFAULTS: dict[Family, PrimitiveFacts] = {
    Family.ELEMENTWISE: PrimitiveFacts(Family.ELEMENTWISE, OpKind.ELEMENTWISE, FlopRule.PER_OUTPUT),
    Family.CONTRACTION: PrimitiveFacts(Family.CONTRACTION, OpKind.OPAQUE, FlopRule.DOT, own_layout=True),
    Family.REDUCTION: PrimitiveFacts(Family.REDUCTION, OpKind.REDUCTION, FlopRule.PER_INPUT),
    Family.SHAPE: PrimitiveFacts(Family.SHAPE, OpKind.ELEMENTWISE, FlopRule.ZERO),
    Family.INDEXING: PrimitiveFacts(Family.INDEXING, OpKind.ELEMENTWISE, FlopRule.ZERO, own_layout=True),
    Family.IDENTITY: PrimitiveFacts(Family.IDENTITY, OpKind.VIEW, FlopRule.ZERO, values=Values.SAME),
    Family.CONTROL: PrimitiveFacts(Family.CONTROL, OpKind.OPAQUE, FlopRule.ZERO),
    Family.RANDOM: PrimitiveFacts(Family.RANDOM, OpKind.OPAQUE, FlopRule.PER_OUTPUT, own_layout=True),
    Family.CALL: PrimitiveFacts(Family.CALL, OpKind.OPAQUE, FlopRule.PER_OUTPUT),
    Family.AD_CALL: PrimitiveFacts(Family.AD_CALL, OpKind.OPAQUE, FlopRule.PER_OUTPUT),
    Family.OTHER: PrimitiveFacts(Family.OTHER, OpKind.OPAQUE, FlopRule.PER_OUTPUT),
}
UNKNOWN = _DEFAULTS[Family.OTHER]

_TABLE: dict[str, PrimitiveFacts] = {}


def _declare(family: Family, *names: str, **departures: object) -> None:
    """Rows for ``names``: the family's usual facts with ``departures``."""
    row = replace(_DEFAULTS[family], **departures)
    for name in names:
        if name in _TABLE:
            raise ValueError(f"primitive {name!r} is declared twice")
        _TABLE[name] = row


# --------------------------------------------------------------------------- elementwise
_declare(Family.ELEMENTWISE,
         "abs", "neg", "sign", "floor", "ceil", "round", "is_finite", "not", "population_count", "clz",
         "tan", "atan", "sinh", "real", "imag", "conj", "complex", "mulhi",
         "mul", "nextafter", "eq", "ne", "and", "or", "xor", "shift_left", "shift_right_logical",
         "shift_right_arithmetic", "square", "clamp", "min", "bitcast_convert_type")
_declare(Family.ELEMENTWISE, "add", "add_any", "sub", additive=True)
_declare(Family.ELEMENTWISE, "lt", order="<")
_declare(Family.ELEMENTWISE, "le", order="<=")
_declare(Family.ELEMENTWISE, "gt", order=">")
_declare(Family.ELEMENTWISE, "ge", order=">=")
_declare(Family.ELEMENTWISE, "max", "integer_pow", "sin", "cos", activation=True)
_declare(Family.ELEMENTWISE, "acos", "acosh", "asin", "asinh", "atan2", "atanh", "cosh", "expm1", "exp2", "log1p",
         "rsqrt", "sqrt", "cbrt", "lgamma", "digamma", "div", "rem", "erfc", expensive=True)
_declare(Family.ELEMENTWISE, "exp", "log", "pow", "tanh", "logistic", "erf", "erf_inv", expensive=True,
         activation=True)
# special functions: XLA expands them into chains of exps and logs
_declare(Family.ELEMENTWISE, "bessel_i0e", "bessel_i1e", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
         "regularized_incomplete_beta", expensive=True)
# jax >= 0.11 lowers these to several elementwise HLO ops, each counted by XLA
_declare(Family.ELEMENTWISE, "log2", flops_per_element=2.0, expensive=True, activation=True)  # log(x) * (1 / ln 2)
_declare(Family.ELEMENTWISE, "one_minus_square", flops_per_element=3.0, activation=True)  # (1 + x) * (1 - x)
_declare(Family.ELEMENTWISE, "polynomial", flops=FlopRule.POLYNOMIAL, activation=True)  # jax >= 0.12
_declare(Family.ELEMENTWISE, "select_n", flops=FlopRule.ZERO)
_declare(Family.ELEMENTWISE, "stop_gradient", flops=FlopRule.ZERO, values=Values.SAME)
_declare(Family.ELEMENTWISE, "convert_element_type", flops=FlopRule.ZERO, values=Values.CAST)
_declare(Family.ELEMENTWISE, "reduce_precision", values=Values.CAST)
_declare(Family.ELEMENTWISE, "copy", kind=OpKind.VIEW, flops=FlopRule.ZERO, values=Values.COPY)

# --------------------------------------------------------------------------- contractions
_declare(Family.CONTRACTION, "dot_general")
_declare(Family.CONTRACTION, "conv_general_dilated", flops=FlopRule.CONV)

# --------------------------------------------------------------------------- reductions
_declare(Family.REDUCTION, "reduce_sum", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
         "reduce")
_declare(Family.REDUCTION, "reduce_max", activation=True)
_declare(Family.REDUCTION, "argmin", own_layout=True)
_declare(Family.REDUCTION, "argmax", own_layout=True, activation=True)
_declare(Family.REDUCTION, "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", kind=OpKind.OPAQUE,
         own_layout=True)
_declare(Family.REDUCTION, "sort", "top_k", "approx_top_k", kind=OpKind.OPAQUE, flops=FlopRule.PER_OUTPUT,
         own_layout=True)
_declare(Family.REDUCTION, "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
         "select_and_scatter_add", "select_and_gather_add", "select_and_scatter", kind=OpKind.OPAQUE,
         flops=FlopRule.PER_OUTPUT)

# --------------------------------------------------------------------------- shape
_declare(Family.SHAPE, "slice", "pad", "concatenate", "rev", "split", "tile", "stack", "unstack")
_declare(Family.SHAPE, "reshape", "squeeze", kind=OpKind.VIEW, values=Values.REARRANGED)
_declare(Family.SHAPE, "transpose", values=Values.REARRANGED)
_declare(Family.SHAPE, "broadcast_in_dim", values=Values.BROADCAST)
_declare(Family.SHAPE, "iota", own_layout=True)

# --------------------------------------------------------------------------- indexing
_declare(Family.INDEXING, "gather", expensive=True)
_declare(Family.INDEXING, "dynamic_slice", "dynamic_update_slice")
_declare(Family.INDEXING, "scatter", kind=OpKind.OPAQUE, flops=FlopRule.PER_OUTPUT)
_declare(Family.INDEXING, "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
         kind=OpKind.OPAQUE, flops=FlopRule.PER_INPUT)

# --------------------------------------------------------------------------- identity
_declare(Family.IDENTITY, "name", "sharding_constraint", "reshard", "device_put", "layout_constraint")
_declare(Family.IDENTITY, "optimization_barrier", values=Values.BARRIER)

# --------------------------------------------------------------------------- control flow
_declare(Family.CONTROL, "scan", "while", "cond", flops=FlopRule.BODIES, own_layout=True)
# a flattened loop's pseudo-ops (ir/trace.py): a carry is the buffer of its init, and the slice an iteration
# reads is a window of the stacked buffer, which lives until the body's last reader
# (a carry's layout is its own choice, not its init's: the init reshards once)
_declare(Family.CONTROL, "loop_carry", kind=OpKind.VIEW, values=Values.SAME, own_layout=True)
_declare(Family.CONTROL, "loop_final", kind=OpKind.VIEW, values=Values.SAME)
_declare(Family.CONTROL, "loop_slice", kind=OpKind.VIEW)
_declare(Family.CONTROL, "loop_stack", "cond_merge")

# --------------------------------------------------------------------------- random
_declare(Family.RANDOM, "random_split", "random_fold_in", "random_clone", "random_gamma", "threefry2x32",
         "threefry4x32", "philox2x32", "philox4x32", "iota_2x32_shape", "rng_bit_generator", "rng_uniform")
_declare(Family.RANDOM, "random_seed", "random_bits", "random_wrap", "random_unwrap", flops=FlopRule.ZERO)

# --------------------------------------------------------------------------- other
# host callbacks and uninitialized buffers (empty2: cond's gradient pads its residuals with it), planned replicated;
# the primitives passes/strategies/replicated.py declares replicated have no row: ``facts`` answers UNKNOWN
_declare(Family.OTHER, "pure_callback", "io_callback", "platform_index", "empty", "empty2")

# --------------------------------------------------------------------------- calls
_declare(Family.CALL, "jit", "pjit", "closed_call", "core_call")
_declare(Family.AD_CALL, "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "remat2", "checkpoint",
         "remat")

_FACTS: Mapping[str, PrimitiveFacts] = MappingProxyType(_TABLE)


def table() -> Mapping[str, PrimitiveFacts]:
    """Every declared primitive's row (read-only)."""
    return _FACTS


def facts(name: str) -> PrimitiveFacts:
    """The row of primitive ``name``; ``UNKNOWN`` for one the table does not declare."""
    return _FACTS.get(name, UNKNOWN)


def primitives(pred: Callable[[PrimitiveFacts], bool]) -> frozenset[str]:
    """The declared primitives whose row satisfies ``pred``."""
    return frozenset(name for name, row in _FACTS.items() if pred(row))


ELEMENTWISE = primitives(lambda f: f.family is Family.ELEMENTWISE)
CONTRACTIONS = primitives(lambda f: f.family is Family.CONTRACTION)
CALLS = primitives(lambda f: f.family is Family.CALL)  # pure calls: inlining one loses no custom rule
INLINED_CALLS = primitives(lambda f: f.family in (Family.CALL, Family.AD_CALL))  # what the tracer inlines
