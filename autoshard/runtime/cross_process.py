"""Moving an array between two sub-meshes whose devices lie in different processes (multi-controller jax).

In a multi-process job each process drives only its own devices, and
``jax.device_put`` between sub-meshes of different processes needs a cross-host
transfer service that XLA:CPU does not offer. A pipeline sends activations from
one stage's sub-mesh to the next, so :func:`send` does it with one jitted
program over the union of the two sub-meshes, which every process holding a
device of either calls (in the same order on each, as any collective):

1. on the source, the array is made whole on each source device (a local
   all-gather when it is sharded);
2. a global array with one slot per union device holds it on the source
   devices and zeros elsewhere; the program broadcasts the first source slot
   to every slot (XLA emits the cross-process collective: gloo on CPU);
3. on the destination, the received slot becomes an array replicated on the
   destination mesh, then laid out as asked (a local slice).

Processes that hold the destination get the array; the others get ``None``.
When one process holds both sub-meshes this is just ``jax.device_put``.

At most one cross-process collective is in flight per process: :func:`send` waits
for its input before the broadcast and for the broadcast before it returns. Under
XLA:CPU's asynchronous dispatch a broadcast queued behind (or beside) another
gloo collective or a stage program deadlocked one run in three when the machine
was loaded (process 1 blocked in the broadcast while process 0 sat in its stage
backward). The cost is that a send no longer overlaps the next stage program.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def mesh_processes(mesh: Mesh) -> frozenset[int]:
    return frozenset(int(d.process_index) for d in mesh.devices.flat)


def holds(mesh: Mesh) -> bool:
    """Whether this process drives a device of ``mesh``."""
    return jax.process_index() in mesh_processes(mesh)


def single_process(*meshes: Mesh) -> bool:
    """Whether one process (this one) drives every device of the meshes: plain device_put works."""
    procs = frozenset().union(*(mesh_processes(m) for m in meshes))
    return procs == {jax.process_index()}


@functools.lru_cache(maxsize=256)
def _broadcaster(device_ids: tuple[int, ...], shape: tuple[int, ...], dtype: str) -> Any:
    by_id = {d.id: d for d in jax.devices()}
    union = Mesh(np.asarray([by_id[i] for i in device_ids]), ("u",), axis_types=(jax.sharding.AxisType.Auto,))
    slots = NamedSharding(union, PartitionSpec("u"))
    return union, slots, jax.jit(lambda x: jnp.broadcast_to(x[:1], x.shape), out_shardings=slots)


def send(x: Any, src: Mesh, dst: NamedSharding, shape: Sequence[int], dtype: Any) -> Any:
    """``x`` (an array on ``src``'s devices, or None on a process holding none) laid out as ``dst``
    (module docstring). Every process holding a device of ``src`` or ``dst.mesh`` must call it."""
    if single_process(src, dst.mesh):
        return jax.device_put(x, dst)
    src_devices = list(src.devices.flat)
    dst_devices = [d for d in dst.mesh.devices.flat if d not in src_devices]
    union_devices = src_devices + dst_devices
    shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
    union, slots, broadcast = _broadcaster(tuple(d.id for d in union_devices), shape, dtype.name)
    me = jax.process_index()
    local: dict[Any, Any] = {}
    if x is not None and holds(src):
        whole = jax.block_until_ready(_relayout(jax.block_until_ready(x), NamedSharding(src, PartitionSpec())))
        for shard in whole.addressable_shards:
            local[shard.device] = shard.data.reshape((1, *shape))
    parts = []
    for d in union_devices:
        if d.process_index != me:
            continue
        parts.append(local[d] if d in local else jax.device_put(jnp.zeros((1, *shape), dtype), d))
    gathered = jax.make_array_from_single_device_arrays((len(union_devices), *shape), slots, parts, dtype=dtype)
    out = jax.block_until_ready(broadcast(gathered))
    if not holds(dst.mesh):
        return None
    mine = {s.device: s.data.reshape(shape) for s in out.addressable_shards}
    dst_here = [mine[d] for d in dst.mesh.devices.flat if d.process_index == me]
    replicated = jax.make_array_from_single_device_arrays(shape, NamedSharding(dst.mesh, PartitionSpec()), dst_here,
                                                          dtype=dtype)
    return _relayout(replicated, dst)


def _relayout(x: Any, sharding: NamedSharding) -> Any:
    """``x`` laid out as ``sharding`` on the same devices. On a mesh spanning processes, a jitted identity: it
    reshards by collectives (device_put would ask for a cross-host transfer); not exercised by a test yet."""
    if getattr(x, "sharding", None) == sharding:
        return x
    if single_process(sharding.mesh):
        return jax.device_put(x, sharding)  # a local copy (a jitted all-gather here can stall gloo's rendezvous)
    return _identity(sharding)(x)


@functools.lru_cache(maxsize=256)
def _identity(sharding: NamedSharding) -> Any:
    return jax.jit(lambda a: a, out_shardings=sharding)


def placeholder(sharding: NamedSharding, shape: Sequence[int], dtype: Any) -> jax.Array:
    """A global array on devices this process does not hold (it stands for a value another process has)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=np.dtype(dtype))
