"""~122M Llama-style model: for convergence runs (benchmarks/convergence.py); same model and data for every recipe.

Recipe fp8_tensorwise. FP8 tensorwise (the torchao / torchtitan float8 default): e4m3 activations
and weights, e5m2 gradients, one dynamic scale per tensor. --config.recipe=fp8_rowwise or
fp8_rowwise_gw_hp for the rowwise recipes.

    python -m train.main --config configs/fp8_125m.py --workdir runs/fp8_125m
"""

from train import config as train_config


def get_config():
  config = train_config.llama_125m()
  config.recipe = "fp8_tensorwise"
  return config
