"""Mixture-of-experts transformer with top-k routing by sort and gather/scatter, written with Flax NNX.

The same transformer as ``examples.moe`` (GPT blocks whose MLP is a mixture of
``num_experts`` GELU MLPs, batched weights ``[E, d, ff]``), routed the way
sort-based implementations (MaxText's dropping path, Switch/Megablocks-style
permutation) route tokens, with no ``[group, token, expert, capacity]`` mask:

- a softmax router ranks the experts of each token with ``argsort`` and keeps
  the top ``top_k``; their gates are renormalized to sum to one;
- within a routing group (one sequence), the ``top_k * seq_len`` (choice,
  token) assignments are stably sorted by expert, choice-major, so first
  choices take an expert's slots before second choices and earlier tokens
  before later ones; a token's slot is its rank among its expert's
  assignments (rank minus the expert's start, from a scatter-add count and a
  cumulative sum); assignments beyond ``capacity = ceil(capacity_factor *
  top_k * seq_len / num_experts)`` are dropped (their residual passes);
- dispatch gathers the sorted tokens (``take_along_axis``) and scatters them
  into a ``[group, expert * capacity, d]`` buffer, which becomes the experts'
  ``[E, group, capacity, d]`` input; combine gathers each assignment's expert
  output back, weights it by its gate and scatter-adds it onto its token.

Every gather and scatter has the group as a batching dimension, so a planner
can split groups (data parallelism) and then move the buffer's expert dim onto
devices (expert parallelism: an all-to-all), as with the einsum dispatch. The
loss is next-token cross-entropy plus ``aux_loss_weight`` times the
load-balancing loss of ``examples.moe``; the optimizer is ``optax.adamw``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from examples import moe
from examples.common import InitKeys, Workload

Rngs = nnx.Rngs | InitKeys


@dataclass(frozen=True)
class Config(moe.Config):
    """Top-k MoE transformer hyper-parameters: moe's, plus ``top_k``; derive variants with ``dataclasses.replace``."""

    top_k: int = 2  # experts per token

    @property
    def experts_per_token(self) -> int:
        """Experts each token is routed to: ``top_k``."""
        return self.top_k


# moe's configs (tiny, small and the ~1.82B-parameter "large", used abstractly), routed top-2 by sort/gather.
CONFIGS: dict[str, Config] = {name: Config(**asdict(c)) for name, c in moe.CONFIGS.items()}


@dataclass(frozen=True)
class Routing:
    """Where each of a group's ``top_k * seq_len`` assignments goes, sorted by expert: ``[G, k*T]`` each."""

    token: jax.Array  # the token the assignment routes
    slot: jax.Array  # expert * capacity + rank in the expert; in range even when dropped (then unused)
    weight: jax.Array  # the renormalized gate, 0 where the assignment is dropped


