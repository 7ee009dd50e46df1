"""SPMD runtime: one ``jax.jit`` of the traced graph with the plan's shardings.

``Annotations`` (``plans/annotations.py``) is the one shape in which layouts reach the runtime: a spec
per flat input and output, and per op the specs of its outputs and the
layouts its inputs are resharded through (only where they differ from how the
producer left them). ``passes/emit.py`` builds it from the solver's result for
a Plan, ``runtime/applied.py`` from a Plan for this runtime; this module and
the pipeline runtime are the only places that turn specs into
``jax.sharding`` objects (``named_sharding``, ``make_jax_mesh``).

Inputs and outputs get ``in_shardings``/``out_shardings`` from the plan; every
op output is pinned with ``with_sharding_constraint`` to the spec the plan
chose, and inputs that the plan reshards are constrained to the consumer's
spec first, so XLA runs exactly the communication the plan priced (on a
one-device mesh nothing is pinned: the program is ``jax.jit``'s). Carried
state (parameters, optimizer state) is donated.

Any ``jax.sharding.Mesh`` runs a plan, whatever its axis types. Sharding
constraints may only name Auto axes, while ``jax.make_mesh`` makes Explicit
ones by default, so the jitted program works on the mesh's Auto twin (the same
devices in the same order, every axis Auto: ``auto_twin``) and its results are
returned on the mesh the caller gave, with the planned specs. Both meshes lay
out a shard on the same device, so crossing between them moves no data.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autoshard.ir.graph import Op, OpGraph
from autoshard.ir.spec import Spec
from autoshard.meshes.logical import LogicalMesh
from autoshard.plans.annotations import Annotations, Deferral
from autoshard.runtime.deferred import partial_view, summed_stack


def partition_spec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*spec.partition_entries())


def named_sharding(spec: Spec, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(spec))


def make_jax_mesh(logical: LogicalMesh | tuple[int, ...], axis_names: Sequence[str] | None = None,
                  devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A jax Mesh with Auto axis types over ``devices`` (the planned layouts are GSPMD sharding constraints,
    which name Auto axes only; ``jax.make_mesh`` would make Explicit ones)."""
    if isinstance(logical, LogicalMesh):
        shape, names = logical.shape, logical.axis_names
    else:
        shape, names = tuple(logical), tuple(axis_names or ())
    devices = list(devices) if devices is not None else jax.devices()[: int(np.prod(shape))]
    if len(devices) != int(np.prod(shape)):
        raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, got {len(devices)}")
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def auto_twin(mesh: Mesh) -> Mesh:
    """``mesh`` itself when every axis is Auto, else the same devices and axis names with every axis Auto:
    what the planned sharding constraints run on (module docstring)."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def pin(value: Any, chain: Sequence[Spec], mesh: Mesh) -> Any:
    """``value`` constrained through the layouts of ``chain`` in order (``with_sharding_constraint``): how a
    planned op output or a planned reshard reaches XLA.

    On a one-device mesh nothing is pinned: every layout there is the whole array, and a constraint only
    stands between XLA and its simplifications (it kept converts of a mixed-precision step from folding), so
    the program is the one ``jax.jit`` compiles for the step."""
    if mesh.size == 1:
        return value
    for spec in chain:
        value = jax.lax.with_sharding_constraint(value, named_sharding(spec, mesh))
    return value


def partial_result(op: Op, vals: Sequence[Any], deferral: Deferral, out_spec: Spec, mesh: Mesh) -> Any:
    """Op ``op`` (``dot_general`` or ``reduce_sum``) on ``vals`` without the reduction over the split
    contracting dims (``runtime/deferred.py``): its result (whose sum has layout ``out_spec``) with one
    leading dim per entry of ``deferral.reduced``, each device's own partial sum. Each device runs the op
    on its own shards (``shard_map`` over the whole mesh; the operands arrive in ``deferral.operands``, as
    the plan pinned them), so XLA moves nothing and copies no operand into another shape."""
    k = len(deferral.reduced)

    def local(*shards: Any) -> Any:
        out = op.prim.bind(*shards, **op.params)
        return out.reshape((1,) * k + tuple(out.shape))

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(partition_spec(s) for s in deferral.operands),
                         out_specs=partition_spec(deferral.partial(out_spec)), check_vma=False)(*vals)


class SharedPins:
    """Planned reshards made once per (value, chain) within one trace, their result shared by every op that
    reads the value through that chain: XLA does not always merge equal reshards (a chain of two or more
    constraints per reader compiled to one all-to-all or collective-permute per reader, in the MoE pipeline
    stages three of each; ``tests/sim/test_shared_pins.py``), and the planner prices a value resharded to one
    layout once however many ops read it there (the ILP's shared reshards). Keyed by the value object
    itself, so a value of another trace never matches."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._made: dict[tuple[int, tuple[Spec, ...]], tuple[Any, Any]] = {}

    def __call__(self, value: Any, chain: Sequence[Spec]) -> Any:
        key = (id(value), tuple(chain))
        made = self._made.get(key)
        if made is not None and made[0] is value:
            return made[1]
        moved = pin(value, chain, self.mesh)
        self._made[key] = (value, moved)  # holding value keeps its id from being reused
        return moved


def pin_op_inputs(vals: list[Any], moves: Mapping[int, Sequence[Spec]] | None, mesh: Mesh,
                  shared: SharedPins | None = None) -> list[Any]:
    """An op's inputs, those the plan reshards pinned through their chains first (``Annotations.op_in_reshards``);
    with ``shared``, a value already moved through the same chain in this trace is read as moved."""
    if not moves:
        return vals
    move = shared if shared is not None else (lambda v, chain: pin(v, chain, mesh))
    return [move(v, moves[i]) if i in moves else v for i, v in enumerate(vals)]


def pin_op_outputs(vals: list[Any], specs: Sequence[Spec | None] | None, mesh: Mesh) -> list[Any]:
    """An op's outputs pinned to their planned specs (``Annotations.op_out_specs``; a None entry: not pinned)."""
    if specs is None:
        return vals
    return [v if s is None else pin(v, (s,), mesh) for v, s in zip(vals, specs)]


class SpmdStep:
    """A planned train step: call it like the original function."""

    def __init__(self, graph: OpGraph, annotations: Annotations, mesh: Mesh, *, donate: bool = True,
                 compiler_options: Mapping[str, Any] | None = None) -> None:
        """``mesh``: the caller's, any axis types; arguments are placed and results returned on it.
        ``compiler_options``: XLA's, as ``jax.jit``'s (None: its defaults)."""
        self.graph, self.annotations, self.mesh = graph, annotations, mesh
        self.inner_mesh = auto_twin(mesh)  # what the jitted program's shardings and constraints name
        self.in_shardings = tuple(named_sharding(s, mesh) for s in annotations.input_specs)
        self.out_shardings = tuple(named_sharding(s, mesh) for s in annotations.output_specs)
        carried = {i for i in (graph.carried or ()) if i is not None}
        self.donate_argnums = tuple(sorted(carried)) if donate else ()
        self.inner_in_shardings = tuple(named_sharding(s, self.inner_mesh) for s in annotations.input_specs)
        self.jitted = jax.jit(self._flat_step, in_shardings=self.inner_in_shardings, out_shardings=self.out_shardings,
                              donate_argnums=self.donate_argnums,
                              compiler_options=dict(compiler_options) if compiler_options else None)

    def _flat_step(self, *flat: Any) -> list[Any]:
        ann, mesh = self.annotations, self.inner_mesh
        # a deferred reduction (runtime/deferred.py): the ops making its partial sums, and those reading them
        makes = {t: d for j, d in ann.deferred.items() for t in (j, *d.chain)}
        reads = {t: d for d in ann.deferred.values() for t in (*d.chain, d.stack)}

        shared, loop = SharedPins(mesh), self.graph.loop_of()

        def before(op: Op, vals: list[Any]) -> list[Any]:
            moves = ann.op_in_reshards.get(op.id)
            if moves and op.id in reads:  # a partial sum moves in its partial layouts (its leading dims stay)
                moves = {p: tuple(reads[op.id].partial(s) for s in chain) for p, chain in moves.items()}
            # a loop body is a trace of its own: a value moved there must not be read outside it
            return pin_op_inputs(vals, moves, mesh, shared if loop[op.id] < 0 else None)

        def bind(op: Op, vals: list[Any]) -> list[Any] | None:
            if op.id in ann.deferred:
                return [partial_result(op, vals, ann.deferred[op.id], ann.op_out_specs[op.id][0], mesh)]
            if op.id in makes:
                return [partial_view(op, vals[0], len(makes[op.id].reduced))]
            return None

        def after(op: Op, vals: list[Any]) -> list[Any]:
            if op.id in makes:
                return [pin(vals[0], (makes[op.id].partial(ann.op_out_specs[op.id][0]),), mesh)]
            if op.id in reads:  # the stack, after the loop: the one reduction
                vals = [summed_stack(vals[0], reads[op.id])]
            return pin_op_outputs(vals, ann.op_out_specs.get(op.id), mesh)

        outs = self.graph.evaluate(flat, before_op=before, after_op=after, bind_op=bind if ann.deferred else None)
        return tuple(pin(v, ann.output_reshards[k], mesh) if k in ann.output_reshards else v
                     for k, v in enumerate(outs))

    def flatten_args(self, args: Sequence[Any]) -> list[Any]:
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        if tree != self.graph.in_tree:
            raise ValueError(f"arguments do not match the planned signature:\n  planned {self.graph.in_tree}\n  got     {tree}")
        return leaves

    def place(self, *args: Any) -> tuple[Any, ...]:
        """Put arguments on the mesh with the planned input shardings (as a pytree like ``args``)."""
        leaves = [jax.device_put(x, s) for x, s in zip(self.flatten_args(args), self.in_shardings)]
        return jax.tree_util.tree_unflatten(self.graph.in_tree, leaves)

    def __call__(self, *args: Any) -> Any:
        out = self.jitted(*self.flatten_args(args))
        return jax.tree_util.tree_unflatten(self.graph.out_tree, out)

    def call_placed(self, args: Sequence[Any]) -> Any:
        """Call with ``args`` moved to the planned input shardings first where they are elsewhere (an argument
        already there on the caller's mesh is only relabelled onto its Auto twin: the same buffers)."""
        placed = [x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
                  for x, s in zip(self.flatten_args(args), self.inner_in_shardings)]
        return jax.tree_util.tree_unflatten(self.graph.out_tree, self.jitted(*placed))

    def lower(self, *args: Any) -> Any:
        return self.jitted.lower(*self.flatten_args(args))
