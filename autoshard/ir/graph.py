"""OpGraph: the flattened, typed view of a traced train step that every pass reads.

A graph is a list of ops in topological order over values. Values are arrays
(shape, dtype, role, and for graph inputs/outputs the pytree path of the leaf).
Nested ``pjit`` / ``closed_call`` / ``custom_jvp_call`` / ``custom_vjp_call`` /
``checkpoint`` bodies are inlined by the tracer; a ``scan``'s, ``while``'s or
``cond``'s bodies are flattened into the graph as a ``LoopRegion`` (a loop's ops
run ``trip_count`` times per step); a ``while`` / ``cond`` the tracer cannot
flatten stays one op and carries its bodies as nested OpGraphs (``Op.bodies``).

Each op keeps its jax primitive and bind parameters, so the graph can be
evaluated again (``evaluate``), which is what the runtime does with sharding
constraints inserted between ops.
"""
from __future__ import annotations

import collections
import functools
import math
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

ValueId: TypeAlias = int
OpId: TypeAlias = int


class Role(str, enum.Enum):
    """What a value is to the train step; decides how memory and baselines treat it."""

    PARAM = "param"
    OPT_STATE = "opt_state"
    BATCH = "batch"
    ACTIVATION = "activation"
    CONSTANT = "constant"


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name; extended dtypes (PRNG keys such as ``key<fry>``) included."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        if dtype.startswith("key"):
            return 8  # a threefry key is two uint32 words
        raise


@dataclass(frozen=True)
class Value:
    id: ValueId
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"
    role: Role
    path: str | None = None  # pytree path for graph inputs/outputs, e.g. "[0]['layers_0']['kernel']"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * dtype_itemsize(self.dtype)

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"v{self.id}:{self.dtype}[{dims}]"


@dataclass(frozen=True, eq=False)
class Op:
    """One jax equation. ``inputs``/``outputs`` are value ids; literals are CONSTANT values."""

    id: OpId
    primitive: str
    params: Mapping[str, Any]
    inputs: tuple[ValueId, ...]
    outputs: tuple[ValueId, ...]
    flops: float
    bytes_accessed: float
    prim: Any = field(repr=False, default=None)  # the jax Primitive, for re-evaluation
    bodies: tuple["OpGraph", ...] = ()  # while/cond bodies (cond: one per branch)
    source: str = ""  # user source line, when jax knows it
    # times the op runs per step: the product of the lengths of the loops around it. ``flops`` and
    # ``bytes_accessed`` count every run; costs computed from value sizes are multiplied by it
    trip_count: int = 1

    def __str__(self) -> str:
        ins = ", ".join(f"v{i}" for i in self.inputs)
        outs = ", ".join(f"v{i}" for i in self.outputs)
        return f"{outs} = {self.primitive}({ins})"


LOOP_PSEUDO_OPS = ("loop_carry", "loop_slice", "loop_stack", "loop_final", "cond_merge")


@dataclass(frozen=True)
class LoopRegion:
    """A scan flattened into the graph: ops ``[start, stop)`` (module docstring of ``ir/trace.py``).

    In order: ``carry_ops`` (``loop_carry``: init -> the carry the body reads; its spec is the carry's
    in every iteration), ``slice_ops`` (``loop_slice``: stacked ``[length, ...]`` -> one slice), the body
    ``[body_start, body_stop)``, ``stack_ops`` (``loop_stack``: a body output -> stacked) and
    ``final_ops`` (``loop_final``: the body's carry out -> the scan's final carry). Op indices.

    A ``while`` is the same without slices and stacks: ``[body_start, cond_stop)`` are its cond_fun's
    ops (their result, the value ``predicate``, decides another iteration), ``[cond_stop, body_stop)``
    its body's; ``length`` is the trip count it is priced at, ``trip_source`` where that came from
    ("derived" from its counter, "bound": the user's ``while_trip_count``, "guess"). A ``cond`` /
    ``switch``: ``index_op`` passes the branch index through, ``carry_ops`` its operands (one layout
    each, read by every branch), ``branches`` the op range of each branch inside the body, and
    ``final_ops`` one ``cond_merge`` per result (input k: branch k's result; one layout for all);
    ``priced_branch`` is the branch whose ops carry its cost (the others have ``trip_count`` 0).
    """

    kind: str  # "scan", "while" or "cond"
    start: int
    stop: int
    body_start: int
    body_stop: int
    carry_ops: tuple[int, ...]
    slice_ops: tuple[int, ...]
    stack_ops: tuple[int, ...]
    final_ops: tuple[int, ...]
    length: int
    reverse: bool = False
    unroll: Any = 1
    source: str = ""
    trip_source: str = "static"  # scan: "static"; while: "derived", "bound" or "guess"; cond: ""
    cond_stop: int = -1  # while: the end of its cond_fun's ops, the start of its body's
    predicate: ValueId = -1  # while: the cond_fun's result
    index_op: int = -1  # cond: the pseudo-op passing the branch index through
    branches: tuple[tuple[int, int], ...] = ()  # cond: the op range [start, stop) of each branch
    priced_branch: int = -1  # cond: the branch its cost is counted as (the costliest)


