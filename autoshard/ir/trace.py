"""Trace a train step to an OpGraph.

``trace(fn, *args)`` runs ``jax.make_jaxpr`` on the step (args may be concrete
arrays or ``jax.ShapeDtypeStruct`` pytrees), then walks the jaxpr the way
``jax.core.eval_jaxpr`` does: an environment from jaxpr variables to value
ids, one loop over equations. Call-like equations (``jit``/``pjit``,
``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) are
inlined. A ``scan`` (``lax.scan``, ``fori_loop`` with static bounds, ``nn.scan``
/ ``nnx.scan``) is flattened into a loop region (``ir/graph.LoopRegion``): its
body's ops join the graph with ``trip_count`` = its length (times the trip
count of the loops around it), between pseudo-ops that say how values enter
and leave it (``loop_carry``: a carry's init becomes the carry the body reads;
``loop_slice``: a stacked input gives the body one slice; ``loop_stack``: a
body output is stacked; ``loop_final``: the last carry leaves). The planner
plans body ops like any; the runtime re-emits the scan (``OpGraph.evaluate``).

A ``while`` is flattened the same way (``loop_carry`` per carry, its cond_fun's ops, its body's,
``loop_final`` per carry) with the trip count ``ir/trips.py`` derives or is told. A ``cond`` /
``switch``: its index and operands pass through ``loop_carry`` (one layout each, read by every
branch), every branch's ops follow, and one ``cond_merge`` per result takes each branch's result
(one layout for all). The costliest branch (by FLOPs, then bytes, on one device) keeps its ops' trip
count; the others' ops get ``trip_count`` 0: the cond is priced as its costliest branch, which is what
a data-dependent predicate can cost at most. A ``while``/``cond`` with side effects in its bodies stays
one op carrying its bodies (planned replicated, with a warning naming it).

Roles of the inputs come from the pytrees: leaves inside an optax state
object (or under a key named ``opt_state``) are optimizer state; other leaves
that the step returns updated (same position-independent tree structure,
shapes and dtypes in the output) are parameters when floating point of rank
≥ 1 (any floating dtype: float32, bfloat16, float16, the float8 types), state
otherwise; everything else is batch.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from autoshard.ir.flops import op_flops
from autoshard.ir.graph import LoopRegion, Op, OpGraph, Role, Value, ValueId
from autoshard.ir.markers import VG_NAME
from autoshard.ir.primitives import INLINED_CALLS
from autoshard.ir.trips import counted_trip_count, scan_operand_counts, stated_trip_count
from autoshard.errors import PlanningError

log = logging.getLogger(__name__)

INLINED = INLINED_CALLS  # calls whose bodies the tracer walks in place (ir/primitives.py: CALL and AD_CALL)
BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")

class TracingError(PlanningError):
    """The step could not be traced; the message says what to change."""


def _dtype_name(aval: Any) -> str:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:  # a Python scalar argument: the dtype jax gives it
        try:
            dtype = jax.numpy.result_type(aval)
        except TypeError:
            return "float32"
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes such as PRNG keys
        return str(dtype)


def _shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


class _Builder:
    """Accumulates values and ops while walking (possibly nested) jaxprs."""

    def __init__(self) -> None:
        self.values: dict[ValueId, Value] = {}
        self.ops: list[Op] = []
        self.constants: dict[ValueId, Any] = {}
        self.loops: list[LoopRegion] = []
        self.trip = 1  # how many times the ops being walked run per step (loops around them)

    def new_value(self, aval: Any, role: Role, path: str | None = None) -> ValueId:
        vid = len(self.values)
        self.values[vid] = Value(vid, _shape(aval), _dtype_name(aval), role, path)
        return vid

    def constant(self, val: Any, aval: Any) -> ValueId:
        vid = self.new_value(aval, Role.CONSTANT)
        self.constants[vid] = val
        return vid

    def walk(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], in_ids: Sequence[ValueId]) -> list[ValueId]:
        env: dict[Any, ValueId] = {}

        def read(atom: Any) -> ValueId:
            if isinstance(atom, jcore.Literal):
                return self.constant(atom.val, atom.aval)
            return env[atom]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = self.constant(val, var.aval)
        for var, vid in zip(jaxpr.invars, in_ids):
            env[var] = vid
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            body = _inline_body(eqn) if name in INLINED else None
            flatten = {"scan": self._flatten_scan, "while": self._flatten_while, "cond": self._flatten_cond}.get(name)
            if flatten is not None and (name == "scan" or not eqn.effects):
                outs = flatten(eqn, ins)
                for var, vid in zip(eqn.outvars, outs):
                    if not isinstance(var, jcore.DropVar):
                        env[var] = vid
                continue
            if body is not None:
                inner, inner_consts = body
                outs = self.walk(inner, inner_consts, ins)
                for var, vid in zip(eqn.outvars, outs):
                    env[var] = vid
                continue
            outs = [self.new_value(v.aval, Role.ACTIVATION) for v in eqn.outvars]
            for var, vid in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = vid
            self.ops.append(self._make_op(eqn, ins, outs))
        return [read(a) for a in jaxpr.outvars]

    def _make_op(self, eqn: Any, ins: list[ValueId], outs: list[ValueId]) -> Op:
        name = eqn.primitive.name
        in_vals = [self.values[v] for v in ins]
        out_vals = [self.values[v] for v in outs]
        bodies = tuple(trace_jaxpr(j) for j in control_flow_bodies(eqn))
        flops = op_flops(name, eqn.params, [v.shape for v in in_vals], [v.shape for v in out_vals],
                         [b.total_flops for b in bodies])
        nbytes = float(sum(v.nbytes for v in in_vals) + sum(v.nbytes for v in out_vals))
        return Op(len(self.ops), name, dict(eqn.params), tuple(ins), tuple(outs), flops * self.trip,
                  nbytes * self.trip, prim=eqn.primitive, bodies=bodies, source=eqn_source(eqn), trip_count=self.trip)

    def _pseudo(self, name: str, src: ValueId, shape: tuple[int, ...], trip: int, length: int) -> int:
        """A loop pseudo-op (module docstring) reading ``src`` and making one value of ``shape``; its index."""
        value = self.values[src]
        out = len(self.values)
        self.values[out] = Value(out, shape, value.dtype, Role.ACTIVATION)
        self.ops.append(Op(len(self.ops), name, {"length": length}, (src,), (out,), 0.0, 0.0, trip_count=trip))
        return len(self.ops) - 1

    def _flatten_scan(self, eqn: Any, ins: list[ValueId]) -> list[ValueId]:
        """A scan's body walked into the graph as a loop region; the scan's outputs (final carries, stacks)."""
        params = eqn.params
        (num_consts, num_carry), length = scan_operand_counts(params, len(ins)), int(params["length"])
        consts, inits, xs = ins[:num_consts], ins[num_consts:num_consts + num_carry], ins[num_consts + num_carry:]
        start, outer = len(self.ops), self.trip
        carry_ops = [self._pseudo("loop_carry", v, self.values[v].shape, outer, length) for v in inits]
        slice_ops = [self._pseudo("loop_slice", v, self.values[v].shape[1:], outer, length) for v in xs]
        body_in = list(consts) + [self.ops[t].outputs[0] for t in carry_ops + slice_ops]
        body = params["jaxpr"]
        body_start = len(self.ops)
        self.trip = outer * length
        try:
            body_out = self.walk(body.jaxpr, body.consts, body_in)
        finally:
            self.trip = outer
        body_stop = len(self.ops)
        # a stacked output is written inside the loop (resharding into it runs every iteration)
        stack_ops = [self._pseudo("loop_stack", v, (length, *self.values[v].shape), outer * length, length)
                     for v in body_out[num_carry:]]
        final_ops = [self._pseudo("loop_final", v, self.values[v].shape, outer, length) for v in body_out[:num_carry]]
        source = eqn_source(eqn)
        self.loops.append(LoopRegion(
            "scan", start, len(self.ops), body_start, body_stop, tuple(carry_ops), tuple(slice_ops),
            tuple(stack_ops), tuple(final_ops), length, bool(params.get("reverse", False)),
            params.get("unroll", 1), source))
        return [self.ops[t].outputs[0] for t in final_ops + stack_ops]

    def _walk_at(self, trip: int, closed: Any, ins: list[ValueId]) -> list[ValueId]:
        """Walk a closed body whose ops run ``trip`` times per step."""
        outer, self.trip = self.trip, trip
        try:
            return self.walk(closed.jaxpr, closed.consts, ins)
        finally:
            self.trip = outer

    def _flatten_while(self, eqn: Any, ins: list[ValueId]) -> list[ValueId]:
        """A while loop walked into the graph as a loop region (``LoopRegion``); its final carries."""
        params = eqn.params
        cn, bn = int(params["cond_nconsts"]), int(params["body_nconsts"])
        cond_consts, body_consts, inits = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        trips, how = counted_trip_count(params, [self.constants.get(v) for v in ins]), "derived"
        if trips is None:
            trips, how = stated_trip_count(eqn_source(eqn))
        start, outer = len(self.ops), self.trip
        carry_ops = [self._pseudo("loop_carry", v, self.values[v].shape, outer, trips) for v in inits]
        carries = [self.ops[t].outputs[0] for t in carry_ops]
        body_start = len(self.ops)
        predicate = self._walk_at(outer * (trips + 1), params["cond_jaxpr"], list(cond_consts) + carries)[0]
        cond_stop = len(self.ops)
        body_out = self._walk_at(outer * trips, params["body_jaxpr"], list(body_consts) + carries)
        body_stop = len(self.ops)
        final_ops = [self._pseudo("loop_final", v, self.values[v].shape, outer, trips) for v in body_out]
        self.loops.append(LoopRegion(
            "while", start, len(self.ops), body_start, body_stop, tuple(carry_ops), (), (), tuple(final_ops),
            trips, source=eqn_source(eqn), trip_source=how, cond_stop=cond_stop, predicate=predicate))
        return [self.ops[t].outputs[0] for t in final_ops]

    def _flatten_cond(self, eqn: Any, ins: list[ValueId]) -> list[ValueId]:
        """A cond / switch walked into the graph as a region of its branches (module docstring); its results."""
        start, outer = len(self.ops), self.trip
        index_op = self._pseudo("loop_carry", ins[0], self.values[ins[0]].shape, outer, 1)
        carry_ops = [self._pseudo("loop_carry", v, self.values[v].shape, outer, 1) for v in ins[1:]]
        operands = [self.ops[t].outputs[0] for t in carry_ops]
        ranges, results = [], []
        for branch in eqn.params["branches"]:
            lo = len(self.ops)
            results.append(self._walk_at(outer, branch, operands))
            ranges.append((lo, len(self.ops)))
        work = [(sum(op.flops for op in self.ops[lo:hi]), sum(op.bytes_accessed for op in self.ops[lo:hi]))
                for lo, hi in ranges]
        priced = max(range(len(ranges)), key=lambda b: (work[b], -b))
        for b, (lo, hi) in enumerate(ranges):
            if b != priced:  # the other branches run instead of it, never beside it: they add nothing
                for t in range(lo, hi):
                    self.ops[t] = dataclasses.replace(self.ops[t], flops=0.0, bytes_accessed=0.0, trip_count=0)
        final_ops = []
        for k in range(len(eqn.outvars)):
            srcs = tuple(r[k] for r in results)
            out = len(self.values)
            self.values[out] = Value(out, self.values[srcs[0]].shape, self.values[srcs[0]].dtype, Role.ACTIVATION)
            self.ops.append(Op(len(self.ops), "cond_merge", {"priced": priced}, srcs, (out,), 0.0, 0.0,
                               trip_count=outer))
            final_ops.append(len(self.ops) - 1)
        self.loops.append(LoopRegion(
            "cond", start, len(self.ops), ranges[0][0] if ranges else len(self.ops), ranges[-1][1] if ranges else
            len(self.ops), tuple(carry_ops), (), (), tuple(final_ops), 1, source=eqn_source(eqn), trip_source="",
            index_op=index_op, branches=tuple(ranges), priced_branch=priced))
        return [self.ops[t].outputs[0] for t in final_ops]


def _inline_body(eqn: Any) -> tuple[jcore.Jaxpr, Sequence[Any]] | None:
    for key in BODY_PARAMS:
        body = eqn.params.get(key)
        if isinstance(body, jcore.ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, jcore.Jaxpr):
            return body, ()
    return None


def control_flow_bodies(eqn: Any) -> list[jcore.ClosedJaxpr | jcore.Jaxpr]:
    name = eqn.primitive.name
    if name == "scan":
        return [eqn.params["jaxpr"]]
    if name == "while":
        return [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]]
    if name == "cond":
        return list(eqn.params["branches"])
    return []


def eqn_source(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # source info is a nicety; never fail tracing over it
        return ""


def trace_jaxpr(closed: jcore.ClosedJaxpr | jcore.Jaxpr) -> OpGraph:
    """An OpGraph of a (closed) jaxpr; inputs are activations (used for control-flow bodies)."""
    jaxpr, consts = (closed.jaxpr, closed.consts) if isinstance(closed, jcore.ClosedJaxpr) else (closed, ())
    b = _Builder()
    in_ids = [b.new_value(v.aval, Role.ACTIVATION) for v in jaxpr.invars]
    out_ids = b.walk(jaxpr, consts, in_ids)
    return OpGraph(b.values, tuple(b.ops), tuple(in_ids), tuple(out_ids), b.constants, loops=tuple(b.loops))


# ---- roles from pytrees ----------------------------------------------------


def _is_optax_state(node: Any) -> bool:
    return type(node).__module__.startswith("optax")


def _opt_state_leaf_mask(args: tuple[Any, ...]) -> list[bool]:
    """True for each flat leaf of ``args`` that sits inside an optax state or under an 'opt_state' key."""
    mask: list[bool] = []
    with_path, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_optax_state)
    for path, node in with_path:
        named = any(getattr(k, "key", getattr(k, "name", None)) == "opt_state" for k in path)
        n_leaves = len(jax.tree_util.tree_leaves(node))
        mask.extend([named or _is_optax_state(node)] * n_leaves)
    return mask


def signature(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((_shape(x), _dtype_name(x)) for x in leaves)


def carried_pairs(args: tuple[Any, ...], out_shape: Any) -> dict[int, int]:
    """Map flat output index → flat input index for state the step returns updated.

    A top-level output element is matched to the first unused top-level argument
    with the same tree structure, shapes and dtypes.
    """
    arg_offsets = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
    outs = list(out_shape) if isinstance(out_shape, (tuple, list)) else [out_shape]
    out_offsets = np.cumsum([0] + [len(jax.tree_util.tree_leaves(o)) for o in outs])
    arg_sigs = [signature(a) for a in args]
    used: set[int] = set()
    pairs: dict[int, int] = {}
    for j, out in enumerate(outs):
        sig = signature(out)
        if not sig[1]:
            continue
        for i, arg_sig in enumerate(arg_sigs):
            if i not in used and arg_sig == sig:
                used.add(i)
                for k in range(len(sig[1])):
                    pairs[int(out_offsets[j]) + k] = int(arg_offsets[i]) + k
                break
    return pairs


def is_floating(dtype_name: str) -> bool:
    """True for every floating dtype, bfloat16, float16 and the float8 types included.

    ``np.issubdtype(jnp.bfloat16, np.floating)`` is False (ml_dtypes types are not numpy floating
    subclasses); ``jnp.issubdtype`` knows them.
    """
    if dtype_name.startswith("key"):
        return False
    try:
        return bool(jax.numpy.issubdtype(np.dtype(dtype_name), jax.numpy.floating))
    except TypeError:  # extended dtypes (PRNG keys) have no numpy dtype
        return False


def _input_roles(args: tuple[Any, ...], leaves: list[Any], carried: set[int]) -> list[Role]:
    opt_mask = _opt_state_leaf_mask(args)
    roles: list[Role] = []
    first_arg_leaves = len(jax.tree_util.tree_leaves(args[0])) if args else 0
    for i, leaf in enumerate(leaves):
        floating = is_floating(_dtype_name(leaf))
        if opt_mask[i]:
            roles.append(Role.OPT_STATE)
        elif i in carried:
            roles.append(Role.PARAM if floating and len(_shape(leaf)) >= 1 else Role.OPT_STATE)
        elif not carried and i < first_arg_leaves and len(args) > 1:
            roles.append(Role.PARAM)  # nothing returned updated: the first argument is taken as the parameters
        else:
            roles.append(Role.BATCH)
    return roles


def step_jaxpr(fn: Callable[..., Any], *args: Any) -> tuple[jcore.ClosedJaxpr, Any]:
    """``fn(*args)`` (arrays or ShapeDtypeStructs) as a closed jaxpr with its dead code removed (as XLA removes
    it; every input kept), and the shapes of its outputs. A step that jax cannot trace raises TracingError."""
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as err:  # noqa: BLE001 — re-raised with advice, original chained
        name = getattr(fn, "__name__", repr(fn))
        raise TracingError(
            f"autoshard could not trace {name}: {type(err).__name__}: {err}\n"
            "The step must be a pure function of its array arguments (pytrees of arrays or "
            "jax.ShapeDtypeStruct), traceable by jax.jit: no Python control flow on array values, "
            "no side effects; pass configuration through a closure or functools.partial."
        ) from err
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return jcore.ClosedJaxpr(_marker_operands_kept(closed.jaxpr, jaxpr), closed.consts), out_shape


def _marker_operands_kept(before: jcore.Jaxpr, after: jcore.Jaxpr) -> jcore.Jaxpr:
    """``after`` (``before`` without its dead code) with every operand of an ``autoshard.value_and_grad`` call
    put back: jax's dead-code pass drops a call's unused operands, but the marker's are its argument leaves,
    counted by its name (``ir/split.py``), so a loss that ignores one (a key without dropout) would not split.
    The call keeps its body as the pass left it, taking the unused operands again and reading none of them."""
    marked = {str(e.params.get("name", "")): e for e in before.eqns
              if "jaxpr" in e.params and str(e.params.get("name", "")).startswith(VG_NAME)}
    if not marked:
        return after
    defined = {*after.invars, *after.constvars}
    eqns = []
    for e in after.eqns:
        full = marked.get(str(e.params.get("name", "")))
        if full is not None and len(e.invars) < len(full.invars) and all(
                isinstance(v, jcore.Literal) or v in defined for v in full.invars):
            e = _with_operands(e, full)
        eqns.append(e)
        defined.update(e.outvars)
    return after.replace(eqns=eqns)


def _with_operands(dced: Any, full: Any) -> Any:
    """The call ``dced`` taking every operand of ``full`` (the same call before dead code was removed)."""
    inner, whole = dced.params["jaxpr"], full.params["jaxpr"]
    used = set(inner.jaxpr.invars)
    keep = [v in used for v in whole.jaxpr.invars]
    info = inner.jaxpr.debug_info
    body = inner.jaxpr.replace(invars=list(whole.jaxpr.invars),
                               debug_info=info._replace(arg_names=None) if info is not None else None)
    params = dict(dced.params, jaxpr=jcore.ClosedJaxpr(body, inner.consts))
    for name in ("in_shardings", "in_layouts", "donated_invars"):
        if name in params:
            kept = iter(params[name])
            params[name] = tuple(next(kept) if k else f for k, f in zip(keep, full.params[name]))
    return dced.replace(invars=list(full.invars), params=params)


def trace(fn: Callable[..., Any], *args: Any) -> OpGraph:
    """Trace ``fn(*args)`` (arrays or ShapeDtypeStructs) into an OpGraph with roles and pytree paths."""
    start = time.perf_counter()
    closed, out_shape = step_jaxpr(fn, *args)
    in_with_path, in_tree = jax.tree_util.tree_flatten_with_path(args)
    in_leaves = [leaf for _, leaf in in_with_path]
    out_with_path, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    pairs = carried_pairs(args, out_shape)
    roles = _input_roles(args, in_leaves, set(pairs.values()))

    jaxpr = closed.jaxpr
    b = _Builder()
    in_ids = [b.new_value(var.aval, role, jax.tree_util.keystr(path))
              for var, role, (path, _) in zip(jaxpr.invars, roles, in_with_path)]
    out_ids = b.walk(jaxpr, closed.consts, in_ids)
    graph = OpGraph(
        values=b.values, ops=tuple(b.ops), inputs=tuple(in_ids), outputs=tuple(out_ids), constants=b.constants,
        in_tree=in_tree, out_tree=out_tree,
        output_paths=tuple(jax.tree_util.keystr(p) for p, _ in out_with_path),
        carried=tuple(pairs.get(k) for k in range(len(out_ids))), jaxpr=closed, loops=tuple(b.loops),
    )
    log.info("traced %s in %.2fs: %d ops", getattr(fn, "__name__", "step"), time.perf_counter() - start, len(b.ops))
    return graph
