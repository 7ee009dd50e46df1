"""A scanned layer stack cut into pipeline chunks: the step rewritten so each chunk of layers is its own leaves.

A loss that runs its blocks under ``lax.scan`` / ``nnx.scan`` / ``nn.scan`` traces to one ``scan``
equation whose ``xs`` are the stacked parameters (a leading layer axis of the trip count N) and whose
carry is the activation. :func:`find_stack` finds it (the parameter-dependent scan with the most
FLOPs whose ``xs`` include differentiated loss-argument leaves); :func:`check_stack` refuses what
cannot be cut, saying what to change. :func:`split_stack` rewrites a split step (``ir/split.py``)
for chunk bounds ``0 = b_0 < b_1 < ... < b_C = N`` into an equivalent step in which

- the forward runs C ``scan`` equations in a row (chunk c: iterations ``[b_c, b_c+1)``, still a loop),
  the carry of one feeding the next; every stacked parameter leaf is replaced by C leaves, its slices;
  other ``xs`` (functions of the batch) are sliced by free ``slice`` equations;
- the step's flat inputs are the user's with every stacked input replaced by its C slices: the stacked
  parameters, and every input the optimizer update reads only row-wise beside them (Adam's moments);
- the optimizer update runs per chunk: :func:`_run_split` evaluates the update's equations on chunked
  values, elementwise ops chunk by chunk (scalars broadcast, whole stacked operands sliced), anything
  else on the concatenation. A chunked result is a chunked output (C outputs); so an optimizer that
  couples the rows of a stacked leaf (a per-leaf norm) keeps that leaf whole, and the pipeline refuses
  it as it refuses any optimizer coupling two stages.

:class:`StackSplit` says which user input and output each rewritten one stands for, so the runtime
slices the user's arrays before a step and concatenates the outputs after it (the user's stacked layout).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from autoshard.errors import PlanningError
from autoshard.ir.primitives import CALLS, ELEMENTWISE
from autoshard.ir.split import FlatEqn, Forward, StepParts, VarId, bind_eqn, free_mask
from autoshard.ir.trips import scan_operand_counts

# primitives applied chunk by chunk along the leading (layer) axis when an operand is chunked: the elementwise ones
ROWWISE = ELEMENTWISE


@dataclass(frozen=True)
class ScanStack:
    """The scan equation of a layer stack in a split step's forward."""

    eqn: int  # forward equation index
    length: int  # trip count N: the layers
    num_consts: int
    num_carry: int
    xs_leaves: tuple[int | None, ...]  # per xs operand: the differentiated loss-argument leaf it is, or None


def find_stack(forward: Forward) -> ScanStack | None:
    """The parameter-dependent scan with the most FLOPs whose xs include a stacked parameter leaf."""
    diff_pos = {v: k for k, (v, d) in enumerate(zip(forward.invars, forward.diff)) if d}
    best: ScanStack | None = None
    for i, e in enumerate(forward.eqns):
        if e.eqn.primitive.name != "scan" or forward.free[i]:
            continue
        p = e.eqn.params
        num_consts, num_carry = scan_operand_counts(p, len(e.ins))
        xs = e.ins[num_consts + num_carry:]
        leaves = tuple(None if isinstance(a, jcore.Literal) else diff_pos.get(a) for a in xs)
        if p["length"] < 2 or all(k is None for k in leaves):
            continue
        if best is None or e.flops > forward.eqns[best.eqn].flops:
            best = ScanStack(i, int(p["length"]), num_consts, num_carry, leaves)
    return best


