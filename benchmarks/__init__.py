"""Cross-framework benchmark suite: fixtures, runners, a parity gate, timing and the report.

Run ``python benchmarks/run.py`` from the repository root to regenerate ``REPORT.md``.
"""
