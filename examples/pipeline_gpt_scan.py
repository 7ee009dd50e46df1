"""The scanned GPT (``examples/gpt_scan.py``: blocks under ``nnx.scan``) with its loss marked for pipelining.

``workload(config, abstract=...)`` is ``examples.gpt_scan``'s with ``examples.pipeline_gpt``'s marked step, so

    autoshard plan examples/pipeline_gpt_scan.py --config tiny --stages 2 --microbatches 2 --cluster cpu-8

cuts the scanned stack into stages by layer range (each stage scans its own iterations).
"""
from __future__ import annotations

from typing import Any

from examples import gpt_scan
from examples.pipeline_gpt import marked

CONFIGS = gpt_scan.CONFIGS


def workload(config: str | gpt_scan.Config = "small", *, abstract: bool = False, seed: int = 0,
             batch_size: int | None = None) -> Any:
    return marked(gpt_scan.workload(config, abstract=abstract, seed=seed, batch_size=batch_size))
