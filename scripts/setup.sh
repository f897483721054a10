#!/usr/bin/env bash
# Install sbloader and its dependencies. torch 2.13.0 first (a CPU build on
# these machines), so the package's torch>=2.3 is already satisfied and pip never
# pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[test]"
