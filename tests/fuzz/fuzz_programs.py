"""Random train steps built from the primitives GPT, MoE and conv nets use, for the fuzz corpus.

A :class:`Program` is plain data (hypothesis draws it, ``repr`` reproduces it): an input family
(token ids, feature vectors, 1-d signals, images), a stack of layers, a loss head with a random
reduction, and SGD or AdamW. ``build(program)`` turns it into ``(step, params, opt_state, batch)``:
``step(params, opt_state, batch) -> (params, opt_state, loss)``, pure and jittable, its arguments
concrete numpy-initialised arrays. Sizes are drawn to include odd, prime and non-divisible ones
(1, 3, 5, 6, 7, ...), so the planner meets dimensions that no mesh axis divides.

Layers, by the rank of the activation they read (``B`` batch, ``S`` sequence, ``D`` features):

======================  ======================================================================
dense                   ``x @ W + b`` then a random activation (rank 2, 3)
einsum                  a head split ``bsd,dhe->bshe`` and back, or ``bd,de->be`` (rank 2, 3)
attention               q/k/v projections, scores ``bqhd,bkhd->bhqk`` with a causal, a padding or
                        the batch's boolean key mask (``where``), softmax, out projection, residual
                        (rank 3)
layernorm / rmsnorm     over the last dim, with scale (and bias) (rank 2, 3)
cumsum                  along the sequence or feature dim (rank 2, 3)
topk                    ``lax.top_k`` over the last dim, a softmax gate of the k values mixed back
                        (rank 2, 3)
moe                     a router, top-k experts, one-hot dispatch, an expert einsum
                        ``...d,edf->...ef`` and the gated combine (rank 2, 3)
concat_slice            ``concatenate`` with a slice of itself, then ``slice`` back (rank 2, 3)
pad_slice               ``pad`` the last dim, a dense layer, slice (rank 2, 3)
transpose               swap two non-batch dims around a dense layer (rank 3)
conv1d / conv2d         ``lax.conv_general_dilated``, SAME or VALID, stride 1 or 2 (rank 3, 4)
to_seq / pool           image -> sequence (reshape) or -> features (mean over space) (rank 4)
seq_pool / flatten      sequence -> features: max or mean over the sequence, or a reshape (rank 3)
dropout                 ``random.bernoulli`` from the batch's PRNG key (rank 2, 3)
gain                    a learnable scalar (a rank-0 parameter) times the activation (rank 2, 3)
scan                    ``lax.scan`` over 1-3 stacked residual dense layers, ``h + act(h @ W[i] + b[i])``: a
                        scanned layer stack (rank 2, 3)
======================  ======================================================================

A token program may tie its head to the embedding (``logits = x @ embed.T``, GPT-2 style): one
parameter read by a gather and a dot.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12)  # feature / sequence sizes: odd, prime and non-divisible included
BATCHES = (1, 2, 3, 4, 5, 6, 8, 12, 16)
ACTIVATIONS = ("tanh", "gelu", "relu", "none")
REDUCTIONS = ("mean", "sum", "max", "logsumexp")
LEARNING_RATE = {"sgd": 0.1, "adamw": 1e-3}

LAYERS_BY_RANK: dict[int, tuple[str, ...]] = {
    2: ("dense", "einsum", "layernorm", "rmsnorm", "cumsum", "topk", "moe", "concat_slice", "pad_slice", "dropout",
        "gain", "scan"),
    3: ("dense", "einsum", "attention", "layernorm", "rmsnorm", "cumsum", "topk", "moe", "concat_slice", "pad_slice",
        "transpose", "conv1d", "seq_pool", "flatten", "dropout", "gain", "scan"),
    4: ("conv2d", "to_seq", "pool"),
}


@dataclass(frozen=True)
class Layer:
    kind: str
    width: int = 0  # output features (dense, einsum, conv), or heads (attention), or k (topk)
    option: str = ""  # activation, mask kind, padding, cumsum axis...
    stride: int = 1


@dataclass(frozen=True)
class Program:
    family: str  # "tokens" | "features" | "signal" | "image"
    batch: int
    seq: int  # sequence length, signal length, or image height (= width)
    features: int  # embedding width, feature count, or channels
    layers: tuple[Layer, ...]
    loss: str  # "mse" | "xent"
    reduction: str  # how per-example losses become the scalar
    optimizer: str  # "sgd" | "adamw"
    seed: int
    vocab: int = 7  # tokens family: vocabulary; xent: classes
    tied: bool = False  # tokens family with xent: the head is the embedding, transposed

    def describe(self) -> str:
        layers = ", ".join(f"{l.kind}" + (f"({l.width}{',' + l.option if l.option else ''}"
                                          f"{',s' + str(l.stride) if l.stride > 1 else ''})"
                                          if l.width or l.option else "") for l in self.layers)
        return (f"{self.family} B={self.batch} S={self.seq} D={self.features} [{layers}] {self.loss}/"
                f"{self.reduction}{' tied' if self.tied else ''} {self.optimizer} seed={self.seed}")


# ----------------------------------------------------------------------------- drawing programs


def _rank_after(family: str) -> int:
    return {"tokens": 3, "features": 2, "signal": 3, "image": 4}[family]


@st.composite
def layers_for(draw: st.DrawFn, family: str, features: int, max_layers: int = 4) -> tuple[Layer, ...]:
    rank, width = _rank_after(family), features
    out: list[Layer] = []
    for _ in range(draw(st.integers(1, max_layers))):
        kind = draw(st.sampled_from(LAYERS_BY_RANK[rank]))
        if kind in ("dense", "pad_slice"):
            layer = Layer(kind, draw(st.sampled_from(SIZES)), draw(st.sampled_from(ACTIVATIONS)))
        elif kind in ("einsum", "scan"):
            layer = Layer(kind, draw(st.sampled_from((1, 2, 3))), draw(st.sampled_from(ACTIVATIONS)))
        elif kind == "attention":
            heads = draw(st.sampled_from([h for h in (1, 2, 3, 4) if width % h == 0]))
            layer = Layer(kind, heads, draw(st.sampled_from(("causal", "padding", "batch", "none"))))
        elif kind == "cumsum":
            layer = Layer(kind, 0, draw(st.sampled_from(("first", "last"))))
        elif kind == "topk":
            layer = Layer(kind, draw(st.integers(1, width)))
        elif kind == "moe":
            experts = draw(st.sampled_from((2, 3, 4)))
            layer = Layer(kind, experts, str(draw(st.integers(1, experts))))
        elif kind == "seq_pool":
            layer = Layer(kind, 0, draw(st.sampled_from(("max", "mean"))))
        elif kind in ("conv1d", "conv2d"):
            layer = Layer(kind, draw(st.sampled_from(SIZES)), draw(st.sampled_from(("SAME", "VALID"))),
                          draw(st.sampled_from((1, 2))))
        else:
            layer = Layer(kind)
        out.append(layer)
        width = _width_after(layer, width)
        if kind == "to_seq":
            rank = 3
        elif kind in ("pool", "seq_pool", "flatten"):
            rank = 2
    return tuple(out)


def _width_after(layer: Layer, width: int) -> int:
    if layer.kind in ("dense", "pad_slice", "conv1d", "conv2d"):
        return layer.width
    return width  # flatten widens to S * D; no later draw depends on the exact width


@st.composite
def programs(draw: st.DrawFn, max_layers: int = 4) -> Program:
    """A random Program with 1..``max_layers`` layers."""
    family = draw(st.sampled_from(("tokens", "features", "signal", "image")))
    seq = draw(st.sampled_from((1, 2, 3, 4, 5, 6, 8) if family != "image" else (3, 4, 5, 6)))
    features = draw(st.sampled_from(SIZES[1:]))
    loss = draw(st.sampled_from(("mse", "xent")))
    return Program(
        family=family, batch=draw(st.sampled_from(BATCHES)), seq=seq, features=features,
        layers=draw(layers_for(family, features, max_layers)), loss=loss,
        reduction=draw(st.sampled_from(REDUCTIONS)), optimizer=draw(st.sampled_from(("sgd", "adamw"))),
        seed=draw(st.integers(0, 2**16)), vocab=draw(st.sampled_from((3, 5, 7, 8))),
        tied=family == "tokens" and loss == "xent" and draw(st.booleans()),
    )


# ----------------------------------------------------------------------------- building the step


class _Params:
    """Deterministic parameter initialiser: fan-in scaled normals from one numpy generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tree: dict[str, Any] = {}

    def add(self, name: str, shape: tuple[int, ...], *, fan_in: int | None = None, value: float | None = None
            ) -> None:
        if value is not None:
            self.tree[name] = np.full(shape, value, np.float32)
        else:
            scale = 1.0 / math.sqrt(max(fan_in or shape[0], 1))
            self.tree[name] = (self.rng.standard_normal(shape) * scale).astype(np.float32)


