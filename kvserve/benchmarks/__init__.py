"""Benchmarks: offline throughput (vs transformers), an online load generator for any
OpenAI-compatible server, trace replay, cold start, and plots. ``kvserve bench --help``."""
