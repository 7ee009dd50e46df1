"""Resharding costs: hand-worked cases on a (2, 4) cpu-8 mesh, a lower bound, and a shard simulation.

On the cpu-8 preset every axis of a (2, 4) mesh uses the shared-memory link:
B = 10 GB/s, a = 10 us. The array is f32[1024, 2048]: T = 8 MiB.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from autoshard.ir.spec import Spec
from autoshard.meshes.cluster import get_cluster
from autoshard.meshes.logical import LogicalMesh, make_logical_mesh
from autoshard.passes import resharding
from autoshard.passes.resharding import Reshard, reshard, reshard_cost_matrix, spec_options

SHAPE = (1024, 2048)
T = 1024 * 2048 * 4
B = 10e9
A = 10e-6


def spec(text: str) -> Spec:
    """'x,y;' -> S(x,y)R: dimensions separated by ';', axes by ','."""
    return Spec(tuple(tuple(a for a in d.split(",") if a) for d in text.split(";")))


@pytest.fixture(scope="module")
def mesh() -> LogicalMesh:
    return make_logical_mesh(get_cluster("cpu-8"), (2, 4))


def kinds(r: Reshard) -> list[tuple[str, tuple[str, ...], float]]:
    return [(c.kind, c.axes, c.nbytes) for c in r.collectives]


# ----------------------------------------------------------------------------- hand-worked cases

HAND = [
    # (src, dst, collectives, seconds), worked out from the alpha-beta formulas
    ("x;", "x;", [], 0.0),
    (";", "x,y;", [], 0.0),  # more shards: a local slice
    ("x;", "x;y", [], 0.0),
    ("x;", ";", [("all-gather", ("x",), T)], 1 / 2 * T / B + A),
    ("x,y;", "x;", [("all-gather", ("y",), T / 2)], 3 / 4 * (T / 2) / B + 3 * A),
    # both dims gathered: one all-gather per dim, the last first (as XLA does), receiving 7/8 of T
    ("x;y", ";", [("all-gather", ("y",), T / 2), ("all-gather", ("x",), T)],
     3 / 4 * (T / 2) / B + 3 * A + 1 / 2 * T / B + A),
    # one dim: one all-gather over both axes
    ("y,x;", ";", [("all-gather", ("x", "y"), T)], 7 / 8 * T / B + 4 * A),
    # an axis moving between dims is an all-to-all of the shard (what XLA emits)
    ("x;", ";x", [("all-to-all", ("x",), T / 2)], 1 / 2 * (T / 2) / B + A),
    # y is sliced first, so the all-gather of x only builds the target shard
    ("x;", ";y", [("all-gather", ("x",), T / 4)], 1 / 2 * (T / 4) / B + A),
    # each target tile lies in one source tile: slice, then one permute of the target shard (XLA's way)
    ("x;", "y;", [("collective-permute", ("x", "y"), T / 4)], T / 4 / B + A),
    ("x,y;", "y,x;", [("collective-permute", ("x", "y"), T / 8)], T / 8 / B + A),
    # both axes move together: one direct all-to-all over 8 devices beats two exchanges
    # (7/8 * T/8 / B + 7a < (1/2 + 3/4) * T/8 / B + 4a)
    ("x,y;", ";x,y", [("all-to-all", ("x", "y"), T / 8)], 7 / 8 * (T / 8) / B + 7 * A),
    # x moves into RS(y,x), then a permute to RS(x,y): 1.5 * T/8 / B + 2a (gathering y costs 5/8 T/B)
    ("x;y", ";x,y", [("all-to-all", ("x",), T / 8), ("collective-permute", ("x", "y"), T / 8)],
     1 / 2 * (T / 8) / B + A + T / 8 / B + A),
    # a permute to S(y,x)R, then an all-gather of x
    ("x,y;", "y;", [("collective-permute", ("x", "y"), T / 8), ("all-gather", ("x",), T / 4)],
     T / 8 / B + A + 1 / 2 * (T / 4) / B + A),
]


@pytest.mark.parametrize("src,dst,expected,seconds", HAND,
                         ids=[f"{spec(s)}->{spec(d)}" for s, d, _, _ in HAND])
def test_hand_worked(mesh, src, dst, expected, seconds):
    r = reshard(SHAPE, 4, spec(src), spec(dst), mesh)
    assert kinds(r) == expected
    assert r.seconds == pytest.approx(seconds, rel=1e-12)
    assert r.is_free == (not expected)


@pytest.mark.parametrize("src,dst,path", [
    ("x;", ";", ""),
    ("x;", ";y", "x;y"),  # slice y first: the gather builds only the target shard
    # permute to S(y,x)R, all-to-all x to S(y)S(x), gather y: 9/16 T/B, less than gathering y first
    # (5/8 T/B, the plan for a small array); left alone, XLA gathers all of it here
    ("x,y;", ";x", "y,x;|y;x"),
    ("x;y", ";x,y", ";y,x"),
    ("x,y;", "y;", "y,x;"),
    # the two dimensions trade x and y (|y| = 2 |x|): XLA moves half of y with an all-to-all and relabels the
    # rest with a permute, through a layout on a sub-axis of y that no Spec names: nothing to pin
    ("x;y", "y;x", ""),
])
def test_path_lists_the_layouts_to_pin(mesh, src, dst, path):
    r = reshard(SHAPE, 4, spec(src), spec(dst), mesh)
    assert r.path == tuple(spec(p) for p in path.split("|") if p)


@pytest.mark.parametrize("src,dst", [("x;y", "y;x"), ("y;x", "x;y")])
def test_two_dimensions_trading_their_axes_is_an_all_to_all_and_a_permute_of_the_shard(mesh, src, dst):
    """Candidate 4, as XLA:CPU compiles S(x)S(y) -> S(y)S(x) unpinned on a (2, 4) mesh ([1024, 2048] f32: an
    all-to-all of two [1, 256, 512] pieces over half of y, then a permute of the [256, 1024] shard), where a
    whole-axis plan gathers x first (a 4 MiB result, then a 2 MiB all-to-all)."""
    r = reshard(SHAPE, 4, spec(src), spec(dst), mesh)
    shard = SHAPE[0] * SHAPE[1] * 4 / 8
    assert kinds(r) == [("all-to-all", ("y",), shard), ("collective-permute", ("x", "y"), shard)]
    assert r.path == ()


def test_small_arrays_take_fewer_collectives(mesh):
    # on 32 KiB the latency terms dominate: gather y, then one all-to-all of x
    r = reshard((64, 128), 4, spec("x,y;"), spec(";x"), mesh)
    assert kinds(r) == [("all-gather", ("y",), 2**14), ("all-to-all", ("x",), 2**14)]
    assert r.path == (spec("x;"),)


def test_size_one_axes_split_nothing():
    mesh = make_logical_mesh(get_cluster("cpu-8"), (1, 8))
    assert reshard(SHAPE, 4, spec("x,y;"), spec("y;"), mesh).is_free
    assert kinds(reshard(SHAPE, 4, spec("x;y"), spec(";x"), mesh)) == [("all-gather", ("y",), T)]


def test_padding_counts_the_padded_result(mesh):
    # 10 rows over y=4: shards of 3 rows, the all-gather result is the padded 12 rows
    r = reshard((10, 16), 4, spec("y;"), spec(";"), mesh)
    assert kinds(r) == [("all-gather", ("y",), 12 * 16 * 4)]


def test_bad_specs_say_what_is_wrong(mesh):
    with pytest.raises(ValueError, match="rank"):
        reshard(SHAPE, 4, spec("x;;"), spec(";"), mesh)
    with pytest.raises(ValueError, match="does not have"):
        reshard(SHAPE, 4, spec("q;"), spec(";"), mesh)
    with pytest.raises(ValueError, match="twice"):
        reshard(SHAPE, 4, spec("x;x"), spec(";"), mesh)


def test_str(mesh):
    assert str(reshard(SHAPE, 4, spec("x;"), spec("x;y"), mesh)) == "free"
    assert str(reshard(SHAPE, 4, spec("x;"), spec(";"), mesh)).startswith("all-gather[x](")


# ----------------------------------------------------------------------------- the cost matrix


def test_cost_matrix(mesh):
    options = spec_options(SHAPE, mesh)
    m = reshard_cost_matrix(SHAPE, 4, options, options, mesh)
    assert m.shape == (len(options), len(options))
    assert np.all(np.diag(m) == 0.0) and np.all(m >= 0.0)
    for i, j in [(0, 1), (1, 0), (3, 5), (len(options) - 1, 2)]:
        assert m[i, j] == reshard(SHAPE, 4, options[i], options[j], mesh).seconds
    assert reshard_cost_matrix(SHAPE, 4, tuple(options), list(options), mesh) is m  # cached
    with pytest.raises(ValueError):
        m[0, 0] = 1.0  # read-only: the cache hands the same array to every caller
    rect = reshard_cost_matrix(SHAPE, 4, options[:3], options[:5], mesh)
    assert rect.shape == (3, 5) and np.array_equal(rect, m[:3, :5])
    assert reshard_cost_matrix(SHAPE, 4, [], options, mesh).shape == (0, len(options))


# ----------------------------------------------------------------------------- soundness


def _blocks(layout: Spec, mesh: LogicalMesh, fine: int) -> list[tuple[tuple[int, int], ...]]:
    """Per device (row-major over the mesh), the per-dim fine-grid interval it holds."""
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    out = []
    for coords in itertools.product(*(range(n) for n in mesh.shape)):
        at = dict(zip(mesh.axis_names, coords))
        dims = []
        for axes in layout.dims:
            index, count = 0, 1
            for a in axes:
                index, count = index * sizes[a] + at[a], count * sizes[a]
            dims.append((index * fine // count, (index + 1) * fine // count))
        out.append(tuple(dims))
    return out


def lower_bound_s(shape, dtype_bytes, src: Spec, dst: Spec, mesh: LogicalMesh) -> float:
    """(bytes some device lacks) / (fastest link) + one latency: no algorithm can beat it."""
    fine = mesh.num_devices
    cell = dtype_bytes * float(np.prod(shape)) / fine ** len(shape)
    missing = 0.0
    for have, want in zip(_blocks(src, mesh, fine), _blocks(dst, mesh, fine)):
        need = np.prod([hi - lo for lo, hi in want])
        overlap = np.prod([max(0, min(h1, w1) - max(h0, w0)) for (h0, h1), (w0, w1) in zip(have, want)])
        missing = max(missing, (need - overlap) * cell)
    if missing == 0:
        return 0.0
    links = [a.link for a in mesh.axes if a.size > 1]
    return (missing / max(link.bandwidth_bytes_per_s for link in links)
            + min(link.latency_s for link in links))


CASES = [  # (cluster, mesh shape, array shape)
    ("cpu-8", (2, 4), (1024, 2048)),
    ("cpu-8", (2, 4), (16, 32)),  # latency-bound
    ("cpu-8", (2, 4), (64, 32, 128)),
    ("cpu-8", (2, 2, 2), (64, 128)),
    ("2x8-a100", (2, 8), (256, 512)),  # x crosses nodes
]


@pytest.mark.parametrize("cluster,mesh_shape,shape", CASES)
def test_never_below_the_lower_bound_nor_above_gather_all(cluster, mesh_shape, shape):
    mesh = make_logical_mesh(get_cluster(cluster), mesh_shape)
    options = spec_options(shape, mesh, max_split_dims=len(shape))
    m = reshard_cost_matrix(shape, 2, options, options, mesh)
    replicated = Spec.replicated(len(shape))
    assert options[0] == replicated
    for i, src in enumerate(options):
        to_replicated = reshard(shape, 2, src, replicated, mesh).seconds
        for j, dst in enumerate(options):
            assert m[i, j] >= lower_bound_s(shape, 2, src, dst, mesh) * (1 - 1e-12), f"{src} -> {dst}"
            # triangle: never dearer than gathering everything, then slicing for free
            assert m[i, j] <= to_replicated * (1 + 1e-12) + reshard(shape, 2, replicated, dst, mesh).seconds
            assert reshard(shape, 2, replicated, dst, mesh).is_free


@pytest.mark.parametrize("mesh_shape,rank", [((2, 4), 2), ((2, 2, 2), 2), ((2, 4), 3)])
def test_every_candidate_plan_is_a_real_algorithm(mesh_shape, rank):
    """Simulate shards: every step of every candidate moves data its group really holds."""
    mesh = make_logical_mesh(get_cluster("cpu-8"), mesh_shape)
    shape = (64,) * rank
    fine = mesh.num_devices
    ctx = resharding._context(shape, 4, mesh)
    coords = list(itertools.product(*(range(n) for n in mesh.shape)))
    options = [ctx.layout(s, "s") for s in spec_options(shape, mesh, max_split_dims=rank)]

    @functools.cache
    def tiles(layout) -> list[tuple[int, ...]]:  # per device, the index of the tile it holds
        counts = ctx.counts(layout)
        return [tuple(lo * n // fine for (lo, _), n in zip(rect, counts))
                for rect in _blocks(Spec(layout), mesh, fine)]

    @functools.cache
    def needs(after, before) -> list[set[tuple[int, ...]]]:  # per device, the tiles of ``before`` it needs
        counts = ctx.counts(before)
        return [set(itertools.product(*(range(lo * n // fine, -(-hi * n // fine))
                                        for (lo, hi), n in zip(rect, counts))))
                for rect in _blocks(Spec(after), mesh, fine)]

    @functools.cache
    def groups(axes) -> list[list[int]]:  # per device, the devices that differ from it only along ``axes``
        fixed = [i for i, n in enumerate(mesh.axis_names) if n not in axes]
        return [[e for e, c in enumerate(coords) if all(c[i] == cd[i] for i in fixed)] for cd in coords]

    def refines(a, b) -> bool:  # b is a (free) local slice of a
        return all(db[: len(da)] == da for da, db in zip(a, b))

    checked = 0
    for src in options:
        for dst in options:
            if src == dst:
                continue
            for plan in resharding._raw_plans(src, dst):
                layout = src
                for kind, axes, before, after in plan:
                    assert refines(layout, before), (src, dst, plan)
                    held, wanted = tiles(before), needs(after, before)
                    for d in range(len(coords)):
                        if kind == "collective-permute":  # one message: a single device holds it all
                            assert len(wanted[d]) == 1 and next(iter(wanted[d])) in held, (src, dst, plan)
                        else:  # all-gather / all-to-all: the group holds it
                            assert wanted[d] <= {held[e] for e in groups(axes)[d]}, (src, dst, plan, kind)
                    layout = after
                    checked += 1
                assert refines(layout, dst), (src, dst, plan)
    assert checked > 100


# ----------------------------------------------------------------------------- spec_options


@pytest.mark.parametrize("mesh_shape,shape", [((2, 4), (1024, 2048)), ((2, 4), (6, 3, 8)), ((2, 2, 2), (4, 8, 16, 2)),
                                              ((2, 3), (6, 9)), ((8,), (7, 16)), ((1, 8), (16,))])
def test_spec_options(mesh_shape, shape):
    mesh = make_logical_mesh(get_cluster("cpu-8", num_devices=int(np.prod(mesh_shape))), mesh_shape)
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    options = spec_options(shape, mesh)
    assert options[0] == Spec.replicated(len(shape))
    assert len(set(options)) == len(options)
    assert len(options) <= 101
    for s in options:
        assert s.divides(shape, sizes), s
        assert len(set(s.used_axes)) == len(s.used_axes)
        assert sum(1 for d in s.dims if d) <= 2
        for d in s.dims:
            assert list(d) == sorted(d, key=mesh.axis_names.index)
        assert all(sizes[a] > 1 for a in s.used_axes)
    # every dividing single-axis split is offered
    for dim, size in enumerate(shape):
        for name, n in sizes.items():
            if n > 1 and size % n == 0:
                assert Spec(tuple((name,) if k == dim else () for k in range(len(shape)))) in options


def test_spec_options_counts(mesh):
    assert len(spec_options((1024, 2048), mesh)) == 9  # {R, S(x), S(y), S(x,y)} x 2 dims, no reuse
    assert spec_options((3, 5), mesh) == [Spec(((), ()))]  # nothing divides
    assert spec_options((), mesh) == [Spec(())]
    assert len(spec_options((8, 8, 8, 8), make_logical_mesh(get_cluster("cpu-8"), (2, 2, 2)))) == 101
    assert len(spec_options((8, 8, 8), mesh, max_split_dims=1)) == 1 + 3 * 3