def _activate(x: jax.Array, name: str) -> jax.Array:
    return {"tanh": jnp.tanh, "gelu": jax.nn.gelu, "relu": jax.nn.relu, "none": lambda v: v}[name](x)


LayerFn = Callable[[dict[str, Any], jax.Array], jax.Array]


def _layer(i: int, layer: Layer, shape: tuple[int, ...], init: _Params) -> tuple[LayerFn, tuple[int, ...]]:
    """The forward function of one layer (reading its parameters by name) and its output shape."""
    p = f"l{i}_"
    d = shape[-1]
    kind = layer.kind
    if kind == "dense":
        init.add(p + "w", (d, layer.width), fan_in=d)
        init.add(p + "b", (layer.width,), value=0.01)
        return (lambda q, x: _activate(x @ q[p + "w"] + q[p + "b"], layer.option)), (*shape[:-1], layer.width)
    if kind == "einsum":
        h = layer.width
        init.add(p + "split", (d, h, d), fan_in=d)
        init.add(p + "merge", (h, d, d), fan_in=h * d)
        if len(shape) == 3:
            return (lambda q, x: x + jnp.einsum("bshe,hed->bsd", _activate(jnp.einsum("bsd,dhe->bshe", x, q[p + "split"]),
                                                                           layer.option), q[p + "merge"])), shape
        return (lambda q, x: x + jnp.einsum("bhe,hed->bd", _activate(jnp.einsum("bd,dhe->bhe", x, q[p + "split"]),
                                                                     layer.option), q[p + "merge"])), shape
    if kind == "attention":
        heads = layer.width
        for name in ("q", "k", "v", "o"):
            init.add(p + name, (d, d), fan_in=d)
        init.add(p + "qb", (d,), value=0.0)

        def attention(q: dict[str, Any], x: jax.Array) -> jax.Array:
            b, s, _ = x.shape
            split = (b, s, heads, d // heads)
            qh = (x @ q[p + "q"] + q[p + "qb"]).reshape(split)
            kh, vh = (x @ q[p + "k"]).reshape(split), (x @ q[p + "v"]).reshape(split)
            scores = jnp.einsum("bqhd,bkhd->bhqk", qh, kh) / math.sqrt(d // heads)
            if layer.option == "causal":
                scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
            elif layer.option == "padding":
                keep = jnp.arange(s)[None, None, None, :] < jnp.maximum(s - 1, 1)
                scores = jnp.where(keep, scores, -1e9)
            elif layer.option == "batch":
                scores = jnp.where(q["__batch"][p + "mask"][:, None, None, :], scores, -1e9)
            mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), vh).reshape(b, s, d)
            return x + mixed @ q[p + "o"]

        return attention, shape
    if kind in ("layernorm", "rmsnorm"):
        init.add(p + "scale", (d,), value=1.0)
        if kind == "layernorm":
            init.add(p + "bias", (d,), value=0.0)

            def layernorm(q: dict[str, Any], x: jax.Array) -> jax.Array:
                mean = x.mean(-1, keepdims=True)
                var = ((x - mean) ** 2).mean(-1, keepdims=True)
                return (x - mean) * jax.lax.rsqrt(var + 1e-5) * q[p + "scale"] + q[p + "bias"]

            return layernorm, shape
        return (lambda q, x: x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * q[p + "scale"]), shape
    if kind == "cumsum":
        axis = 1 if layer.option == "first" else len(shape) - 1
        return (lambda q, x: jnp.cumsum(x, axis=axis) / shape[axis]), shape
    if kind == "topk":
        k = min(layer.width, d)
        init.add(p + "router", (d, d), fan_in=d)

        def topk(q: dict[str, Any], x: jax.Array) -> jax.Array:
            logits = x @ q[p + "router"]
            values, _ = jax.lax.top_k(logits, k)
            gate = jax.nn.softmax(values, axis=-1)
            return x * (1.0 + (gate * values).sum(-1, keepdims=True))

        return topk, shape
    if kind == "moe":
        experts, k = layer.width, int(layer.option)
        init.add(p + "router", (d, experts), fan_in=d)
        init.add(p + "experts", (experts, d, d), fan_in=d)

        def moe(q: dict[str, Any], x: jax.Array) -> jax.Array:
            values, chosen = jax.lax.top_k(x @ q[p + "router"], k)
            dispatch = jax.nn.one_hot(chosen, experts, dtype=x.dtype)  # [..., k, experts]
            weights = (jax.nn.softmax(values, axis=-1)[..., None] * dispatch).sum(-2)
            expert_out = jnp.einsum("...d,edf->...ef", x, q[p + "experts"])
            return x + jnp.einsum("...e,...ef->...f", weights, expert_out)

        return moe, shape
    if kind == "dropout":

        def dropout(q: dict[str, Any], x: jax.Array) -> jax.Array:
            keep = jax.random.bernoulli(jax.random.fold_in(q["__batch"]["key"], i), 0.8, x.shape)
            return jnp.where(keep, x / 0.8, 0.0)

        return dropout, shape
    if kind == "gain":
        init.add(p + "gain", (), value=1.5)
        return (lambda q, x: x * q[p + "gain"]), shape
    if kind == "scan":
        init.add(p + "w", (layer.width, d, d), fan_in=d)
        init.add(p + "b", (layer.width, d), value=0.01)

        def stack(q: dict[str, Any], x: jax.Array) -> jax.Array:
            def body(h: jax.Array, wb: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
                return h + _activate(h @ wb[0] + wb[1], layer.option), None
            return jax.lax.scan(body, x, (q[p + "w"], q[p + "b"]))[0]
        return stack, shape
    if kind == "seq_pool":
        pool = jnp.max if layer.option == "max" else jnp.mean
        return (lambda q, x: pool(x, axis=1)), (shape[0], d)
    if kind == "flatten":
        return (lambda q, x: x.reshape(x.shape[0], -1)), (shape[0], shape[1] * d)
    if kind == "concat_slice":
        cut = max(d // 2, 1)
        init.add(p + "w", (d + cut, d), fan_in=d + cut)
        return (lambda q, x: jnp.concatenate([x, x[..., :cut]], axis=-1) @ q[p + "w"]), shape
    if kind == "pad_slice":
        w = layer.width
        init.add(p + "w", (d + 2, w + 1), fan_in=d + 2)
        pads = [(0, 0)] * (len(shape) - 1) + [(1, 1)]
        return (lambda q, x: _activate(jnp.pad(x, pads) @ q[p + "w"], layer.option)[..., :w]), (*shape[:-1], w)
    if kind == "transpose":
        s = shape[1]
        init.add(p + "w", (s, s), fan_in=s)
        return (lambda q, x: x + jnp.swapaxes(jnp.swapaxes(x, 1, 2) @ q[p + "w"], 1, 2)), shape
    if kind in ("conv1d", "conv2d"):
        spatial = shape[1:-1]
        window = tuple(min(3, n) for n in spatial)
        init.add(p + "w", (*window, d, layer.width), fan_in=d * math.prod(window))
        dims = ("NWC", "WIO", "NWC") if kind == "conv1d" else ("NHWC", "HWIO", "NHWC")

        def conv(q: dict[str, Any], x: jax.Array) -> jax.Array:
            return jnp.tanh(jax.lax.conv_general_dilated(x, q[p + "w"], (layer.stride,) * len(spatial),
                                                         layer.option, dimension_numbers=dims))

        if layer.option == "SAME":
            out = tuple(-(-n // layer.stride) for n in spatial)
        else:
            out = tuple((n - k) // layer.stride + 1 for n, k in zip(spatial, window))
        return conv, (shape[0], *out, layer.width)
    if kind == "to_seq":
        return (lambda q, x: x.reshape(x.shape[0], -1, x.shape[-1])), (shape[0], shape[1] * shape[2], d)
    if kind == "pool":
        return (lambda q, x: x.mean(axis=(1, 2))), (shape[0], d)
    raise ValueError(f"unknown layer kind {kind!r}")


def _reduce(per_example: jax.Array, how: str) -> jax.Array:
    flat = per_example.reshape(-1)
    if how == "mean":
        return flat.mean()
    if how == "sum":
        return flat.sum()
    if how == "max":
        return flat.max()
    return jax.nn.logsumexp(flat)


def build(program: Program) -> tuple[Callable[..., Any], Any, Any, dict[str, Any]]:
    """``(step, params, opt_state, batch)`` of a program (see the module docstring)."""
    init = _Params(program.seed)
    rng = np.random.default_rng(program.seed + 1)
    b, s, f = program.batch, program.seq, program.features
    batch: dict[str, Any] = {}
    if program.family == "tokens":
        init.add("embed", (program.vocab, f), fan_in=1)
        batch["x"] = rng.integers(0, program.vocab, (b, s)).astype(np.int32)
        shape: tuple[int, ...] = (b, s, f)
    elif program.family == "features":
        batch["x"] = rng.standard_normal((b, f)).astype(np.float32)
        shape = (b, f)
    elif program.family == "signal":
        batch["x"] = rng.standard_normal((b, s, f)).astype(np.float32)
        shape = (b, s, f)
    else:
        batch["x"] = rng.standard_normal((b, s, s, f)).astype(np.float32)
        shape = (b, s, s, f)
    fns = []
    for i, layer in enumerate(program.layers):
        if layer.kind == "attention" and layer.option == "batch":  # a boolean key mask of this layer's length
            batch[f"l{i}_mask"] = rng.random(shape[:2]) < 0.7
            batch[f"l{i}_mask"][:, 0] = True  # every query sees at least one key
        fn, shape = _layer(i, layer, shape, init)
        fns.append(fn)
    if any(layer.kind == "dropout" for layer in program.layers):
        batch["key"] = jax.random.key(program.seed)
    classes = program.vocab
    if program.tied:
        init.add("head_in", (shape[-1], f), fan_in=shape[-1])
        batch["y"] = rng.integers(0, classes, shape[:-1]).astype(np.int32)
    elif program.loss == "xent":
        init.add("head", (shape[-1], classes), fan_in=shape[-1])
        batch["y"] = rng.integers(0, classes, shape[:-1]).astype(np.int32)
    else:
        init.add("head", (shape[-1], 2), fan_in=shape[-1])
        batch["y"] = rng.standard_normal((*shape[:-1], 2)).astype(np.float32)
    family, loss_kind, reduction, tied = program.family, program.loss, program.reduction, program.tied

    def loss_fn(params: dict[str, Any], data: dict[str, Any]) -> jax.Array:
        x = jnp.take(params["embed"], data["x"], axis=0) if family == "tokens" else data["x"]
        scope = {**params, "__batch": data}  # layers read their parameters, and the batch's key and mask
        for fn in fns:
            x = fn(scope, x)
        out = (x @ params["head_in"]) @ params["embed"].T if tied else x @ params["head"]
        if loss_kind == "xent":
            logp = jax.nn.log_softmax(out, axis=-1)
            per = -jnp.take_along_axis(logp, data["y"][..., None], axis=-1)[..., 0]
        else:
            per = ((out - data["y"]) ** 2).sum(-1)
        return _reduce(per, reduction)

    lr = LEARNING_RATE[program.optimizer]
    tx = optax.sgd(lr) if program.optimizer == "sgd" else optax.adamw(lr, weight_decay=0.01)

    def step(params: Any, opt_state: Any, data: dict[str, Any]) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init.tree
    return step, params, tx.init(params), batch
