"""Example workloads for autoshard: MLP, GPT, mixture-of-experts and a conv net.

Each module (``examples.mlp``, ``examples.gpt``, ``examples.moe``, ``examples.moe_topk``,
``examples.convnet``) offers ``CONFIGS`` and ``workload(config, *, abstract,
seed, batch_size) -> Workload``; see :mod:`examples.common`.
"""
from __future__ import annotations

from examples.common import Workload, count_params, is_abstract

__all__ = ["Workload", "count_params", "is_abstract"]
