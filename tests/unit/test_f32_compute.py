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
