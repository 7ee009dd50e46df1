"""Mixture-of-experts transformer (GShard-style top-2 routing), written with Flax NNX.

Each of the ``num_layers`` blocks is the GPT block (``examples.gpt``) with its
MLP replaced by a mixture of ``num_experts`` GELU MLPs. Routing follows GShard:

- a softmax router picks each token's top-2 experts; the two gates are
  renormalized to sum to one;
- tokens are routed within groups (one group per sequence); each expert takes
  at most ``capacity = ceil(capacity_factor * experts_per_token * seq_len / num_experts)``
  tokens per group, positions assigned by a cumulative sum over the one-hot
  choices (first choices before second choices); overflow tokens are dropped
  (their residual passes through unchanged);
- dispatch and combine are einsums with a ``[group, token, expert, capacity]``
  mask: ``einsum("gtec,gtd->egcd")`` gathers the expert inputs, the experts
  are batched weights ``[E, d, ff]`` applied with ``einsum("egcd,edf->egcf")``,
  and ``einsum("gtec,egcd->gtd")`` scatters the gated outputs back. With a
  single group these are the classic ``"tec,td->ecd"`` / ``"tec,ecd->td"``;
  per-sequence groups keep the mask linear in the token count and give the
  planner a batch dim to split next to the expert dim.

The loss is next-token cross-entropy plus ``aux_loss_weight`` times the
load-balancing loss ``E * sum_e(mean_prob_e * fraction_routed_first_e)``
averaged over layers; the optimizer is ``optax.adamw``. Parameters are a plain
nested dict (``nnx.to_pure_dict``), as in ``examples.gpt``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.common import Batch, InitKeys, Params, Workload, build_workload, resolve_config
from examples.gpt import EMBED_INIT, CausalSelfAttention, next_token_loss

Rngs = nnx.Rngs | InitKeys


@dataclass(frozen=True)
class Config:
    """MoE transformer hyper-parameters; derive variants with ``dataclasses.replace``."""

    vocab_size: int = 256  # tokens; divisible by 8
    seq_len: int = 16  # tokens per sequence (= routing group size)
    d_model: int = 96  # residual stream width
    num_heads: int = 4  # attention heads; must divide d_model
    num_layers: int = 2  # transformer blocks, each with an MoE FFN
    num_experts: int = 8  # experts per MoE layer
    expert_hidden: int = 192  # hidden width of each expert MLP
    capacity_factor: float = 1.25  # expert slots per group = ceil(cf * 2 * seq_len / E)
    aux_loss_weight: float = 0.01  # weight of the load-balancing loss
    batch_size: int = 24  # sequences per step
    learning_rate: float = 1e-3  # adamw step size
    weight_decay: float = 0.01  # adamw decoupled weight decay

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token ({self.experts_per_token}) must be between 1 and "
                             f"num_experts={self.num_experts}")

    @property
    def experts_per_token(self) -> int:
        """Experts each token is routed to: 2 (top-2 gating)."""
        return 2

    @property
    def capacity(self) -> int:
        """Expert slots per routing group (one group per sequence)."""
        return math.ceil(self.capacity_factor * self.experts_per_token * self.seq_len / self.num_experts)


CONFIGS: dict[str, Config] = {
    "tiny": Config(vocab_size=64, seq_len=8, d_model=48, num_heads=4, num_layers=2, num_experts=4,
                   expert_hidden=96),
    "small": Config(),
    # ~1.82B parameters (8 experts x 24 layers); used abstractly.
    "large": Config(vocab_size=50304, seq_len=1024, d_model=1024, num_heads=16, num_layers=24,
                    num_experts=8, expert_hidden=4096, batch_size=48),
}


class Top2Router(nnx.Module):
    """Softmax router with GShard top-2 dispatch and combine tensors."""

    def __init__(self, d_model: int, num_experts: int, capacity: int, *, rngs: Rngs) -> None:
        self.capacity = capacity
        self.gate = nnx.Linear(d_model, num_experts, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [G, T, d]`` -> ``(dispatch, combine, aux_loss)``; masks are ``[G, T, E, C]``."""
        probs = jax.nn.softmax(self.gate(x), axis=-1)  # [G, T, E]
        num_experts = probs.shape[-1]
        first = jax.nn.one_hot(jnp.argmax(probs, axis=-1), num_experts, dtype=probs.dtype)
        second_probs = probs * (1.0 - first)
        second = jax.nn.one_hot(jnp.argmax(second_probs, axis=-1), num_experts, dtype=probs.dtype)

        # Load balancing (GShard): mean router probability x fraction of first choices.
        aux_loss = num_experts * jnp.mean(
            jnp.sum(jnp.mean(probs, axis=1) * jnp.mean(first, axis=1), axis=-1)
        )

        # Slot of each token in its expert's buffer: first choices fill slots before second ones.
        first_pos = (jnp.cumsum(first, axis=1) - 1.0) * first
        first = first * (first_pos < self.capacity)
        second_pos = (jnp.cumsum(second, axis=1) - 1.0 + jnp.sum(first, axis=1, keepdims=True)) * second
        second = second * (second_pos < self.capacity)

        first_gate = jnp.sum(probs * first, axis=-1)  # [G, T]; 0 where dropped
        second_gate = jnp.sum(probs * second, axis=-1)
        norm = jnp.maximum(first_gate + second_gate, jnp.finfo(probs.dtype).eps)
        first_gate, second_gate = first_gate / norm, second_gate / norm

        def slots(mask: jax.Array, pos: jax.Array) -> jax.Array:  # [G, T, E, C]
            slot = jnp.sum(pos * mask, axis=-1).astype(jnp.int32)
            return mask[..., None] * jax.nn.one_hot(slot, self.capacity, dtype=mask.dtype)[..., None, :]

        first_slots, second_slots = slots(first, first_pos), slots(second, second_pos)
        combine = first_gate[..., None, None] * first_slots + second_gate[..., None, None] * second_slots
        dispatch = first_slots + second_slots
        return dispatch, combine, aux_loss