def check_stack(forward: Forward, stack: ScanStack) -> None:
    """Refuse a scan that cannot be cut into stages, saying what to change."""
    e = forward.eqns[stack.eqn]
    if e.eqn.params.get("reverse"):
        raise PlanningError("the layer scan runs in reverse (reverse=True); a pipeline cuts a forward scan into "
                            "stages: scan forward over the stacked layers")
    carries = e.ins[stack.num_consts: stack.num_consts + stack.num_carry]
    avals = [a.aval if isinstance(a, jcore.Literal) else forward.avals[a] for a in carries]
    bad = [aval.str_short() for aval in avals if not jnp.issubdtype(aval.dtype, jnp.floating)]
    if bad:
        raise PlanningError(f"the layer scan carries {bad} besides the layer activation; pipeline stages pass only "
                            "float activations from one stage's scan to the next: carry only the activations "
                            "(pass counters or keys as xs, stacked per layer, or as constants)")
    stacked = {forward.invars[k] for k in stack.xs_leaves if k is not None}
    elsewhere = [k for k, f in enumerate(forward.eqns) if k != stack.eqn and any(
        a in stacked for a in f.ins if not isinstance(a, jcore.Literal))]
    if elsewhere:
        raise PlanningError("stacked parameters of the layer scan are also read outside it; a pipeline splits them "
                            "by layer range: read them only inside the scanned block")
    ys = set(e.outs[stack.num_carry:])
    readers = [k for k, f in enumerate(forward.eqns) if any(a in ys for a in f.ins if not isinstance(a, jcore.Literal))]
    if readers or forward.outvar in ys or any(a in ys for a in forward.aux if not isinstance(a, jcore.Literal)):
        raise PlanningError("the layer scan returns per-layer outputs (ys) that the loss reads; a pipeline cut "
                            "passes only the carry between stages: return only the carry from the scanned block")
    xs = e.ins[stack.num_consts + stack.num_carry:]
    producer = {v: k for k, f in enumerate(forward.eqns) for v in f.outs}
    for a, leaf in zip(xs, stack.xs_leaves):
        if leaf is None and not isinstance(a, jcore.Literal) and a in producer and not forward.free[producer[a]]:
            raise PlanningError(f"the layer scan's stacked input {forward.avals[a].str_short()} is computed from "
                                "the parameters before the scan (a cast, a reshape); a pipeline splits stacked "
                                "parameters by layer range: do that inside the scanned block")


@dataclass(frozen=True, eq=False)
class StackSplit:
    """A split step with its layer stack cut into chunks (module docstring)."""

    parts: StepParts  # the rewritten step
    bounds: tuple[int, ...]  # chunk c holds iterations [bounds[c], bounds[c + 1])
    inputs: tuple[tuple[int, int | None], ...]  # per rewritten flat input: (user flat input, chunk or None)
    outputs: tuple[tuple[int, int | None], ...]  # per rewritten output: (user output, chunk or None)
    leaf_of: tuple[tuple[int, int | None], ...]  # per rewritten loss-argument leaf: (user leaf, chunk or None)
    eqn_origin: tuple[int | None, ...]  # per rewritten forward equation: the user's (None: made by the split)
    chunk_eqns: tuple[int, ...]  # per chunk: its scan equation in the rewritten forward

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1

    def chunk_of_eqn(self, eqn: int) -> int | None:
        return self.chunk_eqns.index(eqn) if eqn in self.chunk_eqns else None

    def split_flat(self, flat: Sequence[Any]) -> list[Any]:
        """The user's flat inputs as the rewritten step's (stacked ones sliced into chunks)."""
        return [flat[i] if c is None else flat[i][self.bounds[c]:self.bounds[c + 1]] for i, c in self.inputs]

    def join_outputs(self, outs: Sequence[Any], num_outputs: int, join: Any = None) -> list[Any]:
        """The rewritten step's outputs as the user's (chunked ones concatenated by ``join``)."""
        got: list[list[Any]] = [[] for _ in range(num_outputs)]
        for (k, _c), v in zip(self.outputs, outs):
            got[k].append(v)
        concat = join or (lambda xs: jnp.concatenate(xs, axis=0))
        return [vs[0] if len(vs) == 1 and self._whole(k) else concat(vs) for k, vs in enumerate(got)]

    def _whole(self, k: int) -> bool:
        return all(c is None for kk, c in self.outputs if kk == k)


def _one_eqn(fn: Any, *avals: Any) -> Any:
    """The single equation of ``fn`` traced at ``avals`` (a JaxprEqn with the right avals and context)."""
    jx = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    eqns = [e for e in jx.jaxpr.eqns]
    if len(eqns) != 1:
        raise PlanningError(f"internal: expected one equation, traced {len(eqns)}")
    return eqns[0]


