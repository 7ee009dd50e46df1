"""The long fuzz run: ``python -m tests.fuzz --n 2000 [--seed 1] [--minutes 30] [--out fuzz.json]``.

Draws ``--n`` random train steps (tests/fuzz/fuzz_programs.py), plans each on every mesh of
``fuzz_check.MESHES`` ((2, 4), (8,), (1, 8) and 6 devices as (2, 3)), runs it and compares it with one
device. Prints one line per program and a summary, writes the summary (and every crash or mismatch with
its program, reproducible with ``--program``) to ``--out``, and exits 1 if any program crashed or
mismatched. ``--minutes`` stops drawing new programs after that long, for a run bounded by time.

    python -m tests.fuzz --program "Program(family='tokens', ...)"   # re-run one program from a report
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_check import CLUSTERS, MESHES, Outcome, check, reference  # noqa: E402
from fuzz_programs import Layer, Program, programs  # noqa: E402


def run_program(program: Program, cluster: str) -> list[Outcome]:
    try:
        want = reference(program)
    except Exception as err:  # noqa: BLE001 - a program the generator got wrong is a generator bug: report it
        return [Outcome("crash", program, "reference", cluster, f"one-device reference failed: {err!r}")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [check(program, mesh, cluster, want=want) for mesh in MESHES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="programs to draw")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis seed (same seed, same programs)")
    parser.add_argument("--minutes", type=float, default=None, help="stop drawing new programs after this long")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    parser.add_argument("--program", default=None, help="re-run one program (its repr from a report)")
    parser.add_argument("--cluster", default="compute-bound", choices=sorted(CLUSTERS),
                        help="cluster for --program")
    args = parser.parse_args(argv)

    if args.program:
        program = eval(args.program, {"Program": Program, "Layer": Layer})  # noqa: S307 - our own repr
        outcomes = run_program(program, args.cluster)
        for o in outcomes:
            print(o)
        return int(any(o.status in ("crash", "mismatch") for o in outcomes))

    start = time.perf_counter()
    outcomes: list[Outcome] = []
    programs_run: list[str] = []
    deadline = start + 60 * args.minutes if args.minutes else None

    @seed(args.seed)
    @settings(max_examples=args.n, phases=[Phase.generate], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(program=programs(), cluster=st.sampled_from(sorted(CLUSTERS)))
    def one(program: Program, cluster: str) -> None:
        if deadline is not None and time.perf_counter() > deadline:
            return
        t = time.perf_counter()
        found = run_program(program, cluster)
        outcomes.extend(found)
        programs_run.append(repr(program))
        counts = collections.Counter(o.status for o in found)
        print(f"{len(programs_run):5d} {time.perf_counter() - t:5.1f}s {dict(counts)} {cluster}: "
              f"{program.describe()}", flush=True)
        for o in found:
            if o.status in ("crash", "mismatch"):
                print(f"      {o.status} on {o.mesh}: {o.detail}\n      repro: python -m tests.fuzz --cluster "
                      f"{cluster} --program {repr(program)!r}", flush=True)

    one()
    seconds = time.perf_counter() - start
    counts = collections.Counter(o.status for o in outcomes)
    sharded = sum(o.sharded for o in outcomes)
    summary = {
        "programs": len(programs_run), "distinct_programs": len(set(programs_run)), "cases": len(outcomes),
        "meshes": {name: list(shape) for name, shape in MESHES.items()}, "clusters": sorted(CLUSTERS),
        "outcomes": dict(counts), "sharded_plans": sharded, "seconds": round(seconds, 1), "seed": args.seed,
        "failures": [{"status": o.status, "mesh": o.mesh, "cluster": o.cluster, "program": repr(o.program),
                      "detail": o.detail} for o in outcomes if o.status in ("crash", "mismatch")],
        "refusals": [{"mesh": o.mesh, "program": repr(o.program), "detail": o.detail[:300]}
                     for o in outcomes if o.status == "refused"],
    }
    print(f"{len(programs_run)} programs ({len(set(programs_run))} distinct), {len(outcomes)} planned runs on "
          f"meshes {', '.join(MESHES)}: {dict(counts)}; {sharded} sharded plans; {seconds / 60:.1f} min")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return int(bool(summary["failures"]))


if __name__ == "__main__":
    raise SystemExit(main())
