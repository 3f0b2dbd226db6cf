#!/usr/bin/env bash
# Issue 15's short fine-tune (bf16, INT8 and FP8 final validation losses within 1%) on a machine with
# no downloaded model: pretrain the ~125M Llama-style model in bf16 on the Python standard library's
# sources, export it as a Hugging Face Llama folder (python -m train.hf export), then fine-tune that
# folder per recipe through --config.init_from (configs/finetune_llama.py) on another local corpus,
# jax's own sources, with benchmarks/convergence.py comparing the runs.
#
#   PYTHONPATH=. bash benchmarks/finetune_pretrained.sh runs/ft_pretrained benchmarks/results/ft.json
#
# Environment: PRE_CONFIG (configs/bf16_125m.py), PRE_STEPS (400), FT_STEPS (200), TEXT (jax's
# package folder), FT_SET (extra --set KEY=VALUE arguments for every fine-tune run).
set -euo pipefail
work=${1:-runs/finetune_pretrained}
out=${2:-benchmarks/results/finetune_pretrained_125m.json}
pre_config=${PRE_CONFIG:-configs/bf16_125m.py}
text=${TEXT:-$(python -c "import os, jax; print(os.path.dirname(jax.__file__))")}
ft=configs/finetune_llama.py

python -m train.main --config "$pre_config" --workdir "$work/pretrain" --resume --config.steps="${PRE_STEPS:-400}"
python -m train.hf export --checkpoint "$work/pretrain" --out "$work/hf" --dtype float32
# shellcheck disable=SC2086  # FT_SET is a list of arguments
python benchmarks/convergence.py --name finetune_pretrained --gap_bar 0.01 --steps "${FT_STEPS:-200}" \
    --workdir "$work/ft" --set init_from="$work/hf" --set data.path="$text" --set lr=1e-4 --set warmup_steps=20 \
    --set eval_every=50 --set eval_batches=16 --set checkpoint_every=1000000 ${FT_SET:-} \
    --runs "bf16=$ft;recipe=bf16,int8=$ft;recipe=int8,fp8=$ft;recipe=fp8_rowwise" --out "$out"
