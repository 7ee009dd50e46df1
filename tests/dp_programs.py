"""Five plain training steps whose best plan is data parallelism, written here as users write them.

Each has a batch large against its parameters, so splitting the batch over every device and reducing
the gradients costs far less than any split of the work that moves activations, on every cluster preset.
``PROGRAMS[name]()`` gives ``(step, params, opt_state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

S = jax.ShapeDtypeStruct
Built = tuple[Callable[..., Any], Any, Any, Any]


def _step_of(loss_fn: Callable[..., jax.Array], tx: optax.GradientTransformation) -> Callable[..., Any]:
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: S(x.shape, x.dtype), tree)


def linear_regression() -> Built:
    """The issue's program: ``x @ W + b`` against targets, Adam; B 32768, H 512."""
    batch_size, hidden = 32768, 512
    tx = optax.adam(1e-2)

    def loss_fn(p, batch):
        out = batch["x"] @ p["kernel"] + p["bias"]
        return jnp.mean((out - batch["y"]) ** 2)

    params = {"kernel": S((hidden, hidden), jnp.float32), "bias": S((hidden,), jnp.float32)}
    batch = {"x": S((batch_size, hidden), jnp.float32), "y": S((batch_size, hidden), jnp.float32)}
    return _step_of(loss_fn, tx), params, jax.eval_shape(tx.init, params), batch


class _Mlp(nn.Module):
    width: int = 512
    depth: int = 4
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.classes)(x)


def mlp_stack() -> Built:
    """A 4-layer ReLU MLP classifier (linen), AdamW, batch 32768 of 256 features."""
    model, tx = _Mlp(), optax.adamw(1e-3)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 256)))["params"])
    batch = {"x": S((32768, 256), jnp.float32), "label": S((32768,), jnp.int32)}
    return _step_of(loss_fn, tx), params, jax.eval_shape(tx.init, params), batch


class _BertLayer(nn.Module):
    """A post-LN transformer encoder layer, as BERT writes it: attention, dropout, add, LayerNorm; FFN
    (GELU), dropout, add, LayerNorm."""
    d_model: int = 128
    heads: int = 4
    ffn: int = 512
    rate: float = 0.1

    @nn.compact
    def __call__(self, x, mask, train: bool = True):
        attn = nn.MultiHeadDotProductAttention(num_heads=self.heads, deterministic=not train,
                                               dropout_rate=self.rate)(x, x, mask=mask)
        x = nn.LayerNorm()(x + nn.Dropout(self.rate, deterministic=not train)(attn))
        h = nn.Dense(self.d_model)(nn.gelu(nn.Dense(self.ffn)(x)))
        return nn.LayerNorm()(x + nn.Dropout(self.rate, deterministic=not train)(h))


def bert_layer() -> Built:
    """One post-LN BERT layer with dropout and an attention mask, a regression head; batch 512 x 128."""
    model, tx = _BertLayer(), optax.adamw(1e-4)
    batch_size, seq = 512, 128

    def loss_fn(params, batch):
        mask = nn.make_attention_mask(batch["valid"], batch["valid"])
        out = model.apply({"params": params}, batch["x"], mask, rngs={"dropout": batch["rng"]})
        return jnp.mean((out - batch["y"]) ** 2)

    params = jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, jnp.zeros((1, seq, 128)),
                                               jnp.ones((1, 1, seq, seq), bool), train=False)["params"])
    batch = {"x": S((batch_size, seq, 128), jnp.float32), "y": S((batch_size, seq, 128), jnp.float32),
             "valid": S((batch_size, seq), jnp.bool_), "rng": jax.eval_shape(lambda: jax.random.key(0))}
    return _step_of(loss_fn, tx), params, jax.eval_shape(tx.init, params), batch


class _ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (32, 64, 64):
            x = nn.relu(nn.Conv(features, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def conv_net() -> Built:
    """Three 3x3 conv + pool blocks and a classifier (linen), SGD with momentum; 4096 32x32 RGB images."""
    model, tx = _ConvNet(), optax.sgd(0.01, momentum=0.9)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"])
    batch = {"image": S((4096, 32, 32, 3), jnp.float32), "label": S((4096,), jnp.int32)}
    return _step_of(loss_fn, tx), params, jax.eval_shape(tx.init, params), batch


def embedding_bag() -> Built:
    """Token ids gathered from an embedding table, mean-pooled, a linear classifier; Adam; 131072 x 128 ids."""
    vocab, dim, classes = 1024, 64, 16
    tx = optax.adam(1e-3)

    def loss_fn(params, batch):
        vectors = jnp.take(params["embedding"], batch["ids"], axis=0)  # [B, L, D]
        pooled = vectors.mean(axis=1)
        logits = pooled @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    params = {"embedding": S((vocab, dim), jnp.float32), "head": S((dim, classes), jnp.float32)}
    batch = {"ids": S((131072, 128), jnp.int32), "label": S((131072,), jnp.int32)}
    return _step_of(loss_fn, tx), params, jax.eval_shape(tx.init, params), batch


PROGRAMS: dict[str, Callable[[], Built]] = {
    "linear-regression": linear_regression,
    "mlp-stack": mlp_stack,
    "bert-layer": bert_layer,
    "conv-net": conv_net,
    "embedding-bag": embedding_bag,
}