def _nbytes(aval: Any) -> float:
    try:
        return float(np.prod(aval.shape, dtype=np.int64) * np.dtype(aval.dtype).itemsize)
    except TypeError:
        return 0.0


def _split_forward(forward: Forward, stack: ScanStack, bounds: Sequence[int], mark_cuts: bool
                   ) -> tuple[Forward, tuple[tuple[int, int | None], ...], tuple[int | None, ...], tuple[int, ...]]:
    """The forward with the scan cut into chunks (module docstring); ``mark_cuts``: every chunk but the last ends
    a layer (``FlatEqn.marker``), so the layer clustering cuts between iterations."""
    avals = dict(forward.avals)
    counter = [max(avals) + 1]

    def new(aval: Any) -> VarId:
        var = counter[0]
        counter[0] += 1
        avals[var] = aval
        return var

    stacked = {k for k in stack.xs_leaves if k is not None}
    num_chunks = len(bounds) - 1
    invars, diff, leaf_of = [], [], []
    chunk_var: dict[tuple[int, int], VarId] = {}
    for k, (v, d) in enumerate(zip(forward.invars, forward.diff)):
        if k in stacked:
            full = forward.avals[v]
            for c in range(num_chunks):
                var = new(full.update(shape=(bounds[c + 1] - bounds[c], *full.shape[1:])))
                chunk_var[k, c] = var
                invars.append(var)
                diff.append(d)
                leaf_of.append((k, c))
        else:
            invars.append(v)
            diff.append(d)
            leaf_of.append((k, None))
    scan = forward.eqns[stack.eqn]
    nc, ncar = stack.num_consts, stack.num_carry
    consts, carry, xs = scan.ins[:nc], list(scan.ins[nc:nc + ncar]), scan.ins[nc + ncar:]
    eqns: list[FlatEqn] = []
    origin: list[int | None] = []
    chunk_eqns = []
    for i, e in enumerate(forward.eqns):
        if i != stack.eqn:
            eqns.append(e)
            origin.append(i)
            continue
        for c in range(num_chunks):
            lo, hi = bounds[c], bounds[c + 1]
            xs_c = []
            for a, leaf in zip(xs, stack.xs_leaves):
                if leaf is not None:
                    xs_c.append(chunk_var[leaf, c])
                    continue
                full = a.aval if isinstance(a, jcore.Literal) else forward.avals[a]
                piece = _one_eqn(lambda x, lo=lo, hi=hi: lax.slice_in_dim(x, lo, hi, axis=0), full)
                out = new(piece.outvars[0].aval)
                eqns.append(FlatEqn(piece, (a,), (out,), 0.0, _nbytes(full) + _nbytes(piece.outvars[0].aval), False))
                origin.append(None)
                xs_c.append(out)
            params = {**scan.eqn.params, "length": hi - lo}
            ins = (*consts, *carry, *xs_c)
            in_avals = [a.aval if isinstance(a, jcore.Literal) else avals[a] for a in ins]
            prim = scan.eqn.primitive
            chunk = _one_eqn(lambda *a, prim=prim, params=params: prim.bind(*a, **params), *in_avals)
            last = c == num_chunks - 1
            carry_out = scan.outs[:ncar] if last else tuple(new(v.aval) for v in chunk.outvars[:ncar])
            ys = tuple(new(v.aval) for v in chunk.outvars[ncar:])
            outs = (*carry_out, *ys)
            nbytes = float(sum(_nbytes(a) for a in in_avals) + sum(_nbytes(avals[v]) for v in outs))
            chunk_eqns.append(len(eqns))
            eqns.append(FlatEqn(chunk, ins, outs, scan.flops * (hi - lo) / stack.length, nbytes,
                                mark_cuts and not last))
            origin.append(None)
            carry = list(carry_out)
    free = free_mask(eqns, {v for v, d in zip(invars, diff) if d})
    fwd = Forward(tuple(eqns), tuple(invars), forward.outvar, avals, forward.consts, tuple(diff), free,
                  forward.aux)
    return fwd, tuple(leaf_of), tuple(origin), tuple(chunk_eqns)


# ---------------------------------------------------------------------------
# The optimizer update, per chunk


