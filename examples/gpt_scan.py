"""The GPT of ``examples/gpt.py`` with its blocks under ``flax.nnx.scan``: one stacked block, not a list.

The parameters of all ``num_layers`` blocks live in one ``Block`` whose arrays carry a leading layer
axis (``params["blocks"]["attn"]["q"]["kernel"]`` is ``[num_layers, d_model, d_model]``), and the
forward pass runs the block under ``nnx.scan``: the traced step holds one block body inside a
``scan`` (and its transpose in the backward pass), as MaxText's ``scan_layers``, Flax ``nn.scan`` or
penzai's ``LayerStack`` write deep models so that they compile in constant time.

Same configs, loss and optimizer as ``examples/gpt.py``; ``stack_blocks`` turns that example's
parameters into these (the same weights), so the two can be compared step for step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples import gpt
from examples.common import InitKeys, Params, Workload
from examples.gpt import CONFIGS, EMBED_INIT, Block, Config
from examples.gpt import init_params as unrolled_init_params

__all__ = ["CONFIGS", "Config", "GPTScan", "graphdef", "init_params", "stack_blocks", "workload"]


class GPTScan(nnx.Module):
    """Decoder-only transformer whose blocks are one stacked ``Block`` run under ``nnx.scan``."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs | InitKeys) -> None:
        self.token_embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=EMBED_INIT, rngs=rngs)
        self.pos_embed = nnx.Embed(config.seq_len, config.d_model, embedding_init=EMBED_INIT, rngs=rngs)
        self.blocks = Block(config, rngs=rngs)  # the structure of one block; its arrays are stacked by merge
        self.ln_final = nnx.LayerNorm(config.d_model, rngs=rngs)
        self.lm_head = nnx.Linear(config.d_model, config.vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.token_embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_block(h: jax.Array, block: Block) -> jax.Array:
            return block(h)

        x = run_block(x, self.blocks)
        return self.lm_head(self.ln_final(x))


def graphdef(config: Config) -> nnx.GraphDef[GPTScan]:
    """The static structure of the model (no parameters allocated)."""
    abstract_model = nnx.eval_shape(lambda: GPTScan(config, rngs=InitKeys(jax.random.key(0))))
    return nnx.graphdef(abstract_model)


def stack_blocks(params: Params) -> Params:
    """``examples/gpt.py`` parameters (``blocks`` a list of per-layer dicts) as this model's: each
    block leaf stacked over the layers on a new leading axis; every other leaf unchanged."""
    blocks = params["blocks"]
    layers = [blocks[i] for i in sorted(blocks)] if isinstance(blocks, dict) else list(blocks)
    out = {k: v for k, v in params.items() if k != "blocks"}
    out["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return out


def init_params(config: Config, key: jax.Array) -> Params:
    """Fresh parameters: exactly those of ``examples/gpt.py`` for the same key, blocks stacked."""
    return stack_blocks(unrolled_init_params(config, key))


def workload(
    config: str | Config = "small",
    *,
    abstract: bool = False,
    seed: int = 0,
    batch_size: int | None = None,
) -> Workload:
    """A scanned-GPT train step (adamw) with its ``(params, opt_state, batch)``: gpt's step and loss over
    ``GPTScan``."""
    return gpt.workload(config, abstract=abstract, seed=seed, batch_size=batch_size, family="gpt_scan",
                        graphdef_fn=graphdef, init_fn=init_params)
