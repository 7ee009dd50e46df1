"""Rule 10 of the memory model: a backend without bf16 arithmetic (XLA:CPU) runs a bf16 dot in f32.

Worked by hand on ``tanh(x @ w) @ v`` in bf16 with x [64, 32], w [32, 128], v [128, 16] on one device:
each dot's result buffer is f32 (the first 64*128*4 bytes instead of 64*128*2), the arguments x, w and v
get f32 copies until their dot, and ``tanh``'s output, read only by the second dot, is materialised in f32.
A cluster that computes bf16 natively (``f32_compute_dtypes=()``) sizes everything in bf16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from autoshard.meshes.cluster import PRESETS
from autoshard.ir.trace import trace
from autoshard.passes.memory_model import simulate


def _graph():
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((64, 32), (32, 128), (128, 16))]
    return trace(lambda x, w, v: jnp.tanh(x @ w) @ v, *args)


def test_bf16_dots_hold_f32_buffers_where_the_backend_has_no_bf16():
    graph = _graph()
    assert PRESETS["cpu-8"].f32_compute_dtypes == ("bfloat16", "float16")
    assert PRESETS["1x8-h100"].f32_compute_dtypes == ()
    native = simulate(graph, {}, {})
    widened = simulate(graph, {}, {}, f32_compute_dtypes=("bfloat16",))
    copies = sorted(s.nbytes for s in widened.spans if s.kind == "float32 copy")
    assert copies == sorted([64 * 32 * 4.0, 32 * 128 * 4.0, 128 * 16 * 4.0])
    assert not [s for s in native.spans if s.kind == "float32 copy"]
    first = max(s.nbytes for s in native.spans if s.kind == "activation")
    assert first == 64 * 128 * 2  # x @ w (and tanh of it) in bf16
    assert max(s.nbytes for s in widened.spans if s.kind == "activation") == 64 * 128 * 4
    assert widened.arguments == native.arguments  # arguments keep their storage dtype
    assert widened.profile().max() > native.profile().max()


def _residual_graph():
    """A residual add read by a float32 LayerNorm statistic and by the next add (bf16 math between them), and
    another value that is also a step output (its buffer is the output's: it keeps its dtype)."""
    def step(x, y, z):
        a = jnp.tanh(x + y)  # materialised: read by the reduction and by two adds below
        mean = jnp.mean(a.astype(jnp.float32), axis=-1, keepdims=True)
        b = (a - mean.astype(jnp.bfloat16)) * z
        c = jnp.exp(x * y)
        return (a + b).sum() + c.sum(), c

    args = [jax.ShapeDtypeStruct((64, 32), jnp.bfloat16) for _ in range(3)]
    return trace(step, *args)


def test_narrow_math_read_only_by_narrow_math_stays_float32_on_such_a_backend():
    """Rule 10 between elementwise ops (XLA's excess precision): ``tanh(x + y)`` is computed in float32 and only
    float32 math or an up-convert reads it, so its buffer is float32; ``exp(x * y)`` is a step output and keeps
    its dtype; a bf16-native cluster widens nothing."""
    from autoshard.passes.buffer_rules import excess_precision
    from autoshard.passes.liveness import fusion_analysis

    graph = _residual_graph()
    buffers = fusion_analysis(graph).materialized
    widened = excess_precision(graph, frozenset({"bfloat16"}), buffers)
    producers = {v: op.primitive for op in graph.ops for v in op.outputs}
    assert {producers[v] for v in widened} == {"tanh"}, {producers[v] for v in buffers}
    assert "exp" in {producers[v] for v in buffers}  # materialised (an output), not widened
    assert not excess_precision(graph, frozenset(), buffers)

