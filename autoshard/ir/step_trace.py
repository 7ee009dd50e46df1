"""A marked train step traced once at its full batch and, once per microbatch count, at one microbatch.

A pipeline needs the step at two kinds of shapes: the full batch (the plan's signature, the SPMD plan it
is compared with, each layer's cost at one microbatch of the whole batch) and one microbatch (each layer's
cost at a smaller microbatch, and the programs the runtime runs). :class:`TracedStep` holds the first
trace and makes each microbatch trace at most once (``at_microbatches``), so the planner's pricing trace
is the runtime's when they share a microbatch count, and nothing traces the step again.

The first microbatch count is traced; any other is extrapolated from the two jaxprs (``ir/rescale.py``: the
numbers that differ between them are the batch's), so a pipeline whose stage DP chooses a third microbatch
count still traces the step twice. It is traced only where the extrapolation cannot explain the two jaxprs.

A microbatch trace is only a jaxpr taken apart (``ir/split.py``): no OpGraph is built from it, so it
needs no trip-count option and warns of nothing the full trace has not said.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from autoshard.ir.graph import OpGraph
from autoshard.ir.rescale import extrapolate
from autoshard.ir.split import StepParts, batch_inputs, microbatch_shapes, split_step
from autoshard.errors import MicrobatchTraceError
from autoshard.ir.trace import TracingError, step_jaxpr


def _atoms(atoms: Sequence[Any]) -> tuple[Any, ...]:
    return tuple("literal" if isinstance(a, jcore.Literal) else a for a in atoms)


def _primitives(jaxpr: Any) -> tuple[str, ...]:
    return () if jaxpr is None else tuple(e.primitive.name for e in jaxpr.eqns)


def same_step(a: StepParts, b: StepParts) -> bool:
    """Whether two splits of one step (at two batch sizes, say) have the same equations on the same variables:
    the forward equation by equation, the update's and the prologue's primitives."""
    fa, fb = a.forward, b.forward
    return (len(fa.eqns) == len(fb.eqns) and fa.invars == fb.invars and fa.diff == fb.diff and fa.free == fb.free
            and all(x.eqn.primitive == y.eqn.primitive and x.outs == y.outs and _atoms(x.ins) == _atoms(y.ins)
                    for x, y in zip(fa.eqns, fb.eqns))
            and (a.num_consts, a.num_inputs, a.grad_for_leaf, a.num_aux) == (b.num_consts, b.num_inputs,
                                                                             b.grad_for_leaf, b.num_aux)
            and _primitives(a.update) == _primitives(b.update) and _primitives(a.prologue) == _primitives(b.prologue))


@dataclass(frozen=True, eq=False)
class TracedStep:
    """A marked step traced at its full batch and split, with its microbatch traces made on demand."""

    fn: Callable[..., Any]
    arg_leaves: tuple[jax.ShapeDtypeStruct, ...]  # the flat step inputs at the full batch
    graph: OpGraph  # the step at the full batch
    parts: StepParts  # split from it
    global_batch: int
    split_inputs: tuple[bool, ...]  # per flat step input: a batch leaf, cut into microbatches
    # microbatch count -> the step traced at batch / count and split (None: it traces to other equations)
    microbatch_traces: dict[int, StepParts | None] = field(default_factory=dict, repr=False)
    # the first microbatch count traced and its jaxpr: the other counts are extrapolated from it
    traced_microbatch: list[tuple[int, jcore.ClosedJaxpr]] = field(default_factory=list, repr=False)
    extrapolated: set[int] = field(default_factory=set, repr=False)  # the counts made without a trace

    @classmethod
    def of(cls, fn: Callable[..., Any], args: Sequence[Any], graph: OpGraph, parts: StepParts) -> TracedStep:
        """The traced step of ``fn`` at ``args`` (arrays or ShapeDtypeStructs) from its full-batch trace ``graph``
        and split ``parts``."""
        leaves = tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                       for x in jax.tree_util.tree_leaves(tuple(args)))
        global_batch, split = batch_inputs(parts)
        return cls(fn, leaves, graph, parts, global_batch, tuple(split))

    @property
    def in_tree(self) -> Any:
        return self.graph.in_tree

    @property
    def args(self) -> tuple[Any, ...]:
        """The step's arguments at the full batch, as ShapeDtypeStructs."""
        return tuple(jax.tree_util.tree_unflatten(self.in_tree, list(self.arg_leaves)))

    def replay(self, *args: Any) -> Any:
        """The step's result at its full-batch shapes, from its trace (``jaxpr_as_fun``), not its Python: a
        rewrite that runs the step again (a scanned stack's per-iteration view) traces no third time."""
        closed = self.graph.jaxpr
        if closed is None:
            return self.fn(*args)
        outs = jcore.jaxpr_as_fun(closed)(*jax.tree_util.tree_leaves(tuple(args)))
        return jax.tree_util.tree_unflatten(self.graph.out_tree, list(outs))

    def microbatch_args(self, count: int) -> tuple[Any, ...]:
        """The step's arguments (ShapeDtypeStructs) with every batch leaf cut to batch / ``count``."""
        leaves = microbatch_shapes(self.arg_leaves, self.split_inputs, count)
        return tuple(jax.tree_util.tree_unflatten(self.in_tree, leaves))

    def at_microbatches(self, count: int) -> StepParts | None:
        """The step at batch / ``count`` and split, or None when it traces to other equations there (loss code
        whose equations depend on the batch size): the first count traced, the others extrapolated from it and
        the full batch where they can be (module docstring); once per count."""
        if count == 1:
            return self.parts
        if count not in self.microbatch_traces:
            closed = self._extrapolated(count)
            if closed is None:
                try:
                    closed, _ = step_jaxpr(self.fn, *self.microbatch_args(count))
                except TracingError as err:
                    raise self._cut_error(count, err) from err
                if not self.traced_microbatch:
                    self.traced_microbatch.append((count, closed))
            small = split_step(closed)
            self.microbatch_traces[count] = small if small is not None and same_step(self.parts, small) else None
        return self.microbatch_traces[count]

    def _cut_error(self, count: int, err: TracingError) -> MicrobatchTraceError:
        """The step does not trace with its batch leaves cut: say which leaves were taken for the batch."""
        paths = [self.graph.values[v].path for v, cut in zip(self.graph.inputs, self.split_inputs) if cut]
        return MicrobatchTraceError(
            f"the step does not trace at a microbatch (batch {self.global_batch} / {count}) with the inputs "
            f"{', '.join(paths[:6])}{' ...' if len(paths) > 6 else ''} cut along their leading dimension, the "
            f"batch's (the leading size {self.global_batch} of most of the loss's data arguments): {err}\nIf one "
            f"of them is not batch data (a per-channel statistic of size {self.global_batch}, say), give the batch "
            "another size, or plan with num_stages=1 (no microbatches).")

    def _extrapolated(self, count: int) -> jcore.ClosedJaxpr | None:
        """The step's jaxpr at batch / ``count`` from its full-batch trace and its first microbatch trace (None:
        no microbatch traced yet, that one traced to other equations, or the two do not explain a third)."""
        if not self.traced_microbatch or self.graph.jaxpr is None:
            return None
        ratio, small = self.traced_microbatch[0]
        if self.microbatch_traces.get(ratio) is None:
            return None
        closed = extrapolate(self.graph.jaxpr, small, ratio, count)
        if closed is not None:
            self.extrapolated.add(count)
        return closed
