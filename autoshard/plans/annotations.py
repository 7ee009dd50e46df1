"""Layouts in the one shape the runtime reads: ``Annotations`` (a whole step's) and ``TrainPins`` (one layer
class's train-graph plan on a pipeline stage's mesh).

``passes/emit.py`` builds Annotations from the solver's result; the runtime builds them from a Plan
(``runtime/applied.py``) and is the only place that turns them into ``jax.sharding`` objects. Plain data:
specs by flat input and output index and by op index.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.ir.primitives import Values, primitives
from autoshard.ir.spec import Spec

# what a deferred reduction may be made of (``Deferral``): the reducing op, linear in the operand a split
# contracting dim reads, and the views (the rearranging family) carrying its partial sums to the stack
PARTIAL_OPS = frozenset({"dot_general", "reduce_sum"})
PARTIAL_VIEWS = primitives(lambda f: f.values is Values.REARRANGED)


@dataclass(frozen=True)
class Deferral:
    """A reducing op whose partial sums wait for the end of its scan (``passes/deferral.py``): the split
    contracting dims, as (operand dim, the other operand's dim or -1, mesh axes), become leading partial dims
    of its result; the views ``chain`` carry them to the stacked output ``stack`` (op indices), which is
    summed over them after the loop."""

    reduced: tuple[tuple[int, int, tuple[str, ...]], ...]
    chain: tuple[int, ...]
    stack: int
    operands: tuple[Spec, ...] = ()  # the layouts the op reads its operands in

    def partial(self, spec: Spec) -> Spec:
        """The layout of a partial result whose sum has layout ``spec``: one leading dim per split contracting
        dim, split over its axes, then ``spec`` without those axes."""
        return partial_spec(spec, self.reduced)


def partial_spec(spec: Spec, reduced: tuple[tuple[int, int, tuple[str, ...]], ...]) -> Spec:
    """``Deferral.partial`` for the split contracting dims ``reduced`` of a strategy."""
    axes = {a for *_, group in reduced for a in group}
    rest = tuple(tuple(a for a in d if a not in axes) for d in spec.dims)
    return Spec(tuple(group for *_, group in reduced) + rest)


@dataclass(frozen=True)
class Annotations:
    input_specs: tuple[Spec, ...]
    output_specs: tuple[Spec, ...]
    op_out_specs: Mapping[int, tuple[Spec, ...]]  # op index -> spec of each output
    # op index -> {input position: layouts to pin in order, the last being the spec the op reads}
    op_in_reshards: Mapping[int, Mapping[int, tuple[Spec, ...]]]
    # flat output index -> layouts to pin before returning (state written back to its storage layout)
    output_reshards: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)
    # op index -> its partial sums reduced after its loop (``Deferral``)
    deferred: Mapping[int, Deferral] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainPins:
    """One layer class's train-graph plan on a stage's logical mesh: the annotations of every op of its train
    graph (``ir/train_graph.py``), which a pipeline stage runs pinned op by op (``runtime/stage_train.py``)."""

    key: str  # the layer structure hash (``Layer.structure``)
    num_ops: int  # ops of the graph it was planned on (a runtime graph with another count is not pinned)
    annotations: Annotations
