#!/usr/bin/env bash
# Tensor parallelism over 2 GPUs (issue 29, items 1 and 3): bf16 vs INT8 vs FP8 tokens/s and the bytes the
# compiled step moves over the tensor axis, in one call of under 8 minutes on a 2 x H100 host.
#
#   OUT=/tmp/out bash benchmarks/tp_check.sh
#
# benchmarks/train_throughput.py on both GPUs, mesh data 1 x fsdp 1 x tensor 2, the 1B configs on synthetic data,
# 16 sequences of 2048 per step (the rows); each row's JSON carries its compile time and bytes_by_axis
# ({"tensor": {"all-gather": {"u8": ...}, "reduce-scatter": {"bf16": ...}}}, per device and step), printed under
# the table. Two processes, most important rows first (a time budget skips the last ones, never the first):
#   1. bf16, INT8, FP8 with separate q, k, v / gate, up kernels (model.fused_projections=False: only activations
#      cross tensor), then the same three as shipped (fused qkv / gate_up split by their groups: each call also
#      all-gathers its fused f32 kernel over tensor and reduce-scatters its gradient); INT8's grad_weight x^T is
#      made from the gathered codes (fsdp.tensor_transposed=requantize, the default);
#   2. INT8 sending x^T beside the rows (fsdp.tensor_transposed=send, the message before issue 29: 2 bytes per
#      element), unfused, for the bytes and tokens/s that change bought (compare with row 2 of process 1).
# What to look for: the 8-bit rows' tensor all-gathers are u8 at <= 0.55x the bf16 row's bytes, and "vs bf16".
# A CPU smoke run of the same calls: PYTHON=.venv/bin/python XLA_FLAGS=--xla_force_host_platform_device_count=2 \
#   CONFIGS=configs/tiny.py SEND_CONFIG=configs/tiny.py BATCH=4 STEPS=1 bash benchmarks/tp_check.sh
set -u
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-10}
SITE=${SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}
CONFIGS=${CONFIGS:-configs/bf16_1b.py,configs/int8_1b.py,configs/fp8_1b.py}
SEND_CONFIG=${SEND_CONFIG:-configs/int8_1b.py}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$SITE"
TP=(--set mesh.fsdp=1 --set mesh.tensor=2 --set batch_size="${BATCH:-16}" --steps "$STEPS" --warmup 2)

timeout 400 "$PYTHON" benchmarks/train_throughput.py "${TP[@]}" --time_budget_s 300 --configs "$CONFIGS" \
  --variants "model.fused_projections=False;" --out "$OUT/tp.json" > "$OUT/tp.log" 2>&1
echo "tensor parallelism: exit $?"
timeout 90 "$PYTHON" benchmarks/train_throughput.py "${TP[@]}" --configs "$SEND_CONFIG" \
  --set model.fused_projections=False --set fsdp.tensor_transposed=send --out "$OUT/tp_send.json" \
  > "$OUT/tp_send.log" 2>&1
echo "INT8 sending x^T: exit $?"
for log in "$OUT/tp.log" "$OUT/tp_send.log"; do
  echo "== $log"
  sed -n '/^config /,$p' "$log" | grep -v '^wrote' || tail -n 20 "$log"
done
