"""GPT-style decoder-only language model, written with Flax NNX.

Token embedding plus learned position embedding, ``num_layers`` pre-LayerNorm
blocks (causal multi-head self-attention with separate q/k/v/out projections,
then a 4x GELU MLP, each with a residual), a final LayerNorm and an untied LM
head. The loss is next-token cross-entropy and the optimizer ``optax.adamw``.

Precision: ``param_dtype`` is the dtype parameters (and Adam's moments) are
stored in, ``dtype`` the dtype the forward computes in. Both ``"float32"``
is the default; both ``"bfloat16"`` is a bf16 model; ``param_dtype="float32"``
with ``dtype="bfloat16"`` is the usual mixed-precision recipe (fp32 master
weights, cast to bf16 in every layer's forward, as Flax's ``dtype`` argument
does); the loss is computed in float32 either way.

The blocks are an ``nnx.List`` walked by a Python for-loop (no scan), so a
traced step shows ``num_layers`` copies of the same layer, which is what the
planner's repeated-layer detection and layer clustering look for.

NNX modules are stateful objects; the train step must be a pure function of
arrays. The model is therefore split once into a static ``GraphDef`` and a
plain nested dict of parameters (``nnx.to_pure_dict``); the loss rebuilds the
module with ``nnx.merge(graphdef, params)`` inside the traced function.
The dict is keyed like the module tree, e.g.
``params["blocks"][3]["attn"]["q"]["kernel"]``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.common import Batch, InitKeys, Params, Workload, build_workload, resolve_config

EMBED_INIT = nnx.initializers.normal(stddev=0.02)


@dataclass(frozen=True)
class Config:
    """GPT hyper-parameters; derive variants with ``dataclasses.replace``."""

    vocab_size: int = 256  # tokens; keep divisible by 8 so the vocab dim shards
    seq_len: int = 16  # tokens per sequence the model sees (the batch holds seq_len + 1)
    d_model: int = 96  # residual stream width
    num_heads: int = 4  # attention heads; must divide d_model
    num_layers: int = 2  # decoder blocks
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    batch_size: int = 24  # sequences per step
    learning_rate: float = 1e-3  # adamw step size
    weight_decay: float = 0.01  # adamw decoupled weight decay
    param_dtype: str = "float32"  # storage dtype of the parameters (and of adamw's moments)
    dtype: str = "float32"  # compute dtype of the forward: params are cast to it in each layer

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        for field in ("param_dtype", "dtype"):
            name = getattr(self, field)
            if not jnp.issubdtype(jnp.dtype(name), jnp.floating):
                raise ValueError(f"{field}={name!r} is not a floating dtype; use 'float32', 'bfloat16' or 'float16'")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


CONFIGS: dict[str, Config] = {
    # Fast enough to compile and run in unit tests.
    "tiny": Config(vocab_size=64, seq_len=8, d_model=48, num_heads=4, num_layers=2, batch_size=24),
    "small": Config(vocab_size=256, seq_len=16, d_model=96, num_heads=4, num_layers=2, batch_size=24),
    # GPT-2 small shape (12 x 768) with a padded GPT-2 vocab; ~163M parameters (untied head).
    "medium": Config(
        vocab_size=50304, seq_len=1024, d_model=768, num_heads=12, num_layers=12, batch_size=48
    ),
    # ~1.42B parameters; used abstractly.
    "large": Config(
        vocab_size=50304, seq_len=1024, d_model=2048, num_heads=16, num_layers=24, batch_size=48
    ),
    # The tiny model in bf16 throughout, and in mixed precision (fp32 master weights, bf16 compute).
    "tiny-bf16": Config(vocab_size=64, seq_len=8, d_model=48, num_heads=4, num_layers=2, batch_size=24,
                        param_dtype="bfloat16", dtype="bfloat16"),
    "tiny-mixed": Config(vocab_size=64, seq_len=8, d_model=48, num_heads=4, num_layers=2, batch_size=24,
                         dtype="bfloat16"),
    # GPT-2 small's shape in bf16 (parameters, moments and compute); used abstractly.
    "medium-bf16": Config(vocab_size=50304, seq_len=1024, d_model=768, num_heads=12, num_layers=12, batch_size=48,
                          param_dtype="bfloat16", dtype="bfloat16"),
    # ~6.86B parameters; used abstractly by the benchmarks.
    "xl": Config(
        vocab_size=50304, seq_len=2048, d_model=4096, num_heads=32, num_layers=32, batch_size=48
    ),
}


def precision_kwargs(config: Config) -> dict[str, Any]:
    """``param_dtype`` / ``dtype`` for every Flax layer; empty at float32 (the layers' defaults)."""
    if config.param_dtype == config.dtype == "float32":
        return {}
    return {"param_dtype": jnp.dtype(config.param_dtype), "dtype": jnp.dtype(config.dtype)}


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs | InitKeys, **precision: Any) -> None:
        self.num_heads = num_heads
        self.q = nnx.Linear(d_model, d_model, rngs=rngs, **precision)
        self.k = nnx.Linear(d_model, d_model, rngs=rngs, **precision)
        self.v = nnx.Linear(d_model, d_model, rngs=rngs, **precision)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs, **precision)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.num_heads
        heads = (batch, seq, self.num_heads, head_dim)
        q = self.q(x).reshape(heads)
        k = self.k(x).reshape(heads)
        v = self.v(x).reshape(heads)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
        return self.out(attended)


