"""autoshard on Flax models written as Flax's own examples write them, none of them in ``examples/``.

- ``vit``: a vision transformer, patches by a strided ``nn.Conv``, ``nn.MultiHeadDotProductAttention``,
  ``nn.Dropout`` (its mask from the step's key), AdamW under global-norm clipping;
- ``bn_cnn``: a conv net with ``nn.BatchNorm``, its statistics a mutable collection the step returns; SGD with
  momentum;
- ``gru``: ``nn.RNN(nn.GRUCell)`` over a sequence (a scan), a regression head; Adam;
- ``tied_lm``: a language model whose head is its embedding (``nn.Embed.attend``), trained with gradient
  accumulation (``optax.MultiSteps``, a ``cond`` on the step count);
- ``scan_remat``: a residual MLP stack as ``nn.scan(nn.remat(Block))`` (one stacked set of weights, the
  layers' activations recomputed in the backward pass).

Each builder gives the step and its arguments: abstract at the benchmark's sizes, made (``small=True``) at
sizes a test runs on simulated devices (``tests/sim/test_flax_zoo.py``: sharded like one device); with
``marked=True`` the step takes its gradients with ``autoshard.value_and_grad``, so it may be pipelined (the same
test runs three of them on two stages).

Every plan ``compare`` makes is compiled by XLA and priced from its HLO on the cell's cluster
(``benchmarks/compared.py``).

    python -m benchmarks.flax_zoo [--cells vit:1x8-a100:2x4 gru:2x8-a100:2x8 ...] [--time-limit 10]
        [--out benchmarks/FLAX_ZOO.md]

A cell is ``model:cluster:mesh``; meshes larger than this process's 8 simulated devices compile in a child
process. A row is ok when autoshard's compiled program is at least as fast as the fastest compiled classic
program that fits.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.devices import simulate_devices

simulate_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autoshard  # noqa: E402

from benchmarks.compared import ComparedCell, compare_cell, say, table_lines  # noqa: E402
from benchmarks.machine import cells_main  # noqa: E402
from benchmarks.quality import geomean  # noqa: E402

Workload = tuple[Callable[..., Any], tuple[Any, ...]]


def _init(model: nn.Module, small: bool, *example: Any, **kwargs: Any) -> Any:
    """The model's variables: made (small, to run) or their shapes only (the benchmark's sizes)."""
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    return model.init(rngs, *example, **kwargs) if small else jax.eval_shape(
        lambda: model.init(rngs, *example, **kwargs))


def _data(small: bool, seed: int, shape: tuple[int, ...], classes: int | None = None) -> Any:
    """A batch leaf: floats (``classes`` None) or integers below ``classes``; made when small, else its shape."""
    dtype = jnp.float32 if classes is None else jnp.int32
    if not small:
        return jax.ShapeDtypeStruct(shape, dtype)
    key = jax.random.key(seed)
    return jax.random.normal(key, shape, dtype) if classes is None else jax.random.randint(key, shape, 0, classes)


def _state(tx: optax.GradientTransformation, params: Any, small: bool) -> Any:
    return tx.init(params) if small else jax.eval_shape(tx.init, params)


def _grad(marked: bool) -> Callable[..., Any]:
    """``jax.value_and_grad``, or autoshard's marked one (``marked``: the step may be pipelined)."""
    return autoshard.value_and_grad if marked else jax.value_and_grad


def _train_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                marked: bool = False) -> Callable[..., Any]:
    def step(params, opt_state, batch):  # noqa: ANN001, ANN202
        loss, grads = _grad(marked)(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


class EncoderBlock(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
        x = x + nn.Dropout(0.1, deterministic=not train)(y)
        y = nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x))))
        return x + nn.Dropout(0.1, deterministic=not train)(y)


class ViT(nn.Module):
    dim: int = 256
    depth: int = 4
    heads: int = 8
    classes: int = 100

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.dim, (4, 4), strides=(4, 4))(images)
        x = x.reshape(x.shape[0], -1, self.dim)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
        for _ in range(self.depth):
            x = EncoderBlock(self.dim, self.heads)(x, train)
        return nn.Dense(self.classes)(nn.LayerNorm()(x).mean(axis=1))


