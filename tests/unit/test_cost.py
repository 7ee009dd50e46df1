"""Alpha-beta collectives, roofline compute and logical meshes: hand-computed values and relations."""
from __future__ import annotations

import math

import numpy as np
import pytest
from dataclasses import replace

from autoshard.meshes import cost
from autoshard.meshes.cluster import PRESETS, ClusterSpec, LinkLevel, get_cluster
from autoshard.meshes.logical import factorizations, make_logical_mesh

GIB = 2**30
LINK = LinkLevel("test", 100e9, 5e-6)  # 100 GB/s, 5 us


def one_node(n: int, link: LinkLevel = LINK) -> ClusterSpec:
    return ClusterSpec(name=f"test-{n}", num_nodes=1, devices_per_node=n, intra_node=link,
                       inter_node=LinkLevel("slow", 1e9, 50e-6), peak_flops_per_s={"float32": 1e12},
                       memory_bandwidth_bytes_per_s=1e12, memory_per_device_bytes=16 * GIB)


# ----------------------------------------------------------------------------- hand-computed


def test_all_reduce_of_one_gib_over_8():
    expected = 2 * 7 / 8 * 2**30 / 1e11 + 14 * 5e-6
    assert cost.ring_all_reduce_s(GIB, 8, LINK) == pytest.approx(expected, rel=1e-12)
    mesh = make_logical_mesh(one_node(8), (8,))
    assert cost.all_reduce_s(mesh, "x", GIB) == pytest.approx(expected, rel=1e-12)
    assert cost.all_reduce_s(mesh, ("x",), GIB) == pytest.approx(expected, rel=1e-12)


def test_single_axis_formulas():
    b, n = 3 * GIB, 4
    assert cost.ring_all_gather_s(b, n, LINK) == pytest.approx(3 / 4 * b / 1e11 + 3 * 5e-6)
    assert cost.ring_reduce_scatter_s(b, n, LINK) == pytest.approx(3 / 4 * b / 1e11 + 3 * 5e-6)
    assert cost.ring_all_to_all_s(b, n, LINK) == pytest.approx(3 / 4 * b / 1e11 + 3 * 5e-6)
    assert cost.point_to_point_s(b, LINK) == pytest.approx(b / 1e11 + 5e-6)
    cluster = PRESETS["2x8-a100"]
    assert cost.send_s(cluster, b, cross_node=True) == pytest.approx(b / (25e9 / 8) + 20e-6)
    assert cost.send_s(cluster, b, cross_node=False) == pytest.approx(b / 300e9 + 5e-6)


def test_two_level_all_gather_goes_slowest_first():
    # (2, 8) on 2x8-a100: x crosses nodes (25 Gbit/s, 20 us), y stays on NVLink (300 GB/s, 5 us).
    # Gather over x first while the buffer is b/8, then over y to b.
    mesh = make_logical_mesh(PRESETS["2x8-a100"], (2, 8))
    b = GIB
    expected = (1 / 2 * (b / 8) / (25e9 / 8) + 20e-6) + (7 / 8 * b / 300e9 + 7 * 5e-6)
    assert cost.all_gather_s(mesh, ("x", "y"), b) == pytest.approx(expected, rel=1e-12)
    assert cost.all_gather_s(mesh, ("y", "x"), b) == pytest.approx(expected, rel=1e-12)
    # reduce-scatter mirrors it: over y first on the full buffer, then x on b/8
    assert cost.reduce_scatter_s(mesh, ("x", "y"), b) == pytest.approx(expected, rel=1e-12)


