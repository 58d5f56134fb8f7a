"""Connector benchmarks: plan building, push path, peer comparison.

See docs/connector-benchmarks.md.
"""