class MoeMlp(nnx.Module):
    """``num_experts`` GELU MLPs stored as batched weights, fed by a top-2 router."""

    def __init__(self, config: Config, *, rngs: Rngs) -> None:
        e, d, f = config.num_experts, config.d_model, config.expert_hidden
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = Top2Router(d, e, config.capacity, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (e, d, f)))
        self.b_in = nnx.Param(jnp.zeros((e, f)))
        self.w_out = nnx.Param(init(rngs.params(), (e, f, d)))
        self.b_out = nnx.Param(jnp.zeros((e, d)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [G, T, d]`` -> ``(y [G, T, d], aux_loss)``."""
        dispatch, combine, aux_loss = self.router(x)
        expert_in = jnp.einsum("gtec,gtd->egcd", dispatch, x)
        hidden = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, self.w_in[...])
                             + self.b_in[...][:, None, None, :])
        expert_out = jnp.einsum("egcf,efd->egcd", hidden, self.w_out[...]) + self.b_out[...][:, None, None, :]
        return jnp.einsum("gtec,egcd->gtd", combine, expert_out), aux_loss


class MoeBlock(nnx.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + moe(ln(x))."""

    def __init__(self, config: Config, *, rngs: Rngs, mlp: type[nnx.Module] = MoeMlp) -> None:
        self.ln_attn = nnx.LayerNorm(config.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(config.d_model, config.num_heads, rngs=rngs)
        self.ln_moe = nnx.LayerNorm(config.d_model, rngs=rngs)
        self.moe = mlp(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.ln_attn(x))
        y, aux_loss = self.moe(self.ln_moe(x))
        return x + y, aux_loss


class MoeTransformer(nnx.Module):
    """Decoder-only MoE transformer: ``tokens -> (logits, mean aux loss over layers)``; ``mlp`` is the
    expert layer (``MoeMlp``, einsum dispatch; ``examples/moe_topk.TopKMoeMlp``, sort + gather routing)."""

    def __init__(self, config: Config, *, rngs: Rngs, mlp: type[nnx.Module] = MoeMlp) -> None:
        self.token_embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=EMBED_INIT, rngs=rngs)
        self.pos_embed = nnx.Embed(config.seq_len, config.d_model, embedding_init=EMBED_INIT, rngs=rngs)
        self.blocks = nnx.List([MoeBlock(config, rngs=rngs, mlp=mlp) for _ in range(config.num_layers)])
        self.ln_final = nnx.LayerNorm(config.d_model, rngs=rngs)
        self.lm_head = nnx.Linear(config.d_model, config.vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self.token_embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))
        aux_losses = []
        for block in self.blocks:
            x, aux_loss = block(x)
            aux_losses.append(aux_loss)
        return self.lm_head(self.ln_final(x)), sum(aux_losses) / len(aux_losses)


def graphdef(config: Config, mlp: type[nnx.Module] = MoeMlp) -> nnx.GraphDef[MoeTransformer]:
    """The static structure of the model, obtained without allocating parameters."""
    abstract_model = nnx.eval_shape(lambda: MoeTransformer(config, rngs=InitKeys(jax.random.key(0)), mlp=mlp))
    return nnx.graphdef(abstract_model)


def init_params(config: Config, key: jax.Array, mlp: type[nnx.Module] = MoeMlp) -> Params:
    """Fresh parameters as a plain nested dict of arrays."""
    return nnx.to_pure_dict(nnx.state(MoeTransformer(config, rngs=InitKeys(key), mlp=mlp), nnx.Param))


def make_batch(config: Config, key: jax.Array, batch_size: int) -> Batch:
    """Random tokens, int32 ``[batch, seq_len + 1]``."""
    return {"tokens": jax.random.randint(key, (batch_size, config.seq_len + 1), 0, config.vocab_size,
                                         dtype=jnp.int32)}


def workload(
    config: str | Config = "small",
    *,
    abstract: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
    family: str = "moe",
    configs: Mapping[str, Any] = CONFIGS,
    mlp: type[nnx.Module] = MoeMlp,
) -> Workload:
    """An MoE train step (adamw, LM loss + load-balancing loss) with its arguments; ``family``, ``configs``
    and ``mlp`` name another expert layer's variant (``examples/moe_topk.py``)."""
    name, cfg = resolve_config(family, configs, config, batch_size)
    model_def = graphdef(cfg, mlp)

    def loss_fn(params: Params, batch: Batch) -> jax.Array:
        tokens = batch["tokens"]
        logits, aux_loss = nnx.merge(model_def, params)(tokens[:, :-1])
        return next_token_loss(logits, tokens[:, 1:]) + cfg.aux_loss_weight * aux_loss

    return build_workload(
        name,
        cfg,
        init_params=lambda key: init_params(cfg, key, mlp),
        make_batch=lambda key, size: make_batch(cfg, key, size),
        loss_fn=loss_fn,
        optimizer=optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay),
        abstract=abstract,
        seed=seed,
    )
