#!/usr/bin/env bash
# The H200 measurements behind bench/RESULTS.md (MLX CUDA staged in /root/mlx-site: see
# bench/stage_mlx_cuda_parts.sh). Usage: bash bench/h200_run.sh SECTION...   (results under $OUT)
#   target   demo target: plain vs draft-model chain/tree vs DFlash/DDTree vs EAGLE-3, unseen and held-out prompts
#   hybrid   demo hybrid (GatedDeltaNet): plain vs draft model vs DFlash/DDTree vs MTP
#   proj     8B-shape projections (DFlash bf16 and 4-bit, EAGLE-3, MTP) from the measured acceptance
#            (PROJ="dflash eagle3 mtp" picks which; PROJ_ACC=heads_ reads the heads section's
#            acceptance; PROJ_ROUNDS=1 times whole rounds, queued where they queue)
#   proj_rounds the 8B-shape DFlash projection from whole rounds timed (queued where they queue; every
#            arm and plain decoding in turn, ROUND_REPS times), over the acceptance of $ACCEPTANCE
#            (default: the queued section's JSON); Q_BITS (default 0,4)
#   long     tree verify vs causal forward at 1k/8k/32k context: qwen3-8B shape (bf16, 4-bit), demo target
#   long_loop generation at ~11k tokens of context (the 'long' prompt set) on LONG_TARGETS (demo-hybrid;
#            "demo demo-hybrid" for both): plain vs the default vs DFlash chains vs DDTree
#   gdn      GatedDeltaNet tree kernel (CUDA twin) vs the ops reference
#   queued   demo target: DFlash chains and DDTree trees queued ahead vs the same drafts through the
#            round loop (/sync); QUEUED_ARMS, QUEUED_PROMPTS replace the arms and prompt sets
#   pieces   a DDTree round's pieces on the demo target, eager vs compiled verify, plain loops
#   adaptive the default (adaptive DFlash + lookup) vs plain and the fixed arms, demo target and
#            hybrid, on unseen text and the repetitive editing workload
#   hybrid_drafter  train the small qwen3_5 draft model for the demo hybrid (bench/train_heads.py),
#            ship it 8-bit into /root/hybrid_drafter (bench/ship_heads.py), and pack both into $OUT
#   drafters the demo hybrid: the attention draft model (/d1) against the hybrid one (/d2, HYBRID_DRAFTER),
#            beside plain, the default and the DFlash arms, on unseen, held-out and editing prompts
#   default  the default (queued DFlash where rounds queue, then adaptive) vs plain and the fixed arms,
#            on DEFAULT_TARGETS (demo; "demo demo-hybrid" for both); REPS runs of each prompt, pooled;
#            DEFAULT_ARMS, DEFAULT_PROMPTS replace the arms (e.g. adding dflash:15/sync, the chain through
#            the round loop) and the prompt sets
#   queued_hybrid the demo hybrid: DDTree's trees queued ahead (recurrent layers over device parents)
#            vs the same trees through the round loop (/sync), DFlash's queued chain, the default
#            (queueing trees) and the default queueing chains (auto:dflash/chains)
#   heads    MTP chains and one-lane trees queued ahead, and the adaptive default queueing trees vs
#            queueing chains (/chains), on the demo hybrid; EAGLE-3 the same on the demo target
#            (HEADS_PROMPTS: unseen,heldout; HEADS_HYBRID_ARMS, HEADS_TARGET_ARMS replace the arms)
# DFLASH, HYBRID_DFLASH, EAGLE3 override the shipped demo drafters (folders).
set -u
export PYTHONPATH=/root/mlx-site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out}
N=${N:-8}; TOKENS=${TOKENS:-192}
mkdir -p "$OUT"
for section in "$@"; do
  echo "=== $section $(date +%T)"
  case $section in
    target) timeout ${TARGET_TIMEOUT:-170} python3 bench/run.py loop --section target --target demo \
              ${DFLASH:+--dflash $DFLASH} ${EAGLE3:+--eagle3 $EAGLE3} \
              --arms plain,chain:6,tree:3:8,dflash:15,ddtree:31,ddtree:63,eagle3-tree:3:5 \
              --prompts unseen,heldout --n $N --max-tokens $TOKENS --seconds ${TARGET_SECONDS:-120} --out "$OUT/target" ;;
    hybrid) timeout ${HYBRID_TIMEOUT:-170} python3 bench/run.py loop --section hybrid --target demo-hybrid \
              ${HYBRID_DFLASH:+--dflash $HYBRID_DFLASH} \
              --arms plain,tree:3:8,dflash:15,ddtree:31,mtp-chain:5,mtp-tree:3:5 \
              --prompts unseen,heldout --n $N --max-tokens $TOKENS --seconds ${HYBRID_SECONDS:-120} --out "$OUT/hybrid" ;;
    proj) for f in "dflash qwen3_8b qwen3_8b_dflash target 0,4" "eagle3 llama3_8b llama3_8b_eagle3 target 0" \
                   "mtp qwen3_5_9b - hybrid 0"; do
            set -- $f
            case " ${PROJ:-dflash eagle3 mtp} " in *" $1 "*) ;; *) continue ;; esac
            timeout ${PROJ_TIMEOUT:-100} python3 bench/run.py proj --family $1 --config bench/configs/$2.json \
              $([ "$3" = - ] || echo --head-config bench/configs/$3.json) --acceptance "$OUT/${PROJ_ACC:-}$4.json.gz" \
              --prompt-set unseen --q-bits $5 ${PROJ_ROUNDS:+--rounds} --out "$OUT/proj_$1"
          done ;;
    proj_rounds) timeout ${PROJ_TIMEOUT:-400} python3 bench/run.py proj --family dflash --config bench/configs/qwen3_8b.json \
              --head-config bench/configs/qwen3_8b_dflash.json --acceptance "${ACCEPTANCE:-$OUT/queued.json.gz}" \
              --prompt-set unseen --q-bits ${Q_BITS:-0,4} --rounds --round-reps ${ROUND_REPS:-3} --out "$OUT/proj_rounds" ;;
    long) timeout ${LONG_TIMEOUT:-150} python3 bench/run.py long --config bench/configs/qwen3_8b.json \
            --contexts 1024,8192,32768 --q-bits 0,4 --repeats 5 --out "$OUT/long_8b"
          timeout 60 python3 bench/run.py long --config demo --contexts 1024,8192,32768 --repeats 5 --out "$OUT/long_demo" ;;
    long_loop) for t in ${LONG_TARGETS:-demo-hybrid}; do
            timeout ${LONG_LOOP_TIMEOUT:-220} python3 bench/run.py loop --section long_context_$t --target $t \
              --arms plain,auto:dflash,dflash:15,ddtree:31 --prompts long --n 4 --max-tokens $TOKENS \
              --seconds ${LONG_LOOP_SECONDS:-150} --out "$OUT/long_context_$t"
          done ;;
    adaptive) for t in demo demo-hybrid; do
            timeout ${ADAPTIVE_TIMEOUT:-250} python3 bench/run.py loop --section adaptive_$t --target $t \
              --arms plain,auto:dflash,dflash:15,ddtree:31,lookup:16:8 \
              --prompts ${ADAPTIVE_PROMPTS:-unseen,editing} --n $N --max-tokens $TOKENS --seconds ${ADAPTIVE_SECONDS:-170} --out "$OUT/adaptive_$t"
          done ;;
    queued) timeout ${QUEUED_TIMEOUT:-460} python3 bench/run.py loop --section queued --target demo \
              ${DFLASH:+--dflash $DFLASH} --arms ${QUEUED_ARMS:-plain,dflash:15,dflash:15/sync,ddtree:31,ddtree:31/sync,ddtree:15,ddtree:63} \
              --prompts ${QUEUED_PROMPTS:-unseen,heldout} --n $N --reps ${REPS:-1} --max-tokens $TOKENS \
              --seconds ${QUEUED_SECONDS:-380} --out "$OUT/queued" ;;
    heads) timeout ${HEADS_TIMEOUT:-270} python3 bench/run.py loop --section heads_hybrid --target demo-hybrid \
              --arms ${HEADS_HYBRID_ARMS:-plain,mtp-chain:10,mtp-chain:15,mtp-tree:3:10:30:1,mtp-tree:3:15:45:1,auto:mtp,auto:mtp/chains} \
              --prompts ${HEADS_PROMPTS:-unseen,heldout} --n $N --max-tokens $TOKENS --seconds ${HEADS_SECONDS:-220} \
              --out "$OUT/heads_hybrid"
           timeout ${HEADS_TIMEOUT:-270} python3 bench/run.py loop --section heads_target --target demo \
              ${EAGLE3:+--eagle3 $EAGLE3} --arms ${HEADS_TARGET_ARMS:-plain,eagle3-chain:5,eagle3-chain:8,eagle3-tree:3:5:15:1,eagle3-tree:3:8:24:1,auto:eagle3,auto:eagle3/chains} \
              --prompts ${HEADS_PROMPTS:-unseen,heldout} --n $N --max-tokens $TOKENS --seconds ${HEADS_SECONDS:-220} \
              --out "$OUT/heads_target" ;;
    queued_hybrid) timeout ${QH_TIMEOUT:-500} python3 bench/run.py loop --section queued_hybrid --target demo-hybrid \
              --arms ${QH_ARMS:-plain,dflash:15,ddtree:31,ddtree:31/sync,ddtree:63,auto:dflash,auto:dflash/chains} \
              --prompts ${QH_PROMPTS:-unseen,heldout} --n $N --reps ${REPS:-1} --max-tokens $TOKENS \
              --seconds ${QH_SECONDS:-420} --out "$OUT/queued_hybrid" ;;
    pieces) timeout 120 python3 bench/run.py pieces --target demo --history 300 --repeats 30 --out "$OUT/pieces" ;;
    gdn) timeout 150 python3 bench/gdn_kernel_bench.py --out "$OUT/gdn.json" 2>&1 | tee "$OUT/gdn.md" ;;
    hybrid_drafter) timeout ${HD_TIMEOUT:-420} python3 bench/train_heads.py --out /root/hd_out --stage /root/hd_stage \
              --only drafter_hybrid --inline --deadline-seconds ${HD_SECONDS:-270} --gen-seconds 30 \
            && python3 bench/ship_heads.py --from /root/hd_stage --to /root/shipped --only drafter_hybrid \
            && rm -rf /root/hybrid_drafter && cp -rL /root/shipped/hybrid_drafter /root/hybrid_drafter \
            && tar -C /root -cf "$OUT/hybrid_drafter.tar" shipped/hybrid_drafter hd_stage/drafter_hybrid/train_log.json \
            && cp /root/hd_out/train_heads_log.json "$OUT/" ;;
    drafters) timeout ${DRAFTERS_TIMEOUT:-500} python3 bench/run.py loop --section drafters --target demo-hybrid \
              --draft-model demo-drafter,${HYBRID_DRAFTER:-demo-hybrid-drafter} \
              --arms plain,auto:dflash,dflash:15,ddtree:31,lookup:16:8,chain:4,chain:4/d2,tree:3:8,tree:3:8/d2 \
              --prompts unseen,heldout,editing --n $N --max-tokens $TOKENS --seconds ${DRAFTERS_SECONDS:-420} --out "$OUT/drafters" ;;
    default) for t in ${DEFAULT_TARGETS:-demo}; do
            timeout ${DEFAULT_TIMEOUT:-500} python3 bench/run.py loop --section default_$t --target $t \
              --arms ${DEFAULT_ARMS:-plain,auto:dflash,dflash:15,ddtree:31,lookup:16:8} \
              --prompts ${DEFAULT_PROMPTS:-unseen,heldout,editing} --n $N --reps ${REPS:-1} --max-tokens $TOKENS --seconds ${DEFAULT_SECONDS:-400} --out "$OUT/default_$t"
          done ;;
  esac
done
echo "=== done $(date +%T)"
