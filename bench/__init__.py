"""voicelane benchmarks: audio metrics, an open-loop load generator, capacity search, plots, the official baseline.

Definitions: docs/benchmarks/README.md section 1 (implemented in bench/metrics.py). See docs/benchmarks/README.md.
"""