class TopKRouter(nnx.Module):
    """Softmax router: argsort top-k, then slots by a stable sort of the assignments by expert."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, capacity: int, *, rngs: Rngs) -> None:
        self.num_experts, self.top_k, self.capacity = num_experts, top_k, capacity
        self.gate = nnx.Linear(d_model, num_experts, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[Routing, jax.Array]:
        """``x [G, T, d]`` -> (routing, load-balancing loss)."""
        probs = jax.nn.softmax(self.gate(x), axis=-1)  # [G, T, E]
        groups, tokens, num_experts = probs.shape
        experts = jnp.argsort(-probs, axis=-1, stable=True)[..., : self.top_k]  # [G, T, k]
        gates = jnp.take_along_axis(probs, experts, axis=-1)
        gates = gates / jnp.maximum(jnp.sum(gates, axis=-1, keepdims=True), jnp.finfo(gates.dtype).eps)

        first = jax.nn.one_hot(experts[..., 0], num_experts, dtype=probs.dtype)
        aux_loss = num_experts * jnp.mean(jnp.sum(jnp.mean(probs, axis=1) * jnp.mean(first, axis=1), axis=-1))

        # Assignment j = choice * T + token: choice-major, so a stable sort puts first choices first.
        assigned = jnp.swapaxes(experts, 1, 2).reshape(groups, self.top_k * tokens)
        weights = jnp.swapaxes(gates, 1, 2).reshape(groups, self.top_k * tokens)
        order = jnp.argsort(assigned, axis=-1, stable=True)
        sorted_expert = jnp.take_along_axis(assigned, order, axis=-1)
        counts = jax.vmap(lambda e: jnp.zeros(num_experts, jnp.int32).at[e].add(1))(assigned)  # [G, E]
        starts = jnp.cumsum(counts, axis=-1) - counts
        rank = jnp.arange(self.top_k * tokens)[None, :] - jnp.take_along_axis(starts, sorted_expert, axis=-1)
        kept = rank < self.capacity
        slot = sorted_expert * self.capacity + jnp.where(kept, rank, 0)
        weight = jnp.take_along_axis(weights, order, axis=-1) * kept
        return Routing(token=order % tokens, slot=slot, weight=weight), aux_loss


def dispatch(x: jax.Array, routing: Routing, num_experts: int, capacity: int) -> jax.Array:
    """``x [G, T, d]`` -> the experts' input ``[E, G, C, d]`` (dropped assignments write nowhere)."""
    groups, _, d_model = x.shape
    routed = jnp.take_along_axis(x, routing.token[..., None], axis=1)  # [G, k*T, d]
    target = jnp.where(routing.weight > 0, routing.slot, num_experts * capacity)  # out of range: dropped

    def scatter(slots: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.zeros((num_experts * capacity, d_model), x.dtype).at[slots].set(values, mode="drop")

    buffer = jax.vmap(scatter)(target, routed)  # [G, E*C, d]
    return jnp.swapaxes(buffer.reshape(groups, num_experts, capacity, d_model), 0, 1)


def combine(expert_out: jax.Array, routing: Routing, tokens: int) -> jax.Array:
    """``expert_out [E, G, C, d]`` -> ``[G, T, d]``: each assignment's output, gated, added to its token."""
    num_experts, groups, capacity, d_model = expert_out.shape
    flat = jnp.swapaxes(expert_out, 0, 1).reshape(groups, num_experts * capacity, d_model)
    picked = jnp.take_along_axis(flat, routing.slot[..., None], axis=1) * routing.weight[..., None]

    def scatter(token: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.zeros((tokens, d_model), expert_out.dtype).at[token].add(values)

    return jax.vmap(scatter)(routing.token, picked)


class TopKMoeMlp(nnx.Module):
    """``num_experts`` GELU MLPs stored as batched weights, fed by a sort-based top-k router."""

    def __init__(self, config: Config, *, rngs: Rngs) -> None:
        e, d, f = config.num_experts, config.d_model, config.expert_hidden
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.num_experts, self.capacity = e, config.capacity
        self.router = TopKRouter(d, e, config.top_k, config.capacity, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (e, d, f)))
        self.b_in = nnx.Param(jnp.zeros((e, f)))
        self.w_out = nnx.Param(init(rngs.params(), (e, f, d)))
        self.b_out = nnx.Param(jnp.zeros((e, d)))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [G, T, d]`` -> ``(y [G, T, d], aux_loss)``."""
        routing, aux_loss = self.router(x)
        expert_in = dispatch(x, routing, self.num_experts, self.capacity)
        hidden = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, self.w_in[...])
                             + self.b_in[...][:, None, None, :])
        expert_out = jnp.einsum("egcf,efd->egcd", hidden, self.w_out[...]) + self.b_out[...][:, None, None, :]
        return combine(expert_out, routing, x.shape[1]), aux_loss


def workload(
    config: str | Config = "small",
    *,
    abstract: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
) -> Workload:
    """A top-k MoE train step (adamw, LM loss + load-balancing loss) with its arguments: moe's transformer
    with ``TopKMoeMlp`` as its expert layer."""
    return moe.workload(config, abstract=abstract, seed=seed, batch_size=batch_size, family="moe_topk",
                        configs=CONFIGS, mlp=TopKMoeMlp)
