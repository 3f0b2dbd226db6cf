#!/usr/bin/env bash
# One lent two-GPU machine's worth of checks for a change that must keep the step's speed and pass the GPU tests.
#
#   BASE=.base OUT=/tmp/out bash benchmarks/gpu_check.sh      # .base: an unpacked `git archive <old commit>`
#
# GPU 0: the 1B trainer step (benchmarks/train_throughput.py) of the old tree (bf16, BitNet as it shipped) and of
#        this tree (bf16, INT8, FP8, BitNet as shipped, BitNet with the old every_projection form), each tree's
#        ratios against its own bf16 row of the same process.
# GPU 1: the `gpu`-marked tests of the changed areas, the transformers BitNet check (benchmarks/hf_bitnet_check.py),
#        then the MLP layer stack (benchmarks/layer.py) of the old tree and of this one.
# Results land in $OUT (JSON and logs); the last lines printed are the tables.
set -u
BASE=${BASE:-.base}
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-20}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TREE=$PWD
SITE=${SITE:-/tmp/site}

throughput() {
  export CUDA_VISIBLE_DEVICES=0
  if [ -d "$BASE" ]; then
    (cd "$BASE" && PYTHONPATH="$PWD:$SITE" JAXLOWBIT_COMMIT="${BASE_COMMIT:-base}" python3 benchmarks/train_throughput.py \
      --configs configs/bf16_1b.py,configs/bitnet_1b.py --steps "$STEPS" --out "$OUT/throughput_base.json")
  fi
  PYTHONPATH="$TREE:$SITE" python3 benchmarks/train_throughput.py --steps "$STEPS" \
    --configs configs/bf16_1b.py,configs/int8_1b.py,configs/fp8_1b.py,configs/bitnet_1b.py \
    --out "$OUT/throughput.json"
  PYTHONPATH="$TREE:$SITE" python3 benchmarks/train_throughput.py --steps "$STEPS" \
    --configs configs/bf16_1b.py,configs/bitnet_1b.py \
    --set model.bitnet_norm_placement=every_projection --set model.tie_embeddings=False \
    --out "$OUT/throughput_every_projection.json"
}

gpu_tests() {
  export CUDA_VISIBLE_DEVICES=1
  PYTHONPATH="$TREE:$SITE" timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kernels_gpu.py tests/test_optim_gpu.py tests/test_train_bitnet.py tests/test_recipe_reference.py \
    tests/test_inference_gpu.py tests/test_backend_choice.py tests/test_train_model.py
  PYTHONPATH="$TREE:$SITE" timeout 120 python3 benchmarks/hf_bitnet_check.py "$OUT/hf_bitnet_check.json"
  # The MLP layer stack through the public layers, old tree then this one (each against its own bf16).
  for tree in "$BASE" "$TREE"; do
    [ -d "$tree" ] || continue
    name=$([ "$tree" = "$TREE" ] && echo layer || echo layer_base)
    (cd "$tree" && PYTHONPATH="$PWD:$SITE" timeout 150 python3 benchmarks/layer.py --shapes 2048,8192,16384 \
      --backends pallas --out "$OUT/$name.json")
  done
}

throughput > "$OUT/throughput.log" 2>&1 &
gpu_tests > "$OUT/gpu_tests.log" 2>&1 &
wait
tail -n 25 "$OUT/gpu_tests.log"
grep -A8 '^config ' "$OUT/throughput.log"   # one table per process: old tree, this tree, every_projection
