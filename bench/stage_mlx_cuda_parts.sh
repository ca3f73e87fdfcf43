#!/usr/bin/env bash
# Stage MLX's CUDA build on the H200 machine in parts small enough to travel beside this
# working tree (the shipped demo models make it ~44 MB; one call carries at most 64 MiB in all).
# A variant of ../shared/device/stage-mlx-cuda.sh, which splits the ~90 MB wheel in two halves.
#
# Run from the project's root:  bash bench/stage_mlx_cuda_parts.sh [PART_MB]   (default 16)
# It prints one command per part, to run one right after the other on the same warm machine
# (it stays warm ~30 s after a call), each with the carry it names; the last installs into
# /root/mlx-site. Later commands: export PYTHONPATH=/root/mlx-site:$PWD
set -euo pipefail
part_mb=${1:-16}
root=$(git rev-parse --show-toplevel)
cd "$root"
mlx_v=$(python3 -c "import importlib.metadata as m; print(m.version('mlx'))" 2>/dev/null || echo 0.32.4)
lm_v=$(python3 -c "import importlib.metadata as m; print(m.version('mlx-lm'))" 2>/dev/null || echo 0.32.2)
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$tmp" "mlx==$mlx_v" "mlx-cuda-13==$mlx_v" "mlx-lm==$lm_v"
cuda=$(ls "$tmp"/mlx_cuda_13-*.whl)
rm -rf .whl-part-*
(cd "$tmp" && split -b "${part_mb}m" "$cuda" part_)
i=0
for p in "$tmp"/part_*; do
  i=$((i + 1)); d=.whl-part-$i
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  mkdir -p "$d" && mv "$p" "$d/"
done
mv "$tmp"/mlx-*.whl "$tmp"/mlx_lm-*.whl ".whl-part-$i/"
basename "$cuda" > ".whl-part-$i/CUDA_WHEEL_NAME"
rm -rf "$tmp"
echo "Staged mlx $mlx_v, mlx-cuda-13 $mlx_v, mlx-lm $lm_v in $i parts. Run, in order:"
for j in $(seq 1 $((i - 1))); do
  echo "  carry [\".whl-part-$j\"]:  mkdir -p /root/mlx-parts && cp .whl-part-$j/part_* /root/mlx-parts/"
done
echo "  carry [\".whl-part-$i\"]:  cp .whl-part-$i/part_* /root/mlx-parts/ && cat /root/mlx-parts/part_* > /root/\$(cat .whl-part-$i/CUDA_WHEEL_NAME) && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/mlx-site /root/\$(cat .whl-part-$i/CUDA_WHEEL_NAME) .whl-part-$i/mlx-*.whl .whl-part-$i/mlx_lm-*.whl && export PYTHONPATH=/root/mlx-site:\$PWD && python3 -c 'import mlx.core as mx; print(mx.default_device())'"