class Mlp(nnx.Module):
    """Position-wise feed-forward: Dense(hidden) -> GELU -> Dense(d_model)."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs | InitKeys, **precision: Any) -> None:
        self.up = nnx.Linear(d_model, hidden, rngs=rngs, **precision)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs, **precision)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """Pre-LayerNorm decoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs | InitKeys) -> None:
        precision = precision_kwargs(config)
        self.ln_attn = nnx.LayerNorm(config.d_model, rngs=rngs, **precision)
        self.attn = CausalSelfAttention(config.d_model, config.num_heads, rngs=rngs, **precision)
        self.ln_mlp = nnx.LayerNorm(config.d_model, rngs=rngs, **precision)
        self.mlp = Mlp(config.d_model, config.mlp_ratio * config.d_model, rngs=rngs, **precision)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nnx.Module):
    """Decoder-only transformer returning next-token logits ``[batch, seq, vocab]``."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs | InitKeys) -> None:
        precision = precision_kwargs(config)
        self.token_embed = nnx.Embed(
            config.vocab_size, config.d_model, embedding_init=EMBED_INIT, rngs=rngs, **precision
        )
        self.pos_embed = nnx.Embed(config.seq_len, config.d_model, embedding_init=EMBED_INIT, rngs=rngs,
                                   **precision)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.ln_final = nnx.LayerNorm(config.d_model, rngs=rngs, **precision)
        self.lm_head = nnx.Linear(config.d_model, config.vocab_size, rngs=rngs, **precision)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.token_embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))


def graphdef(config: Config) -> nnx.GraphDef[GPT]:
    """The static structure of the model, obtained without allocating parameters."""
    abstract_model = nnx.eval_shape(lambda: GPT(config, rngs=InitKeys(jax.random.key(0))))
    return nnx.graphdef(abstract_model)


def init_params(config: Config, key: jax.Array) -> Params:
    """Fresh parameters as a plain nested dict of arrays."""
    return nnx.to_pure_dict(nnx.state(GPT(config, rngs=InitKeys(key)), nnx.Param))


def make_batch(config: Config, key: jax.Array, batch_size: int) -> Batch:
    """Learnable synthetic text: each row is an arithmetic sequence modulo the vocab.

    ``tokens`` is int32 ``[batch, seq_len + 1]``; inputs are ``tokens[:, :-1]``,
    targets ``tokens[:, 1:]``.
    """
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (batch_size, 1), 0, config.vocab_size)
    stride = jax.random.randint(stride_key, (batch_size, 1), 1, 8)
    positions = jnp.arange(config.seq_len + 1)[None, :]
    return {"tokens": ((start + stride * positions) % config.vocab_size).astype(jnp.int32)}


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, in float32 whatever the logits' dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def workload(
    config: str | Config = "small",
    *,
    abstract: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
    family: str = "gpt",
    graphdef_fn: Callable[[Config], Any] | None = None,
    init_fn: Callable[[Config, jax.Array], Params] | None = None,
) -> Workload:
    """A GPT train step (adamw) with its ``(params, opt_state, batch)``; ``family``, ``graphdef_fn`` and
    ``init_fn`` name another layout of the same model (``examples/gpt_scan.py``: its blocks under nnx.scan)."""
    name, cfg = resolve_config(family, CONFIGS, config, batch_size)
    model_def = (graphdef_fn or graphdef)(cfg)
    init = init_fn or init_params

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        tokens = batch["tokens"]
        model = nnx.merge(model_def, params)
        return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])

    return build_workload(
        name,
        cfg,
        init_params=lambda key: init(cfg, key),
        make_batch=lambda key, size: make_batch(cfg, key, size),
        loss_fn=loss_fn,
        optimizer=optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay),
        abstract=abstract,
        seed=seed,
    )
