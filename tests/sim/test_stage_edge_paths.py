"""Where a pipeline stage's layer plans meet, the reshard between them runs as it was priced: the edge pin
carries the planned reshard's intermediate layouts (``compiler/stage_boundaries.py``), both ways, and XLA
runs exactly the priced collectives. Pinned to its end alone, XLA gathers the whole array."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from autoshard.compiler.hlo import read_hlo_collectives
from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.resharding import reshard
from autoshard.runtime.spmd import named_sharding, pin
from autoshard.runtime.stage_pins import fitted_edge_pin, two_way_pin

SHAPE = (12, 8, 12)
SRC = Spec(((), (), ("x", "y")))  # the producing layer plan's output spec
DST = Spec((("x",), (), ()))  # the reading layer plan's input spec


def _collectives(fn, x) -> list[tuple[str, int]]:
    return _read(jax.jit(fn).lower(x).compile())


def _read(compiled) -> list[tuple[str, int]]:
    return sorted((c.kind, c.nbytes * c.count) for c in read_hlo_collectives(compiled.as_text()))


def _priced(moved) -> list[tuple[str, int]]:
    return sorted((c.kind, int(c.nbytes)) for c in moved.collectives)


def test_an_edge_pin_runs_its_planned_path_both_ways(devices8):
    mesh = Mesh(np.array(devices8[:4]).reshape(2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    logical = make_logical_mesh(get_cluster("cpu-8"), (2, 2), ("x", "y"))
    ahead, back = reshard(SHAPE, 4, SRC, DST, logical), reshard(SHAPE, 4, DST, SRC, logical)
    assert ahead.path, "the case needs a reshard of two steps (an all-gather over y, an all-to-all over x)"
    x = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)

    def forward(chain):
        return lambda v: pin(two_way_pin(pin(v * 2, (SRC,), mesh), chain, (DST,), mesh), (DST,), mesh)

    # forward: along the path, the collectives priced; pinned to the reader's spec alone, one whole gather
    assert _collectives(forward((*ahead.path, DST)), x) == _priced(ahead)
    assert _collectives(forward((DST,)), x) == [("all-gather", 4 * int(np.prod(SHAPE)))]

    # backward: the cotangent arrives in the reader's spec and goes back to the producer's along the path
    def backward(chain):
        def f(v, ct):
            _, pullback = jax.vjp(lambda y: two_way_pin(y, (DST,), chain, mesh), v)
            return pullback(ct)[0]
        return f

    def compiled(chain):
        shardings = (named_sharding(SRC, mesh), named_sharding(DST, mesh))
        fn = jax.jit(backward(chain), in_shardings=shardings, out_shardings=shardings[0])
        return _read(fn.lower(x, x).compile())

    assert back.path
    assert compiled((DST, *back.path, SRC)) == _priced(back)
    assert compiled((DST, SRC)) != _priced(back)  # left to itself XLA moves it its own way


def test_a_layout_the_runtime_shape_does_not_divide_is_left_out():
    """At the runtime's microbatch a layout may not divide the shape: an intermediate one is dropped, and a
    pin whose own layouts (the reader's input and gradient specs) do not divide it is left to XLA."""
    sizes = {"x": 2, "y": 2}
    ahead = (Spec(((), ("x", "y"))), Spec((("x",), ())))
    assert fitted_edge_pin((ahead, (Spec((("x",), ())),)), 0, (4, 2), sizes) == (
        (Spec((("x",), ())),), (Spec((("x",), ())),))
    assert fitted_edge_pin((ahead, (Spec((("x",), ())),)), 0, (3, 4), sizes) is None
    # a maker's pin: its own layouts are the forward's first and the cotangent's last
    assert fitted_edge_pin(((Spec((("x",), ())),), (Spec(((), ("y",))), Spec((("x",), ())))), 1, (4, 3),
                           sizes) == ((Spec((("x",), ())),), (Spec((("x",), ())),))
