"""autoshard on a model family the examples do not have: a Llama-style decoder (RMSNorm, rotary position
embeddings, grouped-query attention, SwiGLU, an untied head, no biases; Flax linen, its projections
``DenseGeneral`` over (heads, head_dim), so the output projection contracts two dims), trained with AdamW.
Every plan ``compare`` makes (autoshard after compiled arbitration, DP, FSDP, ZeRO-2, HSDP, Megatron TP,
DP x TP) is compiled by XLA and priced from its HLO on the cell's cluster.

    python -m benchmarks.llama_style [--cells tiny:1x8-a100:2x4 1b:2x8-a100:2x8 ...] [--time-limit 10]
        [--out llama_style.md]

A cell is ``config:cluster:mesh``; meshes larger than this process's 8 simulated devices compile in a child
process. A row is ok when autoshard's compiled program is at least as fast as the fastest compiled classic
program that fits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.devices import simulate_devices

simulate_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks.compared import ComparedCell, compare_cell, say, table_lines  # noqa: E402
from benchmarks.machine import cells_main  # noqa: E402


@dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    batch: int


CONFIGS = {
    "tiny": Config(vocab=8192, d_model=1024, layers=4, heads=16, kv_heads=4, ffn=2816, seq_len=512, batch=16),
    "1b": Config(vocab=32000, d_model=2048, layers=8, heads=16, kv_heads=4, ffn=5632, seq_len=1024, batch=16),
}
DEFAULT_CELLS = ("tiny:1x8-a100:2x4", "tiny:2x8-a100:2x8", "1b:2x8-a100:2x8")


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * weight


def rotary(x: jax.Array) -> jax.Array:
    """[batch, seq, heads, head_dim] rotated by position (the half-split form)."""
    seq, head_dim = x.shape[1], x.shape[-1]
    inverse = 1.0 / (10000 ** (jnp.arange(0, head_dim, 2) / head_dim))
    angle = jnp.arange(seq)[:, None] * inverse[None]
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        head_dim = c.d_model // c.heads
        h = RMSNorm()(x)
        q = rotary(nn.DenseGeneral((c.heads, head_dim), use_bias=False, name="q")(h))
        k = rotary(nn.DenseGeneral((c.kv_heads, head_dim), use_bias=False, name="k")(h))
        v = nn.DenseGeneral((c.kv_heads, head_dim), use_bias=False, name="v")(h)
        k, v = jnp.repeat(k, c.heads // c.kv_heads, axis=2), jnp.repeat(v, c.heads // c.kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + nn.DenseGeneral(c.d_model, axis=(-2, -1), use_bias=False, name="o")(attended)
        h = RMSNorm()(x)
        gate = nn.Dense(c.ffn, use_bias=False, name="gate")(h)
        up = nn.Dense(c.ffn, use_bias=False, name="up")(h)
        return x + nn.Dense(c.d_model, use_bias=False, name="down")(jax.nn.silu(gate) * up)


class Llama(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.config.vocab, self.config.d_model)(tokens)
        for _ in range(self.config.layers):
            x = Block(self.config)(x)
        return nn.Dense(self.config.vocab, use_bias=False, name="lm_head")(RMSNorm()(x))


def workload(config: Config):  # noqa: ANN201 — (step, abstract args)
    model, tx = Llama(config), optax.adamw(1e-4)

    def loss_fn(params, tokens):  # noqa: ANN001, ANN202
        logits = model.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):  # noqa: ANN001, ANN202
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jax.ShapeDtypeStruct((config.batch, config.seq_len + 1), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((config.batch, config.seq_len), jnp.int32))
    return step, (params, jax.eval_shape(tx.init, params), tokens)


def measure(cell: str, time_limit_s: float) -> ComparedCell:
    config, cluster, mesh_text = cell.split(":")
    step, args = workload(CONFIGS[config])
    return compare_cell(cell, step, args, cluster, mesh_text, time_limit_s)


def markdown(rows: list[ComparedCell], load: str, time_limit_s: float) -> str:
    return "\n".join(["# autoshard on a Llama-style decoder", "",
                      f"`python -m benchmarks.llama_style --cells {' '.join(r.cell for r in rows)} --time-limit "
                      f"{time_limit_s:g}`; load (1, 5, 15 min) {load}. Modeled and compiled (XLA's program priced "
                      "on the cell's cluster) step per strategy.", "", *table_lines(rows)])


def main(argv: Sequence[str] | None = None) -> int:
    return cells_main(argv, description=__doc__.splitlines()[0], default_cells=DEFAULT_CELLS,
                      cell_help="config:cluster:mesh, e.g. 1b:2x8-a100:2x8", default_time_limit=10.0,
                      measure=measure, say=say, markdown=markdown)


if __name__ == "__main__":
    raise SystemExit(main())
