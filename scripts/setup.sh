#!/usr/bin/env bash
# Install sbloader and its dependencies. torch 2.13.0 first (a CPU build on
# these machines), so the package's torch>=2.3 is already satisfied and pip never
# pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[test]"
# The window JPEG decode (sbloader/sources/_jpegwindow.c) against the system libjpeg-turbo,
# built next to its sources; optional: without it every image is decoded whole.
python3 setup.py --quiet build_ext --inplace || echo "sbloader: _jpegwindow not built (needs gcc and libjpeg-turbo headers: apt-get install libjpeg62-turbo-dev); crops decode whole images"
# Bytecode written once here: an editable install compiles nothing, and where
# PYTHONDONTWRITEBYTECODE is set (this project's machines) every process (each Ray
# worker, coordinator, rank) would compile the modules it imports again (~0.3 s of
# CPU for all of sbloader).
python3 -m compileall -q sbloader trainers tests scripts benchmarks > /dev/null || true
