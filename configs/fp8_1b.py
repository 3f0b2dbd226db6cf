"""~1B Llama-style model: Llama 3.2 1B's trunk with the byte-level vocabulary, for speed runs on one GPU.

Recipe fp8_tensorwise. FP8 tensorwise (the torchao / torchtitan float8 default): e4m3 activations
and weights, e5m2 gradients, one dynamic scale per tensor. --config.recipe=fp8_rowwise or
fp8_rowwise_gw_hp for the rowwise recipes.

    python -m train.main --config configs/fp8_1b.py --workdir runs/fp8_1b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_1b()
  config.recipe = "fp8_tensorwise"
  return config
