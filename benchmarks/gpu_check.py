"""One accelerator against the model: GPT steps timed under ``jax.jit`` and ``@autoshard``, set beside the plan.

    python -m benchmarks.gpu_check [--configs medium,medium:bf16,medium:mixed,large:mixed@8]
                                   [--steps 10] [--warmup 3] [--cluster PRESET|FILE] [--out FILE.md]

Runs on ``jax.devices()[0]``, whatever it is (a GPU or TPU; on a CPU it says that no accelerator is present
and runs the tiny configs). For each GPT config (``NAME[:bf16|:mixed][@BATCH]`` of ``examples/gpt.py``:
``:bf16`` stores and computes in bfloat16, ``:mixed`` keeps float32 parameters and computes in bfloat16)
it measures the median of ``--steps`` timed steps after ``--warmup`` untimed ones, each step fed the state
the last one returned (donated, as a training loop does), of

- ``jax.jit(step, donate_argnums=(0, 1))``, the baseline;
- ``@autoshard`` on a one-device mesh (its overhead over ``jax.jit`` is the second column);

and sets them beside the plan's modeled step time (``plan.step_s``, from the ClusterSpec: ``--cluster``, or
``autoshard profile`` of the device when none is named), the modeled against the compiled peak memory
(``compiled.memory_analysis()``: argument + output - alias + temp) and the achieved TFLOP/s (XLA's FLOP
count of the jit program over its median step). Wall times on a CPU say nothing about a GPU: the CPU run
only keeps the script working (tests/sim/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from rich.console import Console

import autoshard
from autoshard.meshes.cluster import ClusterSpec, get_cluster
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.ledger import fmt_bytes, fmt_s
from autoshard.runtime.spmd import make_jax_mesh
from benchmarks.tables import TextTable, render_markdown, render_rich
from examples import gpt

ACCELERATOR_CONFIGS = ("medium", "medium:bf16", "medium:mixed", "large:mixed@8")  # the table
CPU_CONFIGS = ("tiny", "tiny:bf16", "tiny:mixed")
HEADERS = ("config", "jax.jit measured", "@autoshard measured", "autoshard predicts",
           "peak memory predicted vs compiled", "achieved TFLOP/s (jax.jit)")
PRECISIONS = {"": {}, "bf16": {"param_dtype": "bfloat16", "dtype": "bfloat16"}, "mixed": {"dtype": "bfloat16"}}


@dataclass(frozen=True)
class CheckRow:
    config: str
    jit_s: float  # median measured step under jax.jit
    autoshard_s: float  # median measured step under @autoshard (one-device mesh)
    predicted_s: float  # the plan's modeled step
    predicted_peak_bytes: float
    compiled_peak_bytes: float  # argument + output - alias + temp of the @autoshard executable
    flops: float  # XLA's count for one step of the jit program

    def cells(self) -> tuple[str, ...]:
        overhead = self.autoshard_s / self.jit_s - 1
        memory = self.predicted_peak_bytes / self.compiled_peak_bytes - 1
        return (self.config, fmt_s(self.jit_s), f"{fmt_s(self.autoshard_s)} ({overhead:+.1%})",
                f"{fmt_s(self.predicted_s)} ({self.predicted_s / self.jit_s:.2f}x)",
                f"{fmt_bytes(self.predicted_peak_bytes)} vs {fmt_bytes(self.compiled_peak_bytes)} ({memory:+.1%})",
                f"{self.flops / self.jit_s / 1e12:.3g}")


def gpt_config(spec: str) -> tuple[gpt.Config, int | None]:
    """``NAME[:bf16|:mixed][@BATCH]`` -> (the config, the batch size or None)."""
    name, _, batch = spec.partition("@")
    base, _, precision = name.partition(":")
    if base not in gpt.CONFIGS or precision not in PRECISIONS:
        raise SystemExit(f"unknown config {spec!r}: NAME[:bf16|:mixed][@BATCH] with NAME one of {sorted(gpt.CONFIGS)}")
    return dataclasses.replace(gpt.CONFIGS[base], **PRECISIONS[precision]), int(batch) if batch else None


def median_step_s(step: Callable[..., Any], state: tuple[Any, Any], batch: Any, warmup: int, steps: int) -> float:
    """Median seconds of ``steps`` calls after ``warmup`` (compiling included there), state fed forward."""
    params, opt_state = state
    times = []
    for k in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready(loss)
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copies(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.copy(), tree)


def check_config(spec: str, cluster: ClusterSpec, *, warmup: int, steps: int) -> CheckRow:
    config, batch_size = gpt_config(spec)
    work = gpt.workload(config, batch_size=batch_size)
    params, opt_state, batch = work.args
    plain = jax.jit(work.step, donate_argnums=(0, 1))
    flops = float((plain.lower(*work.args).compile().cost_analysis() or {}).get("flops", 0.0))
    jit_s = median_step_s(plain, (_copies(params), _copies(opt_state)), batch, warmup, steps)

    mesh = make_jax_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = autoshard.autoshard(work.step, mesh=mesh, cluster=cluster, num_stages=1,
                               options=IntraOpOptions(time_limit_s=5.0))
    compiled = step.lower(*work.args).compile()
    stats = compiled.memory_analysis()
    compiled_peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                     + stats.temp_size_in_bytes)
    autoshard_s = median_step_s(step, (params, opt_state), batch, warmup, steps)
    plan = step.plan
    return CheckRow(spec, jit_s, autoshard_s, plan.step_s, plan.ledger.peak_memory_bytes, float(compiled_peak), flops)


def device_line() -> tuple[str, bool]:
    """What the check runs on, and whether it is an accelerator."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return (f"no accelerator present: jax.devices()[0] is {device.device_kind} ({device.platform}); the times "
                "below only keep the script working and say nothing about a GPU", False)
    return f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", True


def device_cluster(name: str | None) -> ClusterSpec:
    """``name`` (a preset or file) for one device, else ``autoshard profile`` of the device."""
    if name:
        return get_cluster(name, num_devices=1)
    from autoshard.runtime.profile import ProfileOptions, profile_devices

    return profile_devices(ProfileOptions(repeats=3)).spec


def check_table(configs: Sequence[str], cluster: ClusterSpec, *, warmup: int, steps: int) -> TextTable:
    rows = [check_config(c, cluster, warmup=warmup, steps=steps).cells() for c in configs]
    title = (f"One device against the model (ClusterSpec {cluster.name}; median of {steps} steps after "
             f"{warmup} warm-ups)")
    return TextTable(title, HEADERS, tuple(rows), right=frozenset(range(1, len(HEADERS))))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", help="comma-separated NAME[:bf16|:mixed][@BATCH] (default: the issue's four "
                        "on an accelerator, the tiny three on a CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is kept)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling included)")
    parser.add_argument("--cluster", help="ClusterSpec preset or file (default: autoshard profile of the device)")
    parser.add_argument("--out", help="also write the table as markdown here")
    args = parser.parse_args(argv)
    console = Console()
    line, accelerator = device_line()
    console.print(line, highlight=False)
    configs = args.configs.split(",") if args.configs else list(ACCELERATOR_CONFIGS if accelerator else CPU_CONFIGS)
    table = check_table(configs, device_cluster(args.cluster), warmup=args.warmup, steps=args.steps)
    console.print(render_rich(table))
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{line}\n\n{render_markdown(table)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