@dataclass(frozen=True)
class OpGraph:
    values: Mapping[ValueId, Value]
    ops: tuple[Op, ...]
    inputs: tuple[ValueId, ...]  # flattened positional-argument leaves, in order
    outputs: tuple[ValueId, ...]  # flattened output leaves, in order
    constants: Mapping[ValueId, Any]  # literal / closed-over constant values by id
    in_tree: Any = None  # PyTreeDef of the positional args
    out_tree: Any = None  # PyTreeDef of the output
    output_paths: tuple[str, ...] = ()  # pytree path of each output leaf
    carried: tuple[int | None, ...] = ()  # per output leaf: the flat input index it updates (state), or None
    jaxpr: Any = field(default=None, repr=False, compare=False)  # the ClosedJaxpr a step was traced from
    loops: tuple[LoopRegion, ...] = ()  # flattened scans, whiles, conds; a nested one first

    # ---- queries -----------------------------------------------------------
    def value(self, vid: ValueId) -> Value:
        return self.values[vid]

    def producers(self) -> dict[ValueId, Op]:
        return {v: op for op in self.ops for v in op.outputs}

    def producer_nodes(self) -> dict[ValueId, tuple[int, int]]:
        """value id -> (node, output position): input leaves are nodes ``[0, len(inputs))``, ops follow (the
        node numbering of the intra-op problem)."""
        num_inputs = len(self.inputs)
        where: dict[ValueId, tuple[int, int]] = {}
        for i, vid in enumerate(self.inputs):
            where.setdefault(vid, (i, 0))
        for j, op in enumerate(self.ops):
            for k, vid in enumerate(op.outputs):
                where[vid] = (num_inputs + j, k)
        return where

    def consumers(self) -> Mapping[ValueId, Sequence[Op]]:
        """Per value, the ops that read it (in program order); made once per graph (a graph is never changed),
        shared by every pass: read it, do not change it."""
        return self._consumers

    def derived(self, key: str, make: Callable[[], Any]) -> Any:
        """What a plan-independent pass computes from this graph alone (its fusions, liveness, HBM traffic),
        made once by ``make`` and kept under ``key``: every mesh and every solve that plans the graph shares it
        (a graph is never changed). Read it, do not change it."""
        cache = self._derived
        if key not in cache:
            cache[key] = make()
        return cache[key]

    @functools.cached_property
    def _derived(self) -> dict[str, Any]:
        return {}

    @functools.cached_property
    def _consumers(self) -> Mapping[ValueId, Sequence[Op]]:
        users: dict[ValueId, list[Op]] = collections.defaultdict(list)
        for op in self.ops:
            for v in op.inputs:
                users[v].append(op)
        return dict(users)

    def loop_of(self) -> list[int]:
        """Per op, the index in ``loops`` of the innermost loop whose body holds it; -1 outside every loop."""
        inner = [-1] * len(self.ops)
        for k, region in enumerate(self.loops):  # the innermost wins: its body starts later
            for t in range(region.body_start, region.body_stop):
                if inner[t] < 0 or self.loops[inner[t]].body_start <= region.body_start:
                    inner[t] = k
        return inner

    def inputs_with_role(self, *roles: Role) -> list[Value]:
        return [self.values[v] for v in self.inputs if self.values[v].role in roles]

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    def bytes_by_role(self) -> dict[Role, int]:
        out: dict[Role, int] = collections.defaultdict(int)
        for v in dict.fromkeys(self.inputs):
            out[self.values[v].role] += self.values[v].nbytes
        return dict(out)

    def primitive_counts(self) -> dict[str, int]:
        return dict(collections.Counter(op.primitive for op in self.ops).most_common())

    def summary(self) -> str:
        """A short readable report: op counts by primitive, FLOPs, state bytes."""
        by_role = self.bytes_by_role()
        lines = [
            f"OpGraph: {len(self.ops)} ops, {len(self.values)} values, "
            f"{len(self.inputs)} inputs, {len(self.outputs)} outputs",
            f"  total FLOPs:       {self.total_flops:.4g}",
        ]
        for role in (Role.PARAM, Role.OPT_STATE, Role.BATCH):
            count = len(self.inputs_with_role(role))
            lines.append(f"  {role.value + ' bytes:':18} {by_role.get(role, 0):,} ({count} arrays)")
        lines.append("  ops by primitive:")
        for prim, count in self.primitive_counts().items():
            lines.append(f"    {prim:28} {count}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    # ---- evaluation --------------------------------------------------------
    def evaluate(
        self,
        args: Sequence[Any],
        *,
        before_op: Callable[[Op, list[Any]], list[Any]] | None = None,
        after_op: Callable[[Op, list[Any]], list[Any]] | None = None,
        bind_op: Callable[[Op, list[Any]], list[Any] | None] | None = None,
    ) -> list[Any]:
        """Run the graph on flat input leaves (the shape of ``jax.core.eval_jaxpr``).

        ``before_op(op, in_vals)`` / ``after_op(op, out_vals)`` may return replaced
        values; the runtime uses them to insert sharding constraints. ``bind_op(op, in_vals)`` may run an
        op another way (its outputs; None: the op's own primitive).
        """
        if len(args) != len(self.inputs):
            raise ValueError(f"graph takes {len(self.inputs)} flat inputs, got {len(args)}")
        env: dict[ValueId, Any] = dict(self.constants)
        for vid, arg in zip(self.inputs, args):
            env[vid] = arg
        self._run(0, len(self.ops), env, before_op, after_op, bind_op)
        return [env[v] for v in self.outputs]

    def run_ops(self, env: dict[ValueId, Any], ranges: Sequence[tuple[int, int]], *,
                before_op: Callable[[Op, list[Any]], list[Any]] | None = None,
                after_op: Callable[[Op, list[Any]], list[Any]] | None = None,
                bind_op: Callable[[Op, list[Any]], list[Any] | None] | None = None) -> None:
        """Run the ops of each ``[start, stop)`` in ``ranges`` (in order) into ``env`` (value id -> value),
        hooks as in ``evaluate``: part of the graph, when its inputs are in ``env`` (a pipeline stage runs a
        train graph's forward and backward as two programs). A range must not cut a loop region."""
        for start, stop in ranges:
            self._run(start, stop, env, before_op, after_op, bind_op)

    def _run(self, start: int, stop: int, env: dict[ValueId, Any], before_op: Any, after_op: Any,
             bind_op: Any = None) -> None:
        """Run ops ``[start, stop)`` into ``env``; a loop region there runs as one ``lax.scan``."""
        regions = {r.start: r for r in self.loops}
        t = start
        while t < stop:
            region = regions.get(t)
            if region is not None:
                run = {"scan": self._run_scan, "while": self._run_while, "cond": self._run_cond}[region.kind]
                run(region, env, before_op, after_op, bind_op)
                t = region.stop
                continue
            op = self.ops[t]
            in_vals = [env[v] for v in op.inputs]
            if before_op is not None:
                in_vals = before_op(op, in_vals)
            outs = bind_op(op, in_vals) if bind_op is not None else None
            if outs is None:
                outs = op.prim.bind(*in_vals, **op.params)
                outs = list(outs) if op.prim.multiple_results else [outs]
            if after_op is not None:
                outs = after_op(op, outs)
            for vid, val in zip(op.outputs, outs):
                env[vid] = val
            t += 1

    def _run_scan(self, region: LoopRegion, env: dict[ValueId, Any], before_op: Any, after_op: Any,
                  bind_op: Any = None) -> None:
        """Re-emit a flattened scan: ``before_op``/``after_op`` run on the body's ops inside its body, on
        a carry's init and its carry out (both pinned to the carry's layout: ``after_op`` of its
        ``loop_carry``), on a stacked input outside (``before_op`` of its ``loop_slice``) and its slice
        inside (``after_op``), on a stacked output's slice inside and the stack outside."""
        import jax  # the graph module stays importable without a backend

        keep = before_op or (lambda op, vals: vals)
        pin = after_op or (lambda op, vals: vals)
        ops = self.ops

        def through(t: int, value: Any, hook: Any) -> Any:
            return hook(ops[t], [value])[0]

        inits = [through(t, through(t, env[ops[t].inputs[0]], keep), pin) for t in region.carry_ops]
        xs = [through(t, env[ops[t].inputs[0]], keep) for t in region.slice_ops]

        def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            local = dict(env)
            for t, value in zip(region.carry_ops, carry):
                local[ops[t].outputs[0]] = value
            for t, value in zip(region.slice_ops, x):
                local[ops[t].outputs[0]] = through(t, value, pin)
            self._run(region.body_start, region.body_stop, local, before_op, after_op, bind_op)
            new_carry = [through(c, local[ops[f].inputs[0]], pin) for c, f in zip(region.carry_ops, region.final_ops)]
            ys = [through(t, local[ops[t].inputs[0]], keep) for t in region.stack_ops]
            return new_carry, ys

        final, stacked = jax.lax.scan(body, inits, xs, length=region.length, reverse=region.reverse,
                                      unroll=region.unroll)
        for t, value in zip(region.stack_ops, stacked):
            env[ops[t].outputs[0]] = through(t, value, pin)
        for t, value in zip(region.final_ops, final):
            env[ops[t].outputs[0]] = through(t, through(t, value, keep), pin)

    def _run_while(self, region: LoopRegion, env: dict[ValueId, Any], before_op: Any, after_op: Any,
                  bind_op: Any = None) -> None:
        """Re-emit a flattened while loop as ``lax.while_loop``, hooks as in ``_run_scan`` (no slices)."""
        import jax

        keep = before_op or (lambda op, vals: vals)
        pin = after_op or (lambda op, vals: vals)
        ops = self.ops

        def through(t: int, value: Any, hook: Any) -> Any:
            return hook(ops[t], [value])[0]

        def local_env(carry: Sequence[Any]) -> dict[ValueId, Any]:
            local = dict(env)
            for t, value in zip(region.carry_ops, carry):
                local[ops[t].outputs[0]] = value
            return local

        def cond_fun(carry: list[Any]) -> Any:
            local = local_env(carry)
            self._run(region.body_start, region.cond_stop, local, before_op, after_op, bind_op)
            return local[region.predicate]

        def body_fun(carry: list[Any]) -> list[Any]:
            local = local_env(carry)
            self._run(region.cond_stop, region.body_stop, local, before_op, after_op, bind_op)
            return [through(c, local[ops[f].inputs[0]], pin) for c, f in zip(region.carry_ops, region.final_ops)]

        inits = [through(t, through(t, env[ops[t].inputs[0]], keep), pin) for t in region.carry_ops]
        final = jax.lax.while_loop(cond_fun, body_fun, inits)
        for t, value in zip(region.final_ops, final):
            env[ops[t].outputs[0]] = through(t, through(t, value, keep), pin)

    def _run_cond(self, region: LoopRegion, env: dict[ValueId, Any], before_op: Any, after_op: Any,
                  bind_op: Any = None) -> None:
        """Re-emit a flattened cond as ``lax.switch``: each branch runs its ops with the hooks and pins its
        results to their ``cond_merge`` layouts (the reshard chain of its own input position first)."""
        import jax

        keep = before_op or (lambda op, vals: vals)
        pin = after_op or (lambda op, vals: vals)
        ops = self.ops

        def through(t: int, value: Any, hook: Any) -> Any:
            return hook(ops[t], [value])[0]

        def branch_fn(b: int) -> Callable[..., list[Any]]:
            lo, hi = region.branches[b]

            def branch(*operands: Any) -> list[Any]:
                local = dict(env)
                for t, value in zip(region.carry_ops, operands):
                    local[ops[t].outputs[0]] = value
                self._run(lo, hi, local, before_op, after_op, bind_op)
                outs = []
                for m in region.final_ops:  # position b of the merge is this branch's result
                    mine = local[ops[m].inputs[b]]
                    outs.append(pin(ops[m], [keep(ops[m], [mine] * len(ops[m].inputs))[b]])[0])
                return outs
            return branch

        index = through(region.index_op, through(region.index_op, env[ops[region.index_op].inputs[0]], keep), pin)
        operands = [through(t, through(t, env[ops[t].inputs[0]], keep), pin) for t in region.carry_ops]
        results = jax.lax.switch(index, [branch_fn(b) for b in range(len(region.branches))], *operands)
        for m, value in zip(region.final_ops, results):
            env[ops[m].outputs[0]] = value


def same_structure(a: OpGraph, b: OpGraph) -> bool:
    """Whether two traces (of one step at two batch sizes, say) have the same ops on the same value ids."""
    return len(a.ops) == len(b.ops) and all(x.primitive == y.primitive and x.inputs == y.inputs
                                            and x.outputs == y.outputs for x, y in zip(a.ops, b.ops))