def vit(small: bool = False, marked: bool = False) -> Workload:
    model, batch, side = (ViT(dim=32, depth=1, heads=4, classes=10), 32, 16) if small else (ViT(), 512, 64)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))
    params = _init(model, small, jnp.zeros((1, side, side, 3)))["params"]

    def step(params, opt_state, batch, key):  # noqa: ANN001, ANN202
        def loss_fn(p):  # noqa: ANN001, ANN202
            logits = model.apply({"params": p}, batch["image"], rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        loss, grads = _grad(marked)(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = {"image": _data(small, 1, (batch, side, side, 3)), "label": _data(small, 2, (batch,), model.classes)}
    return step, (params, _state(tx, params, small), data, jax.random.key(7))


class BatchNormCNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        for features in (32, 64):
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(features, (3, 3))(x)))
            x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def bn_cnn(small: bool = False, marked: bool = False) -> Workload:
    model, tx = BatchNormCNN(), optax.sgd(0.05, momentum=0.9)
    batch, side = (64, 8) if small else (1024, 32)
    variables = _init(model, small, jnp.zeros((1, side, side, 3)))

    def step(params, batch_stats, opt_state, batch):  # noqa: ANN001, ANN202
        def loss_fn(p):  # noqa: ANN001, ANN202
            logits, updated = model.apply({"params": p, "batch_stats": batch_stats}, batch["image"],
                                          mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, updated["batch_stats"]
        (loss, batch_stats), grads = _grad(marked)(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    data = {"image": _data(small, 1, (batch, side, side, 3)), "label": _data(small, 2, (batch,), 10)}
    params = variables["params"]
    return step, (params, variables["batch_stats"], _state(tx, params, small), data)


class GRURegressor(nn.Module):
    hidden: int = 512

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(1)(nn.RNN(nn.GRUCell(self.hidden))(x)[:, -1])


def gru(small: bool = False, marked: bool = False) -> Workload:
    model, tx = GRURegressor(hidden=32 if small else 512), optax.adam(1e-3)
    batch, steps, features = (64, 8, 8) if small else (1024, 32, 64)
    params = _init(model, small, jnp.zeros((1, steps, features)))["params"]
    step = _train_step(lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2), tx, marked)
    data = {"x": _data(small, 1, (batch, steps, features)), "y": _data(small, 2, (batch, 1))}
    return step, (params, _state(tx, params, small), data)


class TiedLM(nn.Module):
    vocab: int = 16384
    dim: int = 1024

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.dim)
        x = embed(tokens)
        x = x + nn.Dense(self.dim)(nn.tanh(nn.Dense(self.dim)(x)))
        return embed.attend(nn.LayerNorm()(x))


def tied_lm(small: bool = False, marked: bool = False) -> Workload:
    model, batch, seq = (TiedLM(vocab=128, dim=32), 16, 8) if small else (TiedLM(), 64, 256)
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    params = _init(model, small, jnp.zeros((1, seq), jnp.int32))["params"]

    def loss_fn(p, tokens):  # noqa: ANN001, ANN202
        logits = model.apply({"params": p}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return _train_step(loss_fn, tx, marked), (params, _state(tx, params, small), _data(small, 1, (batch, seq + 1),
                                                                               model.vocab))


class ResidualBlock(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        y = nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x))))
        return x + y, None


class ScannedStack(nn.Module):
    dim: int = 512
    depth: int = 8

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.dim)(x)
        stack = nn.scan(nn.remat(ResidualBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.depth)
        x, _ = stack(self.dim)(x, None)
        return nn.Dense(1)(x)


def scan_remat(small: bool = False, marked: bool = False) -> Workload:
    model, tx = (ScannedStack(dim=32, depth=3) if small else ScannedStack()), optax.adamw(1e-3)
    batch, seq = (32, 8) if small else (256, 128)
    params = _init(model, small, jnp.zeros((1, seq, 64)))["params"]
    step = _train_step(lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2), tx, marked)
    data = {"x": _data(small, 1, (batch, seq, 64)), "y": _data(small, 2, (batch, seq, 1))}
    return step, (params, _state(tx, params, small), data)


MODELS: dict[str, Callable[..., Workload]] = {"vit": vit, "bn_cnn": bn_cnn, "gru": gru, "tied_lm": tied_lm,
                                              "scan_remat": scan_remat}
DEFAULT_CELLS = tuple(f"{m}:{c}" for m in MODELS for c in ("1x8-a100:2x4", "2x8-a100:2x8"))


def measure(cell: str, time_limit_s: float) -> ComparedCell:
    model, cluster, mesh_text = cell.split(":")
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r} in cell {cell!r}: one of {', '.join(MODELS)}")
    step, args = MODELS[model]()
    return compare_cell(cell, step, args, cluster, mesh_text, time_limit_s)


def markdown(rows: list[ComparedCell], load: str, time_limit_s: float) -> str:
    rated = [r.speedup for r in rows if r.speedup]
    mean = f"; geomean over the cells {geomean(rated):.2f}x the best classic plan, compiled" if rated else ""
    return "\n".join([
        "# autoshard on Flax models it was not written with", "",
        f"`python -m benchmarks.flax_zoo --cells {' '.join(r.cell for r in rows)} --time-limit {time_limit_s:g}`; "
        f"load (1, 5, 15 min) {load}. The models (`benchmarks/flax_zoo.py`'s docstring) are written as Flax's own "
        "examples write them: dropout from the step's key, batch statistics as mutable state, `nn.RNN`, a tied "
        "head with gradient accumulation, `nn.scan(nn.remat(...))`. Modeled and compiled (XLA's program priced on "
        f"the cell's cluster) step per strategy; {sum(r.ok for r in rows)} of {len(rows)} cells at least as fast as "
        f"the best classic plan, compiled{mean}.", "", *table_lines(rows)])


def main(argv: Sequence[str] | None = None) -> int:
    return cells_main(argv, description=__doc__.splitlines()[0], default_cells=DEFAULT_CELLS,
                      cell_help="model:cluster:mesh, e.g. vit:2x8-a100:2x8", default_time_limit=10.0,
                      measure=measure, say=say, markdown=markdown)


if __name__ == "__main__":
    raise SystemExit(main())
