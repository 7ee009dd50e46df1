"""Layouts in the one shape the runtime reads: ``Annotations`` (a whole step's) and ``TrainPins`` (one layer
class's train-graph plan on a pipeline stage's mesh).

``passes/emit.py`` builds Annotations from the solver's result; the runtime builds them from a Plan
(``runtime/applied.py``) and is the only place that turns them into ``jax.sharding`` objects. Plain data:
specs by flat input and output index and by op index.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.ir.spec import Spec


@dataclass(frozen=True)
class Annotations:
    input_specs: tuple[Spec, ...]
    output_specs: tuple[Spec, ...]
    op_out_specs: Mapping[int, tuple[Spec, ...]]  # op index -> spec of each output
    # op index -> {input position: layouts to pin in order, the last being the spec the op reads}
    op_in_reshards: Mapping[int, Mapping[int, tuple[Spec, ...]]]
    # flat output index -> layouts to pin before returning (state written back to its storage layout)
    output_reshards: Mapping[int, tuple[Spec, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainPins:
    """One layer class's train-graph plan on a stage's logical mesh: the annotations of every op of its train
    graph (``ir/train_graph.py``), which a pipeline stage runs pinned op by op (``runtime/stage_train.py``)."""

    key: str  # the layer structure hash (``Layer.structure``)
    num_ops: int  # ops of the graph it was planned on (a runtime graph with another count is not pinned)
    annotations: Annotations
