"""The long fuzz run: ``python -m tests.fuzz --n 2000 [--seed 1] [--minutes 30] [--out fuzz.json] [--results F]``.

Draws ``--n`` random train steps (tests/fuzz/fuzz_programs.py), plans each on every mesh of
``fuzz_check.MESHES`` ((2, 4), (8,), (1, 8) and 6 devices as (2, 3)), runs it and compares it with one
device. Prints one line per program and a summary, writes the summary (and every crash or mismatch with
its program, reproducible with ``--program``) to ``--out``, and exits 1 if any program crashed or
mismatched. ``--minutes`` stops drawing new programs after that long, for a run bounded by time;
``--results benchmarks/RESULTS.md`` writes the counts there as its "## Fuzz corpus" section
(``benchmarks.run`` keeps that section when it rewrites the file).

    python -m tests.fuzz --program "Program(family='tokens', ...)"   # re-run one program from a report
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: compiled_examples

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
    parser.add_argument("--results", default=None, help="write the counts as the 'Fuzz corpus' section of this "
                                                         "markdown file (benchmarks/RESULTS.md)")
    parser.add_argument("--program", default=None, help="re-run one program (its repr from a report)")
    parser.add_argument("--cluster", default="compute-bound", choices=sorted(CLUSTERS),
                        help="cluster for --program")
    args = parser.parse_args(argv)

    if args.program:
        program = _program(args.program)
        outcomes = run_program(program, args.cluster)
        for o in outcomes:
            print(o)
        return int(any(o.status in ("crash", "mismatch") for o in outcomes))

    start, cpu_start, load_start = time.perf_counter(), time.process_time(), os.getloadavg()
    outcomes: list[Outcome] = []
    programs_run: list[str] = []
    clusters_run: list[str] = []
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
        clusters_run.append(cluster)
        counts = collections.Counter(o.status for o in found)
        print(f"{len(programs_run):5d} {time.perf_counter() - t:5.1f}s {dict(counts)} {cluster}: "
              f"{program.describe()}", flush=True)
        for o in found:
            if o.status in ("crash", "mismatch"):
                print(f"      {o.status} on {o.mesh}: {o.detail}\n      repro: python -m tests.fuzz --cluster "
                      f"{cluster} --program {repr(program)!r}", flush=True)

    one()
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    counts = collections.Counter(o.status for o in outcomes)
    sharded = sum(o.sharded for o in outcomes)
    summary = {
        "programs": len(programs_run), "distinct_programs": len(set(programs_run)), "cases": len(outcomes),
        "meshes": {name: list(shape) for name, shape in MESHES.items()}, "clusters": sorted(CLUSTERS),
        "outcomes": dict(counts), "sharded_plans": sharded, "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_s, 1), "seed": args.seed, "clusters_run": dict(collections.Counter(clusters_run)),
        "load": {"start": load_start, "end": os.getloadavg()},
        "layer_kinds": dict(collections.Counter(layer.kind for p in set(programs_run)
                                                for layer in _program(p).layers)),
        "failures": [{"status": o.status, "mesh": o.mesh, "cluster": o.cluster, "program": repr(o.program),
                      "detail": o.detail} for o in outcomes if o.status in ("crash", "mismatch")],
        "refusals": [{"mesh": o.mesh, "program": repr(o.program), "detail": o.detail[:300]}
                     for o in outcomes if o.status == "refused"],
    }
    print(f"{len(programs_run)} programs ({len(set(programs_run))} distinct), {len(outcomes)} planned runs on "
          f"meshes {', '.join(MESHES)}: {dict(counts)}; {sharded} sharded plans; {seconds / 60:.1f} min")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.results:
        from benchmarks.sections import replace_section

        path = Path(args.results)
        path.write_text(replace_section(path.read_text() if path.exists() else "", "## Fuzz corpus",
                                        results_section(summary, args)))
    return int(bool(summary["failures"]))


def _program(text: str) -> Program:
    return eval(text, {"Program": Program, "Layer": Layer})  # noqa: S307 - our own repr


def results_section(summary: dict, args: argparse.Namespace) -> str:
    """The "## Fuzz corpus" section of RESULTS.md from a run's summary."""
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = summary["outcomes"]
    meshes = ", ".join(f"{name} {tuple(shape)}" for name, shape in summary["meshes"].items())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["layer_kinds"].items(), key=lambda kv: -kv[1]))
    load = summary["load"]
    limit = f", stopped drawing after {args.minutes:g} min" if args.minutes else ""
    lines = [
        "## Fuzz corpus", "",
        f"Written by `python -m tests.fuzz --n {args.n} --seed {args.seed}"
        + (f" --minutes {args.minutes:g}" if args.minutes else "") + " --results benchmarks/RESULTS.md` "
        "(tests/fuzz); regenerate rather than edit. Random train steps (tests/fuzz/fuzz_programs.py), each "
        "planned on every mesh below, run for one step, and compared with the same step on one device "
        "(tests/fuzz/fuzz_check.py: loss, SGD parameters and Adam moments at 1e-4 of each leaf's scale, "
        "AdamW parameters within 3x the learning rate).", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {commit}; {os.cpu_count()} CPUs "
        f"shared with other work, 1-minute load {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at "
        "the end",
        f"- programs: {summary['programs']} drawn ({summary['distinct_programs']} distinct; seed {args.seed}"
        f"{limit}), priced on {', '.join(f'{c} ({n})' for c, n in summary['clusters_run'].items())}",
        f"- meshes: {meshes} (6 devices: the first 6 of the 8 simulated ones); {summary['cases']} planned runs",
        f"- outcomes: **{out.get('crash', 0)} crashes, {out.get('mismatch', 0)} mismatches**, {out.get('ok', 0)} "
        f"ok, {out.get('refused', 0)} refused with a PlanningError naming the construct",
        f"- sharded plans (at least one input split): {summary['sharded_plans']} of {summary['cases']}",
        f"- layers drawn (occurrences over the distinct programs): {kinds}",
        f"- time: {summary['seconds'] / 60:.1f} min wall, {summary['cpu_seconds'] / 60:.1f} min CPU",
        "- CI runs a fixed subset: 50 programs, each on two of the four meshes "
        "(tests/fuzz/test_fuzz_corpus.py)",
    ]
    for f in summary["failures"][:10]:
        lines.append(f"- {f['status']} on {f['mesh']} ({f['cluster']}): `{f['program']}`: {f['detail'][:300]}")
    for r in summary["refusals"][:10]:
        lines.append(f"- refused on {r['mesh']}: {r['detail'][:200]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
