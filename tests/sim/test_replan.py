"""A decorated step called with arguments of new shapes is planned again, and says so once, with what changed."""
from __future__ import annotations

import warnings

import optax
import pytest

import autoshard
from autoshard.errors import ReplanWarning
from autoshard.passes.intra_op import IntraOpOptions
from mlp_steps import host_args, train_step

FAST = IntraOpOptions(time_limit_s=1.0)


def _halved(batch):
    return {k: v[: v.shape[0] // 2] for k, v in batch.items()}


def test_a_new_batch_shape_replans_and_says_why_once(devices8):
    tx = optax.sgd(0.1)
    params, opt_state, batch = host_args(tx, width=16, batch=16)
    said: list[str] = []
    step = autoshard.autoshard(train_step(tx, marker=False), mesh=(2, 4), cluster="cpu-8", num_stages=1,
                               options=FAST, progress=said.append)
    params, opt_state, _ = step(params, opt_state, batch)
    assert not [line for line in said if "again" in line] and "compiling (the first call)" in said
    small = _halved(batch)
    for _ in range(2):  # the second call with the new shape reuses its plan: nothing more to say
        params, opt_state, _ = step(params, opt_state, small)
    replans = [line for line in said if "again" in line]
    assert replans == ["planning step again: its arguments changed ([2]['x'] (16, 16) float32 -> (8, 16) float32, "
                       "[2]['y'] (16, 16) float32 -> (8, 16) float32); plans are made per argument shape, so this "
                       "shape gets its own plan and compile (keep shapes fixed, e.g. pad the last batch, to plan "
                       "once)"]
    assert said.count("compiling (the new shapes)") == 1 and said.count("compiling (the first call)") == 1


def test_without_progress_a_replan_is_a_warning(devices8):
    tx = optax.sgd(0.1)
    params, opt_state, batch = host_args(tx, width=16, batch=16)
    step = autoshard.autoshard(train_step(tx, marker=False), mesh=(2, 4), cluster="cpu-8", num_stages=1,
                               options=FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplanWarning)
        params, opt_state, _ = step(params, opt_state, batch)  # the first plan is no news
    with pytest.warns(ReplanWarning, match=r"arguments changed \(\[2\]\['x'\] \(16, 16\) float32 -> \(8, 16\)"):
        step(params, opt_state, _halved(batch))
