"""Benchmarks run by scripts/bench.py; each module has main(argv) and reports ratios measured in one run."""
