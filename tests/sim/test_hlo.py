"""autoshard.compiler.hlo on real XLA:CPU output (8 simulated devices, a (2,4) mesh x × y).

Every expected byte count is worked out by hand from the shapes in a comment:
per-device shapes, f32 = 4 bytes. Group sizes: axis y has 4 devices (2 groups),
axis x has 2 (4 groups), both together 8 (1 group).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from autoshard.compiler.hlo import (
    HloCollective,
    collective_bytes_by_kind,
    read_hlo_collectives,
    shape_nbytes,
    summarize_compiled,
)
from autoshard.compiler.hlo_parse import group_size_of
from compiled_examples import FAST_COMPILE


@pytest.fixture(scope="module")
def mesh(devices8):
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _compile(mesh, fn, args, in_specs, out_spec, compiler_options=FAST_COMPILE):
    """Compiled for reading its collectives (``FAST_COMPILE``: the same collectives); pass None where a test
    reads memory or cost figures."""
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    out = jax.tree.map(shard, out_spec, is_leaf=lambda s: isinstance(s, P))
    jitted = jax.jit(fn, in_shardings=tuple(map(shard, in_specs)), out_shardings=out, compiler_options=compiler_options)
    return jitted.lower(*args).compile()


def _only(compiled) -> HloCollective:
    found = read_hlo_collectives(compiled.as_text())
    assert len(found) == 1, [c.text for c in found]
    return found[0]


def _matmul(a, b):
    return a @ b


X = jnp.ones((16, 32), jnp.float32)
W = jnp.ones((32, 64), jnp.float32)


# ----------------------------------------------------------------------------- one test per kind


@pytest.mark.parametrize("dtype,itemsize", [(jnp.float32, 4), (jnp.int32, 4), (jnp.int8, 1), (jnp.float16, 2),
                                            (jnp.bool_, 1), (jnp.uint32, 4)])
def test_all_gather_bytes_are_the_result(mesh, dtype, itemsize):
    # [16,32] rows split over y (local [4,32]) → replicated: gather over y, result [16,32].
    c = _only(_compile(mesh, lambda a: a, (jnp.ones((16, 32), dtype),), [P("y", None)], P()))
    assert (c.kind, c.nbytes, c.group_size, c.num_groups, c.count) == ("all-gather", 16 * 32 * itemsize, 4, 2, 1)


def test_all_reduce_of_a_split_contraction(mesh):
    # [16,32]@[32,64], contracting dim over y → partial [16,64] summed over y: 16*64*4 B.
    c = _only(_compile(mesh, _matmul, (X, W), [P(None, "y"), P("y", None)], P()))
    assert (c.kind, c.nbytes, c.group_size, c.num_groups, c.count) == ("all-reduce", 16 * 64 * 4, 4, 2, 1)


@pytest.mark.parametrize("axes,group,groups", [("x", 2, 4), (("x", "y"), 8, 1)])
def test_all_reduce_group_follows_the_mesh_axes(mesh, axes, group, groups):
    c = _only(_compile(mesh, _matmul, (X, W), [P(None, axes), P(axes, None)], P()))
    assert (c.kind, c.nbytes, c.group_size, c.num_groups) == ("all-reduce", 16 * 64 * 4, group, groups)


def test_variadic_all_reduce_sums_its_operands(mesh):
    # Two [16,64] partial sums over y, combined by XLA into one tuple all-reduce: 2*16*64*4 B.
    fn = lambda a, b, c: (a @ b, a @ c)  # noqa: E731
    c = _only(_compile(mesh, fn, (X, W, W), [P(None, "y"), P("y", None), P("y", None)], (P(), P())))
    assert c.text.split("=", 1)[1].lstrip().startswith("(")  # really a tuple all-reduce
    assert (c.kind, c.nbytes, c.group_size) == ("all-reduce", 2 * 16 * 64 * 4, 4)


def test_reduce_scatter_is_recognised_from_all_reduce_and_dynamic_slice(mesh):
    # Partial [16,64] over y, output columns split over y: XLA:CPU all-reduces [16,64] and
    # dynamic-slices [16,16]. That is a reduce-scatter whose operand is 16*64*4 B.
    compiled = _compile(mesh, _matmul, (X, W), [P(None, "y"), P("y", None)], P(None, "y"))
    text = compiled.as_text()
    assert " all-reduce(" in text and "reduce-scatter" not in text  # what XLA:CPU really emits
    c = _only(compiled)
    assert (c.kind, c.nbytes, c.group_size, c.num_groups) == ("reduce-scatter", 16 * 64 * 4, 4, 2)
    assert " all-reduce(" in c.text


def test_all_to_all_bytes_are_the_buffer(mesh):
    # [16,32] rows over y (local [4,32] = 512 B) resharded to columns over y: one all-to-all of
    # the whole local buffer (XLA:CPU splits it into a 4-tuple of [4,1,8]).
    fn = lambda a: jax.lax.with_sharding_constraint(a * 2, NamedSharding(mesh, P(None, "y"))) + 1  # noqa: E731
    c = _only(_compile(mesh, fn, (X,), [P("y", None)], P(None, "y")))
    assert (c.kind, c.nbytes, c.group_size, c.num_groups) == ("all-to-all", 4 * 32 * 4, 4, 2)


def test_collective_permute_of_a_roll(mesh):
    # roll by one row of [16,32] split over y: each device sends one row [1,32] = 128 B around
    # a ring of the 4 devices of its y group: two rings.
    fn = lambda a: jnp.roll(a, 1, axis=0)  # noqa: E731
    c = _only(_compile(mesh, fn, (X,), [P("y", None)], P("y", None)))
    assert (c.kind, c.nbytes, c.group_size, c.num_groups, c.count) == ("collective-permute", 128, 4, 2, 1)


# ----------------------------------------------------------------------------- loops


def _scan_sum(a, v, length):
    def body(v, _):
        return v + jnp.tanh(a * v).sum(0), None  # sum over rows split over y: all-reduce f32[32]

    return jax.lax.scan(body, v, None, length=length)[0]


def test_all_reduce_inside_a_scan_runs_trip_count_times(mesh):
    compiled = _compile(mesh, lambda a, v: _scan_sum(a, v, 4), (X, jnp.ones(32)), [P("y", None), P()], P())
    assert '"known_trip_count":{"n":"4"}' in compiled.as_text()
    c = _only(compiled)
    assert (c.kind, c.nbytes, c.group_size, c.count) == ("all-reduce", 32 * 4, 4, 4)
    assert collective_bytes_by_kind([c])["all-reduce"] == 4 * 32 * 4


def _nested(a, v):
    return jax.lax.scan(lambda v, _: (_scan_sum(a, v, 3), None), v, None, length=2)[0]


def test_nested_loops_multiply(mesh):
    compiled = _compile(mesh, _nested, (X, jnp.ones(32)), [P("y", None), P()], P())
    c = _only(compiled)
    assert (c.kind, c.count) == ("all-reduce", 2 * 3)
    # Without XLA's known_trip_count the counts come from the loop conditions.
    stripped = re.sub(r', backend_config=\{"dynamic_variables".*', "", compiled.as_text())
    assert "known_trip_count" not in stripped
    assert [c.count for c in read_hlo_collectives(stripped)] == [6]


# ----------------------------------------------------------------------------- memory and flops


def test_summarize_compiled_reads_memory_and_flops(mesh):
    compiled = _compile(mesh, _matmul, (X, W), [P(None, "y"), P("y", None)], P(None, "y"), compiler_options=None)
    summary = summarize_compiled(compiled)
    mem = compiled.memory_analysis()
    # Arguments: [16,8] + [8,64] f32 per device; output [16,16] f32.
    assert summary.argument_bytes == mem.argument_size_in_bytes == (16 * 8 + 8 * 64) * 4
    assert summary.output_bytes == mem.output_size_in_bytes == 16 * 16 * 4
    assert summary.temp_bytes == mem.temp_size_in_bytes
    assert summary.peak_bytes == (summary.argument_bytes + summary.output_bytes
                                  - summary.alias_bytes + summary.temp_bytes)
    assert summary.flops is not None and summary.flops >= 2 * 16 * 8 * 64  # local matmul
    assert summary.bytes_by_kind == {"all-reduce": 0.0, "all-gather": 0.0, "reduce-scatter": 16 * 64 * 4.0,
                                     "all-to-all": 0.0, "collective-permute": 0.0}


# ----------------------------------------------------------------------------- hand-written HLO


@pytest.mark.parametrize("text,expected", [
    ("{{0,4},{1,5},{2,6},{3,7}}", (2, 4)),
    ("{{0,1,2,3},{4,5,6,7}}", (4, 2)),
    ("[2,4]<=[8]", (4, 2)),
    ("[4,2]<=[2,4]T(1,0)", (2, 4)),
    ("[1,8]<=[8]", (8, 1)),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", (4, 2)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", (4, 2)),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", (4, 2)),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", (2, 4)),
    ("mesh[a=2,b=4] {a,b}", (8, 1)),
    ("mesh['a'=8] {'a':(2)2}", (2, 4)),
])
def test_replica_group_spellings(text, expected):
    assert group_size_of(text) == expected


def test_empty_replica_groups_mean_all_devices():
    assert group_size_of("{}", num_devices=8) == (8, 1)
    with pytest.raises(ValueError, match="num_devices"):
        group_size_of("{}")


def test_shape_bytes_with_tuples_dtypes_and_layouts():
    assert shape_nbytes("f32[16,64]{1,0}") == 4096
    assert shape_nbytes("(bf16[8,32]{1,0}, s32[], pred[3]{0})") == 8 * 32 * 2 + 4 + 3
    assert shape_nbytes("(f32[4,1,8]{2,1,0}, f32[4,1,8]{2,1,0})") == 2 * 32 * 4
    assert shape_nbytes("u8[7]{0:T(8)}") == 7 and shape_nbytes("f16[<=10]") == 20
    assert shape_nbytes("s4[16]") == 8 and shape_nbytes("f64[2]") == 16 and shape_nbytes("token[]") == 0


ASYNC_HLO = """\
HloModule async_snippet, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p0: f32[64,32]) -> f32[16,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[16,32]{1,0} reduce-scatter(%p0), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (p: bf16[8,32], q: f32[16,64], r: f32[1,32], s: f32[64,32]) -> (bf16[16,32], f32[16,64], f32[1,32], f32[16,32]) {
  %p = bf16[8,32]{1,0} parameter(0)
  %q = f32[16,64]{1,0} parameter(1)
  %r = f32[1,32]{1,0} parameter(2)
  %s = f32[64,32]{1,0} parameter(3)
  %all-gather-start = (bf16[8,32]{1,0}, bf16[16,32]{1,0}) all-gather-start(bf16[8,32]{1,0} %p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %all-reduce-start = f32[16,64]{1,0} all-reduce-start(%q), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add, backend_config={"is_sync":false}
  %collective-permute-start = (f32[1,32]{1,0}, f32[1,32]{1,0}, u32[], u32[]) collective-permute-start(%r), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %reduce-scatter-start = ((f32[64,32]{1,0}), f32[16,32]{1,0}) async-start(%s), calls=%wrapped_reduce_scatter
  %all-gather-done = bf16[16,32]{1,0} all-gather-done((bf16[8,32]{1,0}, bf16[16,32]{1,0}) %all-gather-start)
  %all-reduce-done = f32[16,64]{1,0} all-reduce-done(%all-reduce-start)
  %collective-permute-done = f32[1,32]{1,0} collective-permute-done(%collective-permute-start)
  %reduce-scatter-done = f32[16,32]{1,0} async-done(%reduce-scatter-start), calls=%wrapped_reduce_scatter
  ROOT %t = (bf16[16,32]{1,0}, f32[16,64]{1,0}, f32[1,32]{1,0}, f32[16,32]{1,0}) tuple(%all-gather-done, %all-reduce-done, %collective-permute-done, %reduce-scatter-done)
}
"""


def test_async_start_done_pairs_count_once():
    found = {c.kind: c for c in read_hlo_collectives(ASYNC_HLO)}
    assert len(read_hlo_collectives(ASYNC_HLO)) == 4
    summary = {k: (c.nbytes, c.group_size, c.num_groups, c.count) for k, c in found.items()}
    assert summary == {
        "all-gather": (16 * 32 * 2, 2, 4, 1),  # bf16 result of the done
        "all-reduce": (16 * 64 * 4, 4, 2, 1),
        "collective-permute": (32 * 4, 2, 2, 1),  # two 2-device rings
        "reduce-scatter": (64 * 32 * 4, 4, 2, 1),  # its operand, counted inside the async computation
    }
    assert found["all-gather"].text.startswith("%all-gather-start")


LOOP_HLO = """\
HloModule loops, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner_body (ib: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ib = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%ib), index=0
  %v = f32[8]{0} get-tuple-element(%ib), index=1
  %ar = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={}, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8]{0}) tuple(%next, %ar)
}

