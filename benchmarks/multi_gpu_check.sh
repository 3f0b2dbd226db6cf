#!/usr/bin/env bash
# Issue 29 on one lent 2-GPU host in ONE call (under 9 minutes, compiles included): FSDP over both GPUs.
#
#   OUT=/tmp/out bash benchmarks/multi_gpu_check.sh
#   TINY=1 JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 OUT=/tmp/out \
#     bash benchmarks/multi_gpu_check.sh                    # the same steps on 2 CPU devices, micro model
#
# Parts, in this order (PARTS picks some; each part is one process, so its ratios are against its own bf16 rows):
#   8b    configs/layers_8b.py (Llama 3 8B's layers, 4 deep, 8 sequences of 2048 per GPU): bf16, INT8, FP8
#         tensorwise, BitNet; first with collective overlap (mesh.xla_overlap, the default), then bf16 on one GPU
#         (the per-GPU baseline), then without overlap, then with bfloat16 gradient reduce-scatters
#         (fsdp.grad_reduce_dtype=bfloat16).
#   1b    the 1B configs, the same recipes, with and without overlap.
#   loss  configs/bf16_125m.py trained $LOSS_STEPS steps three times (benchmarks/grad_reduce_loss.py): float32
#         and bfloat16 gradient reduce-scatters, and a float32 control with two microbatches; only when at least
#         $LOSS_MIN_S seconds are left.
# Each row reports tokens/s (and per GPU), the ratio to the bf16 row of its part and variant, compile time and
# the collective bytes per step by mesh axis, op and element type (benchmarks/train_throughput.py). A time
# budget (BUDGET_S for the whole call) makes each part start no row past its share; rows it skips are listed.
# Results land in $OUT (JSON and logs); the last lines printed are a short table of every part.
set -u
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-480}        # the whole call (+ at most ROW_S): under 9 minutes; the lent machine allows 10
STEPS=${STEPS:-8}                # timed steps per row (8B-layer: ~0.2-0.4 s each on two H100s)
WARMUP=${WARMUP:-2}
PARTS=${PARTS:-"8b 1b loss"}
RESERVE_1B_S=${RESERVE_1B_S:-190}  # what the 8b part leaves for the 1b part
ROW_S=${ROW_S:-45}               # the longest a row may run past a part's budget (compile + init + steps)
LOSS_STEPS=${LOSS_STEPS:-150}
LOSS_MIN_S=${LOSS_MIN_S:-150}
SITE=${SITE:-/tmp/site}          # extra wheels on the GPU host, as benchmarks/gpu_check.sh
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }

L8=configs/layers_8b.py
RECIPES_8B="$L8:bf16,$L8:int8,$L8:fp8_tensorwise,$L8:bitnet"
CONFIGS_1B="configs/bf16_1b.py,configs/int8_1b.py,configs/fp8_1b.py,configs/bitnet_1b.py"
LOSS_CONFIG=configs/bf16_125m.py
SHRINK=()
LOSS_SHRINK=()
if [ "${TINY:-0}" = 1 ]; then  # a micro model of every config: the whole script on 2 CPU devices in minutes
  SHRINK=(--set model.d_model=64 --set model.n_heads=4 --set model.n_kv_heads=2 --set model.d_ff=128
          --set model.n_layers=2 --set seq_len=32 --set batch_size=4)
  LOSS_CONFIG=configs/tiny.py
  LOSS_STEPS=${TINY_LOSS_STEPS:-4}
  LOSS_SHRINK=(--set batch_size=4 --set eval_batches=1)
fi

{ date -u; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; nvidia-smi -L 2>/dev/null; } \
  > "$OUT/environment.txt" 2>&1

