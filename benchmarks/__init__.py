"""Benchmarks: plan quality against the classic strategies, planning time, model fidelity.

``python -m benchmarks.run [--quick]`` regenerates ``benchmarks/RESULTS.md``;
``python -m benchmarks.planning_scaling`` runs the planning-time scaling study alone.
Numbers are modeled (cost model and compiled HLO), never CPU wall time of a
sharded step; planning time is the one real measurement.
"""