%inner_cond (ic: (s32[], f32[8])) -> pred[] {
  %ic = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%ic), index=0
  %limit = s32[] constant(3)
  ROOT %le = pred[] compare(%j, %limit), direction=LE
}

%outer_body (ob: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ob = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] get-tuple-element(%ob), index=0
  %w = f32[8]{0} get-tuple-element(%ob), index=1
  %start = s32[] constant(1)
  %init = (s32[], f32[8]{0}) tuple(%start, %w)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%inner_cond, body=%inner_body
  %w2 = f32[8]{0} get-tuple-element(%loop), index=1
  %one.1 = s32[] constant(1)
  %k2 = s32[] add(%k, %one.1)
  ROOT %r = (s32[], f32[8]{0}) tuple(%k2, %w2)
}

%outer_cond (oc: (s32[], f32[8])) -> pred[] {
  %oc = (s32[], f32[8]{0}) parameter(0)
  %kk = s32[] get-tuple-element(%oc), index=0
  %n = s32[] constant(5)
  ROOT %gt = pred[] compare(%n, %kk), direction=GT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(%zero, %a)
  %wl = (s32[], f32[8]{0}) while(%t), condition=%outer_cond, body=%outer_body
  ROOT %res = f32[8]{0} get-tuple-element(%wl), index=1
}
"""


def test_trip_counts_from_loop_conditions():
    # inner: i = 1; i <= 3 → 3 trips; outer: 5 > k from k = 0 → 5 trips; {} = all 4 devices.
    (c,) = read_hlo_collectives(LOOP_HLO)
    assert (c.kind, c.nbytes, c.group_size, c.num_groups, c.count) == ("all-reduce", 32, 4, 1, 15)
    known = LOOP_HLO.replace("body=%outer_body", 'body=%outer_body, backend_config={"known_trip_count":{"n":"7"}}')
    assert read_hlo_collectives(known)[0].count == 21


SLICE_HLO = """\
HloModule slices, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_slice (p0: f32[16,64], p1: s32[]) -> f32[16,COLS] {
  %p0 = f32[16,64]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %b = f32[16,64]{1,0} bitcast(%p0)
  ROOT %ds = f32[16,COLS]{1,0} dynamic-slice(%b, %zero, %p1), dynamic_slice_sizes={16,COLS}
}