def test_all_to_all_over_two_axes_is_the_cheaper_algorithm():
    mesh = make_logical_mesh(get_cluster("cpu-8"), (2, 4))  # 10 GB/s, 10 us on both axes
    big, small = 8 * 2**20, 64
    hierarchical = lambda b: (1 / 2 + 3 / 4) * b / 10e9 + (1 + 3) * 10e-6  # noqa: E731
    direct = lambda b: 7 / 8 * b / 10e9 + 7 * 10e-6  # noqa: E731
    assert direct(big) < hierarchical(big) and hierarchical(small) < direct(small)
    assert cost.all_to_all_s(mesh, ("x", "y"), big) == pytest.approx(direct(big), rel=1e-12)
    assert cost.all_to_all_s(mesh, ("x", "y"), small) == pytest.approx(hierarchical(small), rel=1e-12)
    # across nodes: direct sends 1/2 of the buffer over the slow link and 3/8 over the fast one
    mesh = make_logical_mesh(PRESETS["2x8-a100"].with_devices(2, 4), (2, 4))
    slow, fast = mesh.axis("x").link, mesh.axis("y").link
    direct = (1 / 2 * big / slow.bandwidth_bytes_per_s + 4 * slow.latency_s
              + 3 / 8 * big / fast.bandwidth_bytes_per_s + 3 * fast.latency_s)
    hierarchical = (1 / 2 * big / slow.bandwidth_bytes_per_s + slow.latency_s
                    + 3 / 4 * big / fast.bandwidth_bytes_per_s + 3 * fast.latency_s)
    assert cost.all_to_all_s(mesh, ("x", "y"), big) == pytest.approx(min(direct, hierarchical), rel=1e-12)


# ----------------------------------------------------------------------------- relations


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(n):
    b = 12345678.0
    assert cost.ring_all_reduce_s(b, n, LINK) == pytest.approx(
        cost.ring_reduce_scatter_s(b, n, LINK) + cost.ring_all_gather_s(b, n, LINK), rel=1e-12)
    # bytes moved: 2(n-1)/n b == (n-1)/n b + (n-1)/n b; take the latency away to compare the bandwidth term
    no_latency = LinkLevel("bw", LINK.bandwidth_bytes_per_s, 0.0)
    assert cost.ring_all_reduce_s(b, n, no_latency) * no_latency.bandwidth_bytes_per_s == pytest.approx(
        2 * (n - 1) / n * b)
    mesh = make_logical_mesh(one_node(n), (n,))
    assert cost.all_reduce_s(mesh, "x", b) == pytest.approx(
        cost.reduce_scatter_s(mesh, "x", b) + cost.all_gather_s(mesh, "x", b), rel=1e-12)


@pytest.mark.parametrize("cluster,shape", [("2x8-a100", (2, 8)), ("cpu-8", (2, 4)), ("4x8-h100", (4, 8)),
                                           ("tpu-v4-32", (4, 4)), ("cpu-8", (2, 2, 2))])
@pytest.mark.parametrize("nbytes", [64.0, 1e6, 1e9])
def test_multi_axis_is_at_most_the_per_axis_sum(cluster, shape, nbytes):
    mesh = make_logical_mesh(get_cluster(cluster), shape)
    axes = mesh.axis_names
    for fn in (cost.all_reduce_s, cost.all_gather_s, cost.reduce_scatter_s, cost.all_to_all_s):
        together = fn(mesh, axes, nbytes)
        assert 0 < together <= sum(fn(mesh, a, nbytes) for a in axes) * (1 + 1e-12), fn.__name__


def test_hierarchical_all_reduce_moves_what_a_flat_ring_moves():
    # one link level, no latency: 2(N-1)/N b either way
    link = LinkLevel("bw", 1e9, 0.0)
    mesh = make_logical_mesh(one_node(8, link), (2, 4))
    assert cost.all_reduce_s(mesh, ("x", "y"), 1e9) == pytest.approx(cost.ring_all_reduce_s(1e9, 8, link))


def test_axis_of_size_one_is_free():
    mesh = make_logical_mesh(one_node(8), (1, 8))
    for fn in (cost.all_reduce_s, cost.all_gather_s, cost.reduce_scatter_s, cost.all_to_all_s):
        assert fn(mesh, "x", GIB) == 0.0
        assert fn(mesh, ("x", "y"), GIB) == fn(mesh, "y", GIB) > 0
        assert fn(mesh, (), GIB) == 0.0
    for fn in (cost.ring_all_reduce_s, cost.ring_all_gather_s, cost.ring_reduce_scatter_s, cost.ring_all_to_all_s):
        assert fn(GIB, 1, LINK) == 0.0
    assert cost.point_to_point_s(0, LINK) == 0.0


# ----------------------------------------------------------------------------- roofline


