"""Benchmarks and evaluations: measured side by side in one run, reported with what they cost."""
