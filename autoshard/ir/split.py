"""Split a marked train step at its markers: the loss forward (flat) and the optimizer update.

A step that uses ``autoshard.value_and_grad`` / ``autoshard.grad`` traces to
a jaxpr with one equation named ``autoshard_value_and_grad...`` (see
``ir/markers.py``): its operands are the loss arguments, its results
``(loss, *grad leaves)``. :func:`split_step` turns that into

- the **forward**: the differentiation jaxpr cut down (DCE) to the loss
  output, which leaves the primal computation, with nested ``jit`` bodies
  inlined into one flat list of equations over integer variables;
- the **update**: every other equation of the step (the optimizer), as a
  jaxpr whose inputs are the step's constants and arguments plus the loss and
  gradients, and whose outputs are the step's outputs.

Equations that do not depend on a differentiated argument (positions, masks,
the shifted targets: functions of the batch alone) are marked *free*
(``Forward.free``). :func:`batch_inputs` and :func:`microbatch_shapes` say
which step inputs are batch data and what they look like cut into
microbatches.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from autoshard.errors import PlanningError
from autoshard.ir.flops import op_flops
from autoshard.ir.markers import LAYER_SCOPE, VG_NAME
from autoshard.ir.primitives import CALLS  # inlined: pure calls, no custom rules lost
from autoshard.ir.trace import control_flow_bodies, trace_jaxpr

log = logging.getLogger(__name__)

VarId: TypeAlias = int
Atom: TypeAlias = "VarId | jcore.Literal"
EqnHook: TypeAlias = Callable[[int, list[Any]], list[Any]]  # (equation index, its values) -> values


def bind_eqn(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """A jaxpr equation's primitive bound on ``values`` in the equation's context: its outputs, as a list."""
    prim = eqn.primitive
    with eqn.ctx.manager:
        out = prim.bind(*values, **prim.get_bind_params(eqn.params))
    return list(out) if prim.multiple_results else [out]


@dataclass(frozen=True, eq=False)
class FlatEqn:
    """One forward equation over integer variables (``ins`` may hold literals)."""

    eqn: Any  # the jax JaxprEqn: primitive, params
    ins: tuple[Any, ...]
    outs: tuple[VarId, ...]
    flops: float
    nbytes: float  # bytes read and written (operands + results), for the roofline
    marker: bool  # a layer_boundary copy

    def bind(self, values: Sequence[Any]) -> list[Any]:
        return bind_eqn(self.eqn, values)


@dataclass(frozen=True, eq=False)
class Forward:
    """The loss forward, flat. ``invars[i]`` is flat loss-argument leaf i."""

    eqns: tuple[FlatEqn, ...]
    invars: tuple[VarId, ...]
    outvar: Any  # VarId or Literal: the loss
    avals: Mapping[VarId, Any]
    consts: Mapping[VarId, Any]
    diff: tuple[bool, ...]  # per invar: differentiated (a parameter leaf)
    free: tuple[bool, ...]  # per eqn: depends on no differentiated input
    aux: tuple[Any, ...] = ()  # VarIds or Literals: the flat auxiliary outputs (has_aux=True)

    def nbytes(self, var: VarId) -> int:
        aval = self.avals[var]
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize

    def run(self, eqn_indices: Iterable[int], env: dict[VarId, Any], before: EqnHook | None = None,
            after: EqnHook | None = None) -> dict[VarId, Any]:
        """Evaluate the given equations in order on ``env`` (var -> value), in place. ``before(i, inputs)`` and
        ``after(i, outputs)`` may return replaced values (the pipeline runtime pins layouts with them, as
        ``OpGraph.evaluate``'s hooks do for the SPMD runtime)."""
        for i in eqn_indices:
            e = self.eqns[i]
            vals = [a.val if isinstance(a, jcore.Literal) else env[a] for a in e.ins]
            if before is not None:
                vals = before(i, vals)
            outs = e.bind(vals)
            if after is not None:
                outs = after(i, outs)
            for var, val in zip(e.outs, outs):
                env[var] = val
        return env


@dataclass(frozen=True, eq=False)
class StepParts:
    """A marked train step taken apart (see the module docstring)."""

    closed: Any  # ClosedJaxpr of the whole step
    argnums: tuple[int, ...]
    arg_leaf_counts: tuple[int, ...]  # flat leaves per operand group: (closed over, *positional args, keywords)
    forward: Forward
    operand_inputs: tuple[int | None, ...]  # per loss-argument leaf: the step's flat input index (None: constant)
    operand_consts: tuple[Any, ...]  # per loss-argument leaf: its value when it is a constant
    update: Any  # Jaxpr: invars = [*step consts, *step inputs, loss, *grads, *aux]; outvars = step outputs
    num_consts: int
    num_inputs: int
    grad_for_leaf: tuple[int, ...]  # grad g -> its loss-argument leaf index
    num_aux: int = 0  # flat leaves of the loss's auxiliary output (has_aux=True)
    computed_leaves: tuple[int, ...] = ()  # loss-argument leaves the step computes before the loss
    prologue: Any = None  # Jaxpr: [*step consts, *step inputs] -> the computed leaves (None when there are none)

    @property
    def num_grads(self) -> int:
        return len(self.grad_for_leaf)


@dataclass(frozen=True)
class _VgCall:
    """What the marker's jit name says about the call (``ir/markers.vg_name``)."""

    argnums: tuple[int, ...]
    aux: bool
    leaf_counts: tuple[int, ...] | None  # flat leaves per positional argument; None: an old-style name
    kwarg_leaves: int


def _vg_call(name: str) -> _VgCall | None:
    if not name.startswith(VG_NAME):
        return None
    parts = [p for p in name[len(VG_NAME):].split(".") if p]
    counts = next((tuple(int(c) for c in p[1:].split("_") if c) for p in parts if p.startswith("L")), None)
    kwargs = next((int(p[1:]) for p in parts if p.startswith("K") and p[1:].isdigit()), 0)
    return _VgCall(tuple(int(p) for p in parts if p.isdigit()), "aux" in parts, counts, kwargs)


def split_step(closed: Any, in_tree: Any = None) -> StepParts | None:
    """Take a traced step apart at its ``autoshard.value_and_grad``; None when it has no marker."""
    jaxpr = closed.jaxpr
    found = [(k, e) for k, e in enumerate(jaxpr.eqns)
             if e.primitive.name in CALLS and _vg_call(str(e.params.get("name", ""))) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise PlanningError(f"the step calls autoshard.value_and_grad/grad {len(found)} times; a pipeline needs "
                            "exactly one loss: compute one total loss, or use num_stages=1")
    k, eqn = found[0]
    call = _vg_call(str(eqn.params["name"]))
    inner = eqn.params["jaxpr"]
    leaf_counts, diff = _operand_layout(inner, eqn, call)
    step_in = {v: i for i, v in enumerate(jaxpr.invars)}
    const_vals = dict(zip(jaxpr.constvars, closed.consts))
    operand_inputs, operand_consts, computed = [], [], []
    for pos, a in enumerate(eqn.invars):
        if isinstance(a, jcore.Literal):
            operand_inputs.append(None)
            operand_consts.append(a.val)
        elif a in step_in:
            operand_inputs.append(step_in[a])
            operand_consts.append(None)
        elif a in const_vals:
            operand_inputs.append(None)
            operand_consts.append(const_vals[a])
        else:  # computed by the step before the loss (a closed-over model built from the state, a cast batch)
            operand_inputs.append(None)
            operand_consts.append(None)
            computed.append(pos)
    num_grads = len(grad_for_leaf := tuple(i for i, d in enumerate(diff) if d))
    num_aux = len(eqn.outvars) - 1 - num_grads
    if num_aux < 0 or (num_aux and not call.aux):
        raise PlanningError(f"autoshard.value_and_grad gave {len(eqn.outvars) - 1} gradients for {num_grads} "
                            "differentiated leaves")
    forward = _flatten_forward(inner, diff, 1 + num_aux)
    rest = [e for j, e in enumerate(jaxpr.eqns) if j != k]
    info = jaxpr.debug_info._replace(arg_names=None, result_paths=None) if jaxpr.debug_info else None
    loss_out, aux_outs, grad_outs = eqn.outvars[0], eqn.outvars[1:1 + num_aux], eqn.outvars[1 + num_aux:]
    step_vars = [*jaxpr.constvars, *jaxpr.invars]
    rest = _live(rest, list(jaxpr.outvars))
    update = jcore.Jaxpr([], [*step_vars, loss_out, *grad_outs, *aux_outs], list(jaxpr.outvars), rest,
                         jaxpr.effects, info)
    prologue = None
    if computed:
        before = _live(jaxpr.eqns[:k], [eqn.invars[pos] for pos in computed])
        prologue = jcore.Jaxpr([], step_vars, [eqn.invars[pos] for pos in computed], before, jaxpr.effects, info)
    return StepParts(closed, call.argnums, leaf_counts, forward, tuple(operand_inputs), tuple(operand_consts),
                     update, len(jaxpr.constvars), len(jaxpr.invars), grad_for_leaf, num_aux, tuple(computed),
                     prologue)


def _live(eqns: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """The equations (in order) that the given atoms depend on, and every effectful one."""
    need = {a for a in outs if not isinstance(a, jcore.Literal)}
    kept = []
    for e in reversed(eqns):
        if e.effects or any(v in need for v in e.outvars):
            kept.append(e)
            need.update(a for a in e.invars if not isinstance(a, jcore.Literal))
    return kept[::-1]


def _operand_layout(inner: Any, eqn: Any, call: _VgCall) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(leaves per loss-argument group, per operand leaf: differentiated).

    The marker's operands are, in order: the leaves the loss closes over (hoisted by jit), the leaves of
    each positional argument, those of the keyword arguments. The closed-over and keyword leaves form
    their own groups (never differentiated), the first and the last.
    """
    counts = call.leaf_counts if call.leaf_counts is not None else _leaf_counts(inner, eqn, call.argnums)
    if call.argnums and max(call.argnums) >= len(counts):
        raise PlanningError(f"autoshard.value_and_grad(argnums={call.argnums}) was called with only "
                            f"{len(counts)} positional arguments")
    surplus = len(eqn.invars) - sum(counts) - call.kwarg_leaves
    if surplus < 0:
        raise PlanningError(f"autoshard.value_and_grad's traced call has {len(eqn.invars)} operands for "
                            f"{sum(counts) + call.kwarg_leaves} argument leaves")
    diff = [False] * surplus + list(_diff_mask(counts, call.argnums)) + [False] * call.kwarg_leaves
    return (surplus, *counts, call.kwarg_leaves), tuple(diff)


def _leaf_counts(inner: Any, eqn: Any, argnums: tuple[int, ...]) -> tuple[int, ...]:
    """Flat leaves per loss argument, from the jit's input pytree when jax kept it (names without ``L``)."""
    info = getattr(inner.jaxpr, "debug_info", None)
    names = getattr(info, "arg_names", None)
    if names and len(names) == len(eqn.invars):
        # arg names look like "a", "a['blocks'][0]...", "args[1]['tokens']": group by the leading argument
        groups: list[str] = []
        counts: list[int] = []
        for n in names:
            head = _arg_head(str(n))
            if groups and groups[-1] == head:
                counts[-1] += 1
            else:
                groups.append(head)
                counts.append(1)
        if len(counts) > max(argnums):
            return tuple(counts)
    num_grads = len(eqn.outvars) - 1
    if argnums == (0,):  # the gradient leaves are the first argument's
        return (num_grads, len(eqn.invars) - num_grads)
    raise PlanningError("could not tell the loss arguments apart in the traced step; pass them positionally to "
                        "the function returned by autoshard.value_and_grad")


def _arg_head(name: str) -> str:
    if name.startswith("args["):
        return name[: name.index("]") + 1]
    for sep in ("[", "."):
        if sep in name:
            name = name[: name.index(sep)]
    return name


def _diff_mask(leaf_counts: Sequence[int], argnums: Sequence[int]) -> tuple[bool, ...]:
    return tuple(b for arg, n in enumerate(leaf_counts) for b in [arg in argnums] * n)


# ---------------------------------------------------------------------------
# The flat forward


def _eqn_flops(eqn: Any) -> float:
    ins = [tuple(getattr(getattr(v, "aval", None), "shape", ())) for v in eqn.invars]
    outs = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
    bodies = [trace_jaxpr(b).total_flops for b in control_flow_bodies(eqn)]
    return op_flops(eqn.primitive.name, eqn.params, ins, outs, bodies)


def _aval_bytes(aval: Any) -> int:
    if aval is None or not hasattr(aval, "shape"):
        return 0
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return 0


def _flatten_forward(inner: Any, diff: tuple[bool, ...], num_values: int = 1) -> Forward:
    """The primal part of the differentiation jaxpr: its first ``num_values`` outputs (loss, *aux)."""
    jaxpr, consts = inner.jaxpr, inner.consts
    keep = [True] * num_values + [False] * (len(jaxpr.outvars) - num_values)
    dced, _used = pe.dce_jaxpr(jaxpr, keep, instantiate=True)
    # dce_jaxpr drops unused inputs; map the kept ones back to the loss-argument leaves
    kept = [v for v, u in zip(jaxpr.invars, _used) if u]
    avals: dict[VarId, Any] = {}
    const_env: dict[VarId, Any] = {}
    eqns: list[FlatEqn] = []

    def new(aval: Any) -> VarId:
        var = len(avals)
        avals[var] = aval
        return var

    invars = tuple(new(v.aval) for v in jaxpr.invars)
    position = {v: invars[i] for i, v in enumerate(jaxpr.invars)}
    env: dict[Any, Any] = {v: position[v] for v in kept}

    def walk(jx: Any, jconsts: Sequence[Any], ins: Sequence[Any], scoped_marker: bool) -> list[Any]:
        local: dict[Any, Any] = {}
        for var, val in zip(jx.constvars, jconsts):
            cid = new(var.aval)
            const_env[cid] = val
            local[var] = cid
        for var, atom in zip(jx.invars, ins):
            local[var] = atom

        def read(a: Any) -> Any:
            return a if isinstance(a, jcore.Literal) else local[a]

        for e in jx.eqns:
            args = [read(a) for a in e.invars]
            body = e.params.get("jaxpr") if e.primitive.name in CALLS else None
            if body is not None:
                inner_j, inner_c = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, ())
                for var, atom in zip(e.outvars, walk(inner_j, inner_c, args, scoped_marker)):
                    local[var] = atom
                continue
            outs = tuple(new(v.aval) for v in e.outvars)
            for var, vid in zip(e.outvars, outs):
                local[var] = vid
            marker = e.primitive.name == "copy" and any(
                getattr(s, "name", None) == LAYER_SCOPE for s in e.source_info.name_stack.stack)
            nbytes = float(sum(_aval_bytes(getattr(v, "aval", None)) for v in (*e.invars, *e.outvars)))
            eqns.append(FlatEqn(e, tuple(args), outs, _eqn_flops(e), nbytes, marker))
        return [read(a) for a in jx.outvars]

    out, *aux = walk(dced, consts, [env[v] for v in dced.invars], False)
    free = free_mask(eqns, {v for v, d in zip(invars, diff) if d})
    return Forward(tuple(eqns), invars, out, avals, const_env, diff, free, tuple(aux))


def free_mask(eqns: Sequence[FlatEqn], diff_vars: set[VarId]) -> tuple[bool, ...]:
    """Per equation: True when none of its inputs depends on ``diff_vars`` (it needs no backward)."""
    tainted = set(diff_vars)
    free = []
    for e in eqns:
        hit = any(not isinstance(a, jcore.Literal) and a in tainted for a in e.ins)
        if hit:
            tainted.update(e.outs)
        free.append(not hit)
    return tuple(free)


# ---------------------------------------------------------------------------
# Microbatches


def batch_inputs(parts: StepParts) -> tuple[int, tuple[bool, ...]]:
    """(global batch size, per flat step input: a batch leaf to split into microbatches).

    The batch leaves are the step inputs passed to the loss as non-differentiated arguments (or, when it is
    passed none, closed over by it: a loss that takes its batch and closes over BatchNorm's statistics does not
    cut the statistics) whose leading dimension is the batch size (the leading size most such leaves share),
    and the step inputs of that leading size from which the step computes such a loss argument before the loss
    (``x = batch["x"] / 255`` closed over: ``batch["x"]`` is split, the division runs per microbatch).
    """
    fwd = parts.forward
    shapes = [fwd.avals[v].shape for v in fwd.invars]
    data = [k for k, d in enumerate(fwd.diff) if not d and len(shapes[k]) >= 1
            and (parts.operand_inputs[k] is not None or k in parts.computed_leaves)]
    if not data:
        raise PlanningError("the loss has no batch argument (a non-differentiated step argument with a leading "
                            "batch dimension) to split into microbatches; use num_stages=1")
    closed_over = parts.arg_leaf_counts[0] if parts.arg_leaf_counts else 0
    passed = [k for k in data if k >= closed_over]
    data = passed or data
    direct = [k for k in data if parts.operand_inputs[k] is not None] or data
    leading = [int(shapes[k][0]) for k in direct]
    batch = max(leading, key=lambda n: (leading.count(n), -leading.index(n)))  # the most common, then the first
    split = [False] * parts.num_inputs
    for k in data:
        if shapes[k][0] == batch and parts.operand_inputs[k] is not None:
            split[parts.operand_inputs[k]] = True
    batch_computed = [j for j, k in enumerate(parts.computed_leaves) if not fwd.diff[k] and shapes[k][:1] == (batch,)]
    if batch_computed:
        reads = prologue_reads(parts)
        in_avals = parts.prologue.invars[parts.num_consts:]
        for j in batch_computed:
            for i in reads[j]:
                if tuple(in_avals[i].aval.shape[:1]) == (batch,):
                    split[i] = True
    used_by_update = _used_inputs(parts)
    clash = [i for i, s in enumerate(split) if s and used_by_update[i]]
    if clash:
        raise PlanningError(f"step inputs {clash} are both loss batch data and read by the optimizer part of the "
                            "step; a pipeline splits the batch into microbatches, so only the loss may read it")
    return batch, tuple(split)


def prologue_reads(parts: StepParts) -> list[set[int]]:
    """Per computed loss-argument leaf: the flat step inputs the step computes it from."""
    if parts.prologue is None:
        return []
    jx = parts.prologue
    deps: dict[Any, set[int]] = {v: {i} for i, v in enumerate(jx.invars[parts.num_consts:])}
    for e in jx.eqns:
        got: set[int] = set()
        for a in e.invars:
            if not isinstance(a, jcore.Literal):
                got |= deps.get(a, set())
        for v in e.outvars:
            deps[v] = got
    return [set() if isinstance(a, jcore.Literal) else deps.get(a, set()) for a in jx.outvars]


def _used_inputs(parts: StepParts) -> list[bool]:
    update = parts.update
    used = {a for e in update.eqns for a in e.invars if not isinstance(a, jcore.Literal)}
    used |= {a for a in update.outvars if not isinstance(a, jcore.Literal)}
    start = parts.num_consts
    return [v in used for v in update.invars[start: start + parts.num_inputs]]


def microbatch_shapes(args_leaves: Sequence[Any], split: Sequence[bool], num_microbatches: int) -> list[Any]:
    """ShapeDtypeStructs of the flat step inputs with the batch leaves cut to one microbatch."""
    import jax

    out = []
    for leaf, s in zip(args_leaves, split):
        shape = tuple(np.shape(leaf))
        if s:
            shape = (shape[0] // num_microbatches, *shape[1:])
        out.append(jax.ShapeDtypeStruct(shape, jax.numpy.result_type(leaf)))
    return out
