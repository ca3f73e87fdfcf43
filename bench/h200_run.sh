#!/usr/bin/env bash
# The H200 measurements behind bench/RESULTS.md, section by section (MLX CUDA staged in
# /root/mlx-site by ../shared/device/stage-mlx-cuda.sh). Usage: bash bench/h200_run.sh SECTION...
#   gdn    GatedDeltaNet tree kernel (CUDA twin) vs the ops reference
#   shapes attention over an unseen key length vs whole buffers (why verify pads)
#   parts  where a tree round's time goes (host build time and synced time per part)
#   loop   plain vs our chain vs mlx-lm's chain vs our best tree (demo pair)
#   free   model-free drafters (prompt lookup, suffix) vs plain decode
#   sweep  block-vs-tree sweep on the demo pair, with the cost model
#   hybrid sweep on the hybrid demo target
#   proj   cost-model projections for 8B-shape targets (needs sweep's JSON)
set -u
export PYTHONPATH=/root/mlx-site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
for section in "$@"; do
  echo "=== $section $(date +%T)"
  case $section in
    gdn) timeout 150 python3 bench/gdn_kernel_bench.py --out "$OUT/gdn.json" 2>&1 | tee "$OUT/gdn.md" ;;
    shapes) timeout 100 python3 bench/kv_shapes_bench.py --out "$OUT/shapes.json" 2>&1 | tee "$OUT/shapes.md" ;;
    parts) timeout 200 python3 bench/round_parts_bench.py --out "$OUT/parts.json" 2>&1 | tee "$OUT/parts.md" ;;
    loop) timeout 560 python3 bench/bench_loop.py --prompts 20 --select-prompts 3 --max-tokens 256 --seconds ${LOOP_SECONDS:-420} \
            --blocks 6,7,8 --trees 3:8:24:1 --branch-trees 3:8:3:1 --merged 6+8,8+8,6+8@3,3:8:24:1+8,3:8:24:1+8@3 --lookup-chain 8 \
            --out "$OUT/loop.json" 2>"$OUT/loop.err" | tee "$OUT/loop.md" ;;
    free) timeout 150 python3 bench/model_free_bench.py --model mlx_treespec/demo/target --prompts 8 \
            --out "$OUT/free.json" 2>&1 | tee "$OUT/free.md" ;;
    sweep) timeout 200 python3 -m mlx_treespec.sweep --max-tokens 128 --max-seconds 100 --cost-model \
            --blocks 2,4,6,8 --tree-topk 2,4 --tree-depth 4,8 --budgets 8,16,32 \
            --arms tree:4:8:16:1,tree:4:10:24:1,tree:4:8:32:2 \
            --no-progress --out "$OUT/sweep" 2>&1 | tee "$OUT/sweep.md" ;;
    hybrid) timeout 200 python3 -m mlx_treespec.sweep --model mlx_treespec/demo/hybrid --max-tokens 128 \
            --max-seconds 90 --blocks 1,2,4 --tree-topk 2,4 --budgets 4,8 --no-progress \
            --out "$OUT/hybrid" 2>&1 | tee "$OUT/hybrid.md" ;;
    proj) timeout 240 python3 -m mlx_treespec.sweep --acceptance-from "$OUT/sweep/sweep.json" \
            --cost-model-config bench/configs/qwen3_8b.json --cost-model-config bench/configs/llama3_8b.json \
            --cost-model-draft-config bench/configs/qwen3_0.6b.json --dtype bfloat16 --q-bits 0,4 \
            --no-progress --out "$OUT/proj" 2>&1 | tee "$OUT/proj.md" ;;
  esac
done
echo "=== done $(date +%T)"
