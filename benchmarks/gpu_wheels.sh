#!/usr/bin/env bash
# Download here the cp312 wheels benchmarks/gpu_check.sh installs on a lent GPU machine
# (Python 3.12, torch and pyarrow installed there; no ray, no av; no internet), and split
# them into parts that each fit one device call's carry (64 MiB with the working tree): ray's wheel (~79 MB) in
# two halves (part1, part2), the others packed after it (av, ~35 MB, in part3):
#
#   bash benchmarks/gpu_wheels.sh          # -> benchmarks/gpu_wheels/part1..part3 (gitignored)
#
# then, with the device tool: run(command="true", carry=["benchmarks/gpu_wheels/part1"]),
# the same for part2 (and part3: av, only for video; gpu_check does not need it), and
# run(command="bash benchmarks/gpu_check.sh", timeout_s=540): ignored paths carried by
# earlier calls stay on the warm machine for the later ones.
#
# --no-deps with the dependency list spelled out: pip never resolves torch.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="$HERE/gpu_wheels"
ALL="$OUT/all"
rm -rf "$OUT" && mkdir -p "$ALL" "$OUT/part1" "$OUT/part2"
PKGS=(
  ray==2.60.0 click filelock jsonschema jsonschema-specifications referencing rpds-py attrs
  "msgpack<2" "packaging>=24.2" protobuf pyyaml requests charset-normalizer idna urllib3 certifi
  typing-extensions av simplejpeg pillow tqdm numpy
)
pip download --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --no-deps -d "$ALL" "${PKGS[@]}"
if ls "$ALL" | grep -Eiq '^(torch|nvidia|triton)'; then
  echo "a torch/CUDA wheel was downloaded: refusing (pip must never resolve torch)" >&2; exit 1
fi
# ray's wheel (~79 MB) in two pieces, one per part; the other wheels where they fit.
RAY="$(ls "$ALL"/ray-*.whl)"
split -n 2 -d "$RAY" "$OUT/part1/$(basename "$RAY").piece"
mv "$OUT/part1/$(basename "$RAY").piece01" "$OUT/part2/"
LIMIT=$((52 * 1024 * 1024))  # the carry's 64 MiB holds the working tree too (~8 MiB)
for w in $(ls -S "$ALL"/*.whl | grep -v '/ray-'); do  # largest first, into the first part it fits
  k=1
  while :; do
    mkdir -p "$OUT/part$k"
    used=$(du -cb "$OUT/part$k" | tail -1 | cut -f1)
    if (( used + $(stat -c %s "$w") < LIMIT )); then cp "$w" "$OUT/part$k/"; break; fi
    k=$((k + 1))
  done
done
(cd "$ALL" && sha256sum "$(basename "$RAY")") > "$OUT/part2/ray.sha256"
rm -rf "$ALL"
du -sh "$OUT"/part*
for p in "$OUT"/part*; do
  if (( $(du -cb "$p" | tail -1 | cut -f1) >= 54 * 1024 * 1024 )); then echo "$p is over 54 MiB (the carry's 64 MiB less the working tree)" >&2; exit 1; fi
done
echo "ready: carry each of $(cd "$OUT" && echo part*) in its own device call (see benchmarks/gpu_check.sh)"