def test_roofline():
    cluster = one_node(8)  # 1 TFLOP/s, 1 TB/s
    assert cost.roofline_s(cluster, 4e12, 1e9) == pytest.approx(4.0)  # compute-bound
    assert cost.roofline_s(cluster, 1e9, 3e12) == pytest.approx(3.0)  # memory-bound
    a100 = PRESETS["1x8-a100"]
    assert cost.roofline_s(a100, 312e12, 0, "bfloat16") == pytest.approx(1.0)
    assert cost.roofline_s(a100, 156e12, 0, "tfloat32") == pytest.approx(1.0)  # f32 dots on tensor cores
    assert cost.roofline_s(a100, 19.5e12, 0, "float32") == pytest.approx(1.0)
    assert cost.roofline_s(a100, 19.5e12, 0, "int8") == pytest.approx(1.0)  # unknown dtype: float32's rate
    assert cost.roofline_s(PRESETS["cpu-8"], 50e9, 0, "tfloat32") == pytest.approx(1.0)  # no TF32: float32
    flops, hbm = np.array([312e12, 1e9]), np.array([0.0, 4e12])
    np.testing.assert_allclose(cost.roofline_s(a100, flops, hbm, "bfloat16"), [1.0, 2.0])  # one per op


def test_dots_run_at_their_operands_peak_tf32_unless_highest():
    import jax
    import jax.numpy as jnp

    from autoshard.ir.trace import trace
    from autoshard.passes.hbm_traffic import compute_dtype

    f32, bf16 = jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.bfloat16)
    cases = [
        (lambda a, b: a @ b, (f32, f32), "tfloat32"),
        (lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST), (f32, f32), "float32"),
        (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), (bf16, bf16), "bfloat16"),
        (lambda a, b: a + b, (f32, f32), "float32"),
    ]
    for fn, args, want in cases:
        graph = trace(fn, *args)
        op = next(o for o in graph.ops if o.primitive in ("dot_general", "add"))
        assert compute_dtype(op, graph) == want, (op, want)


def test_groups_across_nodes_drive_one_nic_per_member_on_each_node():
    a100 = PRESETS["2x8-a100"]  # 8 GPUs per node, 25 Gbit/s NIC per GPU, NVLink 300 GB/s
    nic, nvlink = a100.inter_node.bandwidth_bytes_per_s, a100.intra_node.bandwidth_bytes_per_s
    one_axis = make_logical_mesh(a100, (16,))
    assert one_axis.axes[0].link.bandwidth_bytes_per_s == pytest.approx(8 * nic)  # 8 members per node: 8 NICs
    two = make_logical_mesh(a100, (2, 8))
    assert two.axis("x").link.bandwidth_bytes_per_s == pytest.approx(nic)  # one member per node: one NIC
    assert two.axis("y").link.bandwidth_bytes_per_s == pytest.approx(nvlink)
    assert two.group_link(("x", "y")).bandwidth_bytes_per_s == pytest.approx(8 * nic)
    assert make_logical_mesh(a100, (4, 4)).axis("x").link.bandwidth_bytes_per_s == pytest.approx(2 * nic)
    fast = replace(a100, inter_node=replace(a100.inter_node, bandwidth_bytes_per_s=100e9))
    assert make_logical_mesh(fast, (16,)).axes[0].link.bandwidth_bytes_per_s == pytest.approx(nvlink)  # capped
    # an all-reduce over both axes takes the cheaper of the flat 8-NIC ring and the hierarchical algorithm
    nbytes = 64e6
    flat = cost.ring_all_reduce_s(nbytes, 16, two.group_link(("x", "y")))
    hierarchical = cost.reduce_scatter_s(two, ("x", "y"), nbytes) + cost.all_gather_s(two, ("x", "y"), nbytes)
    assert cost.all_reduce_s(two, ("x", "y"), nbytes) == pytest.approx(min(flat, hierarchical))
    assert cost.all_reduce_s(one_axis, "x", nbytes) == pytest.approx(flat)


# ----------------------------------------------------------------------------- logical meshes


