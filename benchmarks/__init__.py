"""Benchmarks: see issue-specific scripts; run as python -m benchmarks.<name>."""
