"""Benchmarks: the gateway against direct and nginx, side by side (see perf/README.md)."""
