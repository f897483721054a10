#!/usr/bin/env bash
# One command on a lent GPU machine (Python 3.12, torch, pyarrow; no ray, no av, no
# internet): install the wheels carried with the working tree, then run
# benchmarks/gpu_check.py (pin_memory + async copy, a GPU actor stage, the SD trainer
# with its UNet on the GPU, the crop workload with batches on the GPU). At most ~8 min.
#
#   bash benchmarks/gpu_wheels.sh     # here, once: the wheels, in parts of < 64 MiB (gitignored)
#   # device call 1: command "true", carry ["benchmarks/gpu_wheels/part1"]; call 2: the same with part2
#   # (call 3: part3 = av, only if video is wanted); then: command "bash benchmarks/gpu_check.sh",
#   # timeout_s 540 (the carried parts stay on the warm machine between calls)
#   bash benchmarks/gpu_check.sh --dry-run   # here, on the CPU: every step at a tiny size
#
# Writes benchmarks/results/gpu_check.{json,md} (and copies them to $OUT when set, as the
# device tool does), the device named in both.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
DRY=""
if [[ "${1:-}" == "--dry-run" ]]; then DRY="--dry-run"; fi
if [[ -z "$DRY" ]] && ! python3 -c "import ray, av" 2>/dev/null; then
  W="$ROOT/benchmarks/gpu_wheels"
  for p in part1 part2; do
    [[ -d "$W/$p" ]] || { echo "missing $W/$p: run benchmarks/gpu_wheels.sh here and carry it (see the top of this file)" >&2; exit 2; }
  done
  TMP="$(mktemp -d)"
  cp "$W"/part*/*.whl "$TMP"/ 2>/dev/null || true
  RAYW="$(basename "$(ls "$W"/part1/ray-*.whl.piece00)" .piece00)"
  cat "$W/part1/$RAYW.piece00" "$W/part2/$RAYW.piece01" > "$TMP/$RAYW"
  (cd "$TMP" && sha256sum -c "$W/part2/ray.sha256")
  # Only the carried wheels (--no-index): what is installed and satisfies stays; torch is
  # never asked for (nothing here requires it).
  WANT="ray simplejpeg pillow tqdm numpy"
  if ls "$TMP"/av-*.whl >/dev/null 2>&1; then WANT="$WANT av"; fi
  timeout 240 python3 -m pip install -q --no-index --find-links "$TMP" $WANT
  rm -rf "$TMP"
fi
# The window decode's C extension when a compiler and libjpeg's headers are there (optional).
timeout 60 python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "no C extension: whole-image decode"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec timeout 420 python3 -m benchmarks.gpu_check $DRY ${OUT:+--out "$OUT"}