ENTRY %main (a: f32[16,64], o: s32[]) -> f32[16,COLS] {
  %a = f32[16,64]{1,0} parameter(0)
  %o = s32[] parameter(1)
  %ar = f32[16,64]{1,0} all-reduce(%a), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  %c = f32[16,64]{1,0} copy(%ar)
  FUSION%f = f32[16,COLS]{1,0} fusion(%c, %o), kind=kLoop, calls=%fused_slice
  TAIL
}
"""


@pytest.mark.parametrize("cols,extra_use,kind", [
    (16, False, "reduce-scatter"),  # keeps 64/4 columns: a reduce-scatter over 4 devices
    (32, False, "all-reduce"),  # keeps half: not a shard of a 4-device group
    (16, True, "all-reduce"),  # the full sum is used too
])
def test_reduce_scatter_recognition_on_hand_written_hlo(cols, extra_use, kind):
    tail = "ROOT %t = (f32[16,COLS]{1,0}, f32[16,64]{1,0}) tuple(%f, %ar)" if extra_use else ""
    text = SLICE_HLO.replace("FUSION", "" if extra_use else "ROOT ").replace("TAIL", tail)
    text = text.replace("COLS", str(cols))
    (c,) = read_hlo_collectives(text)
    assert (c.kind, c.nbytes, c.group_size, c.num_groups) == (kind, 16 * 64 * 4, 4, 1)


# ----------------------------------------------------------------------------- bytes accessed of loop bodies

STACK = jnp.ones((8, 128, 128), jnp.float32)  # 8 layers of weights: 512 KiB, read one layer per iteration
ACTS = jnp.ones((4, 128), jnp.float32)


def _scanned_layers(stack, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, stack)[0]


def _unrolled_layers(stack, x):
    for w in stack:
        x = jnp.tanh(x @ w)
    return x


def test_loop_body_bytes_are_counted_as_xla_counts_them():
    """cost_analysis() counts a while body once and a dynamic-slice of the stacked weights as one layer; the
    reader prices each instruction the same way (so the whole program, counted once, is what XLA says), and the
    scanned program's bytes with the body times its trip count are the unrolled program's, not eight stacks."""
    from autoshard.compiler.hlo_bytes import xla_instruction_bytes
    from autoshard.compiler.hlo_parse import parse_module
    scanned = jax.jit(_scanned_layers).lower(STACK, ACTS).compile()
    module = parse_module(scanned.as_text())
    fused = {i.attrs.get("calls", "").lstrip("%") for c in module.computations.values()
             for i in c.instructions.values() if i.opcode == "fusion"}
    once = sum(xla_instruction_bytes(module, c, i) for c in module.computations.values() if c.name not in fused
               for i in c.instructions.values())
    raw = scanned.cost_analysis()
    raw = raw[0] if isinstance(raw, (list, tuple)) else raw
    assert once == pytest.approx(float(raw["bytes accessed"]), rel=0.02)
    unrolled = summarize_compiled(jax.jit(_unrolled_layers).lower(STACK, ACTS).compile()).bytes_accessed
    looped = summarize_compiled(scanned).bytes_accessed
    assert looped == pytest.approx(unrolled, rel=0.25), (looped, unrolled)
    # each iteration copies its layer out (read + write) and the dot reads it: 3 stacks, not 8 (whole stack each)
    assert looped < 4 * STACK.nbytes, looped