@dataclass(frozen=True)
class _Chunks:
    """A value with a leading layer axis held as its chunks."""

    parts: tuple[Any, ...]

    def whole(self) -> Any:
        return jnp.concatenate(self.parts, axis=0)


def _run_split(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], bounds: Sequence[int],
               uses: dict[int, set[str]]) -> list[Any]:
    """Evaluate ``jaxpr`` on values some of which are :class:`_Chunks` (module docstring). ``uses`` records, per
    ``id`` of a watched whole argument, how it was used: ``"sliced"`` (row-wise beside chunks) or ``"whole"``."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    length = bounds[-1]

    def read(a: Any) -> Any:
        return a.val if isinstance(a, jcore.Literal) else env[a]

    def note(x: Any, how: str) -> None:
        if id(x) in uses:
            uses[id(x)].add(how)

    for e in jaxpr.eqns:
        vals = [read(a) for a in e.invars]
        name = e.primitive.name
        chunked = any(isinstance(v, _Chunks) for v in vals)
        out_shape = tuple(getattr(e.outvars[0].aval, "shape", ())) if e.outvars else ()
        if chunked and name in CALLS:
            body = e.params["jaxpr"]
            inner, inner_consts = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, ())
            outs = _run_split(inner, inner_consts, vals, bounds, uses)
        elif chunked and name in ROWWISE and out_shape[:1] == (length,) and all(
                isinstance(v, _Chunks) or np.shape(v) in ((), out_shape) for v in vals):
            outs_per_chunk = []
            for c in range(len(bounds) - 1):
                lo, hi = bounds[c], bounds[c + 1]
                row = []
                for v in vals:
                    if isinstance(v, _Chunks):
                        row.append(v.parts[c])
                    elif np.shape(v) == ():
                        row.append(v)
                    else:
                        note(v, "sliced")
                        row.append(v[lo:hi])
                outs_per_chunk.append(bind_eqn(e, row))
            outs = [_Chunks(tuple(ch[j] for ch in outs_per_chunk)) for j in range(len(e.outvars))]
        else:
            plain = []
            for v in vals:
                note(v, "whole")
                plain.append(v.whole() if isinstance(v, _Chunks) else v)
            outs = bind_eqn(e, plain)
        for var, val in zip(e.outvars, outs):
            env[var] = val
    result = [read(a) for a in jaxpr.outvars]
    for v in result:
        note(v, "whole")
    return result


def split_stack(parts: StepParts, stack: ScanStack, bounds: Sequence[int], *, mark_cuts: bool = False) -> StackSplit:
    """``parts`` with its layer stack cut at ``bounds`` (module docstring)."""
    bounds = tuple(int(b) for b in bounds)
    if bounds[0] != 0 or bounds[-1] != stack.length or any(a >= b for a, b in zip(bounds[:-1], bounds[1:])):
        raise PlanningError(f"chunk bounds {bounds} do not cut the {stack.length} scanned layers into ranges")
    check_stack(parts.forward, stack)
    fwd, leaf_of, origin, chunk_eqns = _split_forward(parts.forward, stack, bounds, mark_cuts)
    num_chunks = len(bounds) - 1
    stacked_leaves = {k for k in stack.xs_leaves if k is not None}
    if stacked_leaves & set(parts.computed_leaves):
        raise PlanningError("the stacked parameters of the layer scan are computed by the step before the loss; "
                            "pass them to the loss as step arguments (the parameter pytree)")
    needed = {parts.operand_inputs[k] for k in stacked_leaves if parts.operand_inputs[k] is not None}
    update = parts.update
    nc, ni = parts.num_consts, parts.num_inputs
    in_avals = [v.aval for v in update.invars]
    grad_stacked = [parts.grad_for_leaf[g] in stacked_leaves for g in range(parts.num_grads)]
    length = stack.length
    # optimistic: every input with the layer axis in front is split, unless the update reads it whole
    read_whole = {parts.operand_inputs[k] for k in range(len(parts.forward.invars)) if k not in stacked_leaves}
    split = needed | {i for i in range(ni) if tuple(getattr(in_avals[nc + i], "shape", ()))[:1] == (length,)
                      and i not in read_whole}

    def chunk_avals(aval: Any) -> list[Any]:
        return [jax.ShapeDtypeStruct((bounds[c + 1] - bounds[c], *aval.shape[1:]), aval.dtype)
                for c in range(num_chunks)]

    while True:
        inputs = [(i, c) for i in range(ni) for c in (range(num_chunks) if i in split else [None])]
        uses: dict[int, set[str]] = {}
        watched: dict[int, int] = {}
        chunked_out: list[bool] = []

        def per_chunk(*flat: Any) -> list[Any]:
            it = iter(flat)
            consts = [next(it) for _ in range(nc)]
            args: list[Any] = []
            for i in range(ni):
                if i in split:
                    x = _Chunks(tuple(next(it) for _ in range(num_chunks)))
                    uses[id(x)] = set()
                    watched[id(x)] = i
                    args.append(x)
                else:
                    args.append(next(it))
            loss = next(it)
            grads = [_Chunks(tuple(next(it) for _ in range(num_chunks))) if s else next(it) for s in grad_stacked]
            aux = list(it)
            outs = _run_split(update, [], [*consts, *args, loss, *grads, *aux], bounds, uses)
            chunked_out[:] = [isinstance(v, _Chunks) for v in outs]
            return [x for v in outs for x in (v.parts if isinstance(v, _Chunks) else (v,))]

        avals = [*in_avals[:nc]]
        for i, c in inputs:
            aval = in_avals[nc + i]
            avals.append(aval if c is None else chunk_avals(aval)[c])
        avals.append(in_avals[nc + ni])
        for g, s in enumerate(grad_stacked):
            aval = in_avals[nc + ni + 1 + g]
            avals.extend(chunk_avals(aval) if s else [aval])
        avals.extend(in_avals[nc + ni + 1 + parts.num_grads:])
        closed = jax.make_jaxpr(per_chunk)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        whole = {watched[x] for x, how in uses.items() if "whole" in how} - needed
        if not whole:
            break
        split -= whole
    if closed.consts:
        raise PlanningError("internal: the per-chunk optimizer update captured constants")
    index = {key: j for j, key in enumerate(inputs)}
    operand_inputs, operand_consts = [], []
    for k, c in leaf_of:
        src = parts.operand_inputs[k]
        if src is not None and src in split and c is None:
            raise PlanningError(f"loss argument {k} reads a stacked step input whole; a pipeline splits that input by "
                                "layer range: read it only inside the scanned block")
        operand_inputs.append(None if src is None else index[src, c])
        const = parts.operand_consts[k]
        operand_consts.append(const[bounds[c]:bounds[c + 1]] if c is not None and const is not None else const)
    outputs = []
    for k, ch in enumerate(chunked_out):
        outputs.extend((k, c) for c in range(num_chunks)) if ch else outputs.append((k, None))
    prologue = None
    if parts.prologue is not None:
        def joined(*flat: Any) -> list[Any]:
            consts, rest = list(flat[:nc]), flat[nc:]
            user = []
            for i in range(ni):
                if i in split:
                    user.append(jnp.concatenate([rest[index[i, c]] for c in range(num_chunks)], axis=0))
                else:
                    user.append(rest[index[i, None]])
            return jcore.jaxpr_as_fun(jcore.ClosedJaxpr(parts.prologue, []))(*consts, *user)

        pro = jax.make_jaxpr(joined)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals[:nc + len(inputs)]])
        if pro.consts:
            raise PlanningError("internal: the rewritten prologue captured constants")
        prologue = pro.jaxpr
    new_leaf = {key: j for j, key in enumerate(leaf_of)}
    computed = tuple(new_leaf[k, None] for k in parts.computed_leaves)
    grad_for_leaf = tuple(j for j, d in enumerate(fwd.diff) if d)
    new_parts = replace(parts, forward=fwd, operand_inputs=tuple(operand_inputs), operand_consts=tuple(operand_consts),
                        update=closed.jaxpr, num_inputs=len(inputs), grad_for_leaf=grad_for_leaf,
                        computed_leaves=computed, prologue=prologue)
    return StackSplit(new_parts, bounds, tuple(inputs), tuple(outputs), leaf_of, origin, chunk_eqns)
