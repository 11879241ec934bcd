"""Workloads, traces, latency statistics and output files shared by the tooling (the simulator,
``kvserve.sim``, and the benchmarks, ``kvserve.benchmarks``). Pure Python, no model; it imports
neither of them."""
