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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from autoshard.errors import PlanningError
from autoshard.ir.flops import op_flops
from autoshard.ir.markers import LAYER_SCOPE, VG_NAME
from autoshard.ir.trace import control_flow_bodies, trace_jaxpr

log = logging.getLogger(__name__)

VarId: TypeAlias = int
Atom: TypeAlias = "VarId | jcore.Literal"
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})  # inlined: pure calls, no custom rules lost


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
        prim = self.eqn.primitive
        with self.eqn.ctx.manager:
            out = prim.bind(*values, **prim.get_bind_params(self.eqn.params))
        return list(out) if prim.multiple_results else [out]


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

    def nbytes(self, var: VarId) -> int:
        aval = self.avals[var]
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize

    def run(self, eqn_indices: Iterable[int], env: dict[VarId, Any]) -> dict[VarId, Any]:
        """Evaluate the given equations in order on ``env`` (var -> value), in place."""
        for i in eqn_indices:
            e = self.eqns[i]
            vals = [a.val if isinstance(a, jcore.Literal) else env[a] for a in e.ins]
            for var, val in zip(e.outs, e.bind(vals)):
                env[var] = val
        return env


@dataclass(frozen=True, eq=False)
class StepParts:
    """A marked train step taken apart (see the module docstring)."""

    closed: Any  # ClosedJaxpr of the whole step
    argnums: tuple[int, ...]
    arg_leaf_counts: tuple[int, ...]  # flat leaves per loss argument
    forward: Forward
    operand_inputs: tuple[int | None, ...]  # per loss-argument leaf: the step's flat input index (None: constant)
    operand_consts: tuple[Any, ...]  # per loss-argument leaf: its value when it is a constant
    update: Any  # Jaxpr: invars = [*step consts, *step inputs, loss, *grads]; outvars = step outputs
    num_consts: int
    num_inputs: int
    # per step output: ("input", i) | ("loss", 0) | ("grad", g) | ("update", k) (k: update outvar index)
    grad_for_leaf: tuple[int, ...]  # grad g -> its loss-argument leaf index

    @property
    def num_grads(self) -> int:
        return len(self.grad_for_leaf)


def _vg_argnums(name: str) -> tuple[tuple[int, ...], bool] | None:
    if not name.startswith(VG_NAME):
        return None
    parts = name[len(VG_NAME):].strip(".").split(".")
    aux = "aux" in parts
    return tuple(int(p) for p in parts if p.isdigit()), aux


def split_step(closed: Any, in_tree: Any = None) -> StepParts | None:
    """Take a traced step apart at its ``autoshard.value_and_grad``; None when it has no marker."""
    jaxpr = closed.jaxpr
    found = [(k, e) for k, e in enumerate(jaxpr.eqns)
             if e.primitive.name in CALLS and _vg_argnums(str(e.params.get("name", ""))) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise PlanningError(f"the step calls autoshard.value_and_grad/grad {len(found)} times; a pipeline needs "
                            "exactly one loss: compute one total loss, or use num_stages=1")
    k, eqn = found[0]
    argnums, aux = _vg_argnums(str(eqn.params["name"]))
    if aux:
        raise PlanningError("pipelines do not support has_aux=True yet: return only the loss, or use num_stages=1")
    inner = eqn.params["jaxpr"]
    leaf_counts = _leaf_counts(inner, eqn, argnums)
    step_in = {v: i for i, v in enumerate(jaxpr.invars)}
    const_vals = dict(zip(jaxpr.constvars, closed.consts))
    operand_inputs, operand_consts = [], []
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
        else:
            raise PlanningError(
                f"argument leaf {pos} of autoshard.value_and_grad is computed inside the step; a pipeline needs "
                "the loss arguments to be the step's own arguments (move the computation into the loss), or "
                "use num_stages=1")
    diff = _diff_mask(leaf_counts, argnums)
    forward = _flatten_forward(inner, diff)
    num_grads = len(eqn.outvars) - 1
    grad_for_leaf = tuple(i for i, d in enumerate(diff) if d)
    if len(grad_for_leaf) != num_grads:
        raise PlanningError(f"autoshard.value_and_grad gave {num_grads} gradients for {len(grad_for_leaf)} "
                            "differentiated leaves")
    rest = [e for j, e in enumerate(jaxpr.eqns) if j != k]
    info = jaxpr.debug_info._replace(arg_names=None, result_paths=None) if jaxpr.debug_info else None
    update = jcore.Jaxpr([], [*jaxpr.constvars, *jaxpr.invars, *eqn.outvars], list(jaxpr.outvars), rest,
                         jaxpr.effects, info)
    return StepParts(closed, argnums, leaf_counts, forward, tuple(operand_inputs), tuple(operand_consts), update,
                     len(jaxpr.constvars), len(jaxpr.invars), grad_for_leaf)


def _leaf_counts(inner: Any, eqn: Any, argnums: tuple[int, ...]) -> tuple[int, ...]:
    """Flat leaves per loss argument, from the jit's input pytree when jax kept it."""
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


def _flatten_forward(inner: Any, diff: tuple[bool, ...]) -> Forward:
    jaxpr, consts = inner.jaxpr, inner.consts
    dced, _used = pe.dce_jaxpr(jaxpr, [True] + [False] * (len(jaxpr.outvars) - 1), instantiate=True)
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

    (out,) = walk(dced, consts, [env[v] for v in dced.invars], False)
    free = _free_mask(eqns, {v for v, d in zip(invars, diff) if d})
    return Forward(tuple(eqns), invars, out, avals, const_env, diff, free)


def _free_mask(eqns: Sequence[FlatEqn], diff_vars: set[VarId]) -> tuple[bool, ...]:
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

    The batch leaves are the step inputs passed to the loss as non-differentiated
    arguments whose leading dimension is the batch size (that of the first such leaf).
    """
    fwd = parts.forward
    shapes = [fwd.avals[v].shape for v in fwd.invars]
    data = [k for k, d in enumerate(fwd.diff) if not d and len(shapes[k]) >= 1 and parts.operand_inputs[k] is not None]
    if not data:
        raise PlanningError("the loss has no batch argument (a non-differentiated step argument with a leading "
                            "batch dimension) to split into microbatches; use num_stages=1")
    batch = int(shapes[data[0]][0])
    split = [False] * parts.num_inputs
    for k in data:
        if shapes[k][0] == batch:
            split[parts.operand_inputs[k]] = True
    used_by_update = _used_inputs(parts)
    clash = [i for i, s in enumerate(split) if s and used_by_update[i]]
    if clash:
        raise PlanningError(f"step inputs {clash} are both loss batch data and read by the optimizer part of the "
                            "step; a pipeline splits the batch into microbatches, so only the loss may read it")
    return batch, tuple(split)


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
