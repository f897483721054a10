"""The scenarios: one module each (format: benchmarks/README.md, :mod:`benchmarks.harness.scenario`)."""
