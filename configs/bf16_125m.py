"""~122M Llama-style model: for convergence runs (benchmarks/convergence.py); same model and data for every recipe.

Recipe bf16. bf16 baseline: every matmul in bfloat16 with float32 master weights.

    python -m train.main --config configs/bf16_125m.py --workdir runs/bf16_125m
"""

from train import config as train_config


def get_config():
  config = train_config.llama_125m()
  config.recipe = "bf16"
  return config