throughput() {  # throughput NAME BUDGET_S CONFIGS VARIANTS [extra args]
  local name=$1 budget=$2 configs=$3 variants=$4
  shift 4
  python3 benchmarks/train_throughput.py --configs "$configs" --variants "$variants" --set mesh.fsdp=0 \
    --steps "$STEPS" --warmup "$WARMUP" --time_budget_s "$budget" ${SHRINK[@]+"${SHRINK[@]}"} "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/parts.txt"
}

for part in $PARTS; do
  case $part in
    8b)
      reserve=$([[ " $PARTS " == *" 1b "* ]] && echo "$RESERVE_1B_S" || echo 0)
      throughput layers_8b $(( $(left) - reserve - ROW_S )) "$RECIPES_8B" \
        ";mesh.xla_overlap=false;fsdp.grad_reduce_dtype=bfloat16" --one_device_row ;;
    1b)
      throughput 1b $(( $(left) - ROW_S )) "$CONFIGS_1B" ";mesh.xla_overlap=false" ;;
    loss)
      if [ "$(left)" -ge "$LOSS_MIN_S" ]; then
        python3 benchmarks/grad_reduce_loss.py --config "$LOSS_CONFIG" --steps "$LOSS_STEPS" \
          ${LOSS_SHRINK[@]+"${LOSS_SHRINK[@]}"} --workdir "$OUT/grad_reduce_runs" --out "$OUT/grad_reduce_loss.json" \
          > "$OUT/grad_reduce_loss.log" 2>&1
        echo "loss: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/parts.txt"
      else
        echo "loss: skipped, $(left) s left (needs LOSS_MIN_S=$LOSS_MIN_S; run PARTS=loss alone)" \
          | tee -a "$OUT/parts.txt"
      fi ;;
    *) echo "unknown part $part (8b, 1b, loss)" | tee -a "$OUT/parts.txt" ;;
  esac
done

# The short table: every part's rows, then the loss comparison.
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
from benchmarks.train_throughput import format_axis_bytes
out = pathlib.Path(sys.argv[1])
print(f"\n{(out / 'environment.txt').read_text().strip()}")
for name in ("layers_8b", "1b"):
  path = out / f"{name}.json"
  if not path.exists():
    continue
  result = json.loads(path.read_text())
  print(f"\n{name}: {result['device']} x {max([r.get('devices', 1) for r in result['rows']] or [1])}, "
        f"jax {result['jax']}, commit {result['commit']}")
  print(f"{'row':58} {'tok/s':>9} {'per GPU':>9} {'vs bf16':>7} {'compile':>7}  bytes/step by axis")
  for r in result["rows"]:
    if "tokens_per_s" not in r:
      print(f"{r['name']:58} {('error: ' + r['error'][:70]) if 'error' in r else 'skipped: ' + r['skipped']}")
      continue
    vs = "-" if r.get("speedup_vs_bf16") is None else f"{r['speedup_vs_bf16']:.2f}x"
    print(f"{r['name']:58} {r['tokens_per_s']:9,.0f} {r['tokens_per_s_per_device']:9,.0f} {vs:>7} "
          f"{r['compile_s']:6.1f}s  {format_axis_bytes(r['bytes_by_axis'])}")
  for r in result["rows"]:
    if r.get("per_device_vs_one_device") is not None and r["recipe"] == "bf16":
      print(f"  {r['name']}: per GPU {r['per_device_vs_one_device']:.1%} of one GPU")
loss = out / "grad_reduce_loss.json"
if loss.exists():
  result = json.loads(loss.read_text())
  print(f"\ngrad_reduce_dtype, {result['config']}, {result['steps']} steps (against the float32 run):")
  for r in result["rows"]:
    diff = "" if "max_rel_loss_diff" not in r else (f"max step loss diff {r['max_rel_loss_diff']:.2e}, "
                                                     f"val diff {r['val_rel_diff']:.2e}, ")
    print(f"  {r['run']:9} val loss {r['val_loss']:.4f}, {diff}{r['ms/step'] or 0:.1f} ms/step")
EOF
cat "$OUT/parts.txt"
