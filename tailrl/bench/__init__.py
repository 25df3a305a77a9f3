"""Benchmarks: each prints ratios measured in one run (the machine is shared and noisy)."""
