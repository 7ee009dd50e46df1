"""No overhead on one device: ``@autoshard`` on a one-device mesh compiles to ``jax.jit``'s program.

On one device there is nothing to shard, so the decorated step must cost what
``jax.jit(step, donate_argnums=state)`` costs: the same optimized HLO (opcode
counts, fused computations included) and the same ``memory_analysis()``. A
sharding constraint left in (it kept 39 converts of the mixed-precision GPT
step from folding), a lost donation or an output copy shows here as a count or
a byte that differs. Checked on the GPT example in fp32, bf16 and mixed
precision (fp32 master weights, bf16 compute).
"""
from __future__ import annotations

import jax
import pytest

import autoshard
from autoshard.compiler.hlo_parse import opcode_counts
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.runtime.spmd import make_jax_mesh
from examples import gpt

CONFIGS = ["tiny", "tiny-bf16", "tiny-mixed"]


def _memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    return {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in ("argument", "output", "alias", "temp")}


@pytest.mark.parametrize("config", CONFIGS)
def test_one_device_step_compiles_to_the_jit_program(devices8, config):
    work = gpt.workload(config, abstract=True)
    mesh = make_jax_mesh((1,), ("data",), devices=devices8[:1])
    step = autoshard.autoshard(work.step, mesh=mesh, num_stages=1, options=IntraOpOptions(time_limit_s=1.0))
    ours = step.lower(*work.args).compile()
    state_leaves = len(jax.tree.leaves(work.args[:2]))  # params and optimizer state, donated as the jit below
    assert step.spmd_step.donate_argnums == tuple(range(state_leaves))
    theirs = jax.jit(work.step, donate_argnums=(0, 1)).lower(*work.args).compile()

    mine, plain = opcode_counts(ours.as_text()), opcode_counts(theirs.as_text())
    differ = {op: (mine.get(op, 0), plain.get(op, 0)) for op in set(mine) | set(plain)
              if mine.get(op, 0) != plain.get(op, 0)}
    assert not differ, f"{config}: opcode counts (autoshard, jax.jit) differ: {differ}"
    assert _memory(ours) == _memory(theirs)
    assert _memory(ours)["alias"] > 0  # the donation reached XLA