def test_two_nodes_of_eight():
    mesh = make_logical_mesh(PRESETS["2x8-a100"], (2, 8))
    assert mesh.axis("x").link == PRESETS["2x8-a100"].inter_node  # x joins the two nodes: slow
    assert mesh.axis("y").link == PRESETS["2x8-a100"].intra_node  # y stays in a node: NVLink
    assert cost.all_gather_s(mesh, "x", GIB) > 10 * cost.all_gather_s(mesh, "y", GIB)
    flat = make_logical_mesh(PRESETS["2x8-a100"], (16,))
    assert flat.axis("x").crosses_nodes and flat.axis("x").link.name == "ethernetx8"  # 8 NICs per node
    inside = make_logical_mesh(PRESETS["2x8-a100"], (8,))  # the first node only
    assert inside.axis("x").link == PRESETS["2x8-a100"].intra_node


def test_eight_devices_on_two_nodes_of_four_cross():
    cluster = PRESETS["2x8-a100"].with_devices(2, 4)
    assert cluster.num_devices == 8
    nic = cluster.inter_node.bandwidth_bytes_per_s
    one = make_logical_mesh(cluster, (8,)).axis("x")
    assert one.crosses_nodes and one.link.bandwidth_bytes_per_s == pytest.approx(4 * nic)  # 4 members per node
    mesh = make_logical_mesh(cluster, (2, 4))
    assert (mesh.axis("x").link, mesh.axis("y").link) == (cluster.inter_node, cluster.intra_node)
    mesh = make_logical_mesh(cluster, (4, 2))  # x groups devices 0,2,4,6: two per node; y pairs 0,1: one node
    assert mesh.axis("x").crosses_nodes and not mesh.axis("y").crosses_nodes
    assert mesh.axis("x").link.bandwidth_bytes_per_s == pytest.approx(2 * nic)
    assert mesh.axis("y").link == cluster.intra_node


@pytest.mark.parametrize("shape", [(6,), (2, 3), (3, 2), (1, 6)])
def test_six_devices(shape):
    cluster = get_cluster("cpu-8", num_devices=6)
    assert (cluster.num_nodes, cluster.devices_per_node) == (1, 6)
    mesh = make_logical_mesh(cluster, shape)
    assert mesh.num_devices == 6 and mesh.shape == shape
    assert all(a.link == cluster.intra_node for a in mesh.axes)
    for fn in (cost.all_reduce_s, cost.all_gather_s, cost.reduce_scatter_s, cost.all_to_all_s):
        assert math.isfinite(fn(mesh, mesh.axis_names, 1e6)) and fn(mesh, mesh.axis_names, 1e6) > 0
    assert cost.all_reduce_s(make_logical_mesh(cluster, (6,)), "x", 6e6) == pytest.approx(
        2 * 5 / 6 * 6e6 / 10e9 + 10 * 10e-6)


def test_twelve_devices_on_eight_device_nodes_span_two_nodes():
    cluster = get_cluster("2x8-a100", num_devices=12)
    assert (cluster.num_nodes, cluster.devices_per_node) == (2, 6)
    mesh = make_logical_mesh(cluster, (2, 6))
    assert (mesh.axis("x").link, mesh.axis("y").link) == (cluster.inter_node, cluster.intra_node)
    nic = cluster.inter_node.bandwidth_bytes_per_s
    assert make_logical_mesh(cluster, (12,)).axis("x").link.bandwidth_bytes_per_s == pytest.approx(6 * nic)
    x = make_logical_mesh(cluster, (3, 4)).axis("x")  # x groups 0, 4, 8: nodes 0, 0, 1
    assert x.crosses_nodes and x.link.bandwidth_bytes_per_s == pytest.approx(2 * nic)


def test_mesh_errors():
    cluster = get_cluster("cpu-8")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_logical_mesh(cluster, (4, 4))
    with pytest.raises(ValueError, match="differ in length"):
        make_logical_mesh(cluster, (2, 4), ("x",))
    with pytest.raises(KeyError, match="no axis"):
        make_logical_mesh(cluster, (2, 4)).axis("z")


def test_factorizations():
    assert factorizations(6) == [(6,), (1, 6), (2, 3), (3, 2), (6, 1)]
    assert factorizations(1) == [(1,), (1, 1)]
    assert factorizations(7) == [(7,), (1, 7), (7, 1)]
    found = factorizations(12, max_axes=3)
    assert (2, 2, 3) in found and (12,) in found and len(found) == len(set(found))
    assert all(math.prod(s) == 12 for s in found)
    assert len(factorizations(1024, max_axes=3)) == 1 + 11 + 66  # fast: divisors, not a product of ranges
