"""sbloader's benchmarks: one harness (:mod:`benchmarks.harness`) and scenarios
(:mod:`benchmarks.scenarios`). ``python -m benchmarks --help``; see benchmarks/README.md."""
