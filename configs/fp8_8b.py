"""Llama 3 8B's trunk with the byte-level vocabulary, FSDP over 8 GPUs (train/config.py: llama_8b).

Recipe fp8_tensorwise. FP8 tensorwise (the torchtitan float8 default): e4m3 activations and weights, e5m2 gradients, one
dynamic scale per tensor; weights travel in e4m3 under FSDP.

    python -m train.main --config configs/fp8_8b.py --workdir runs/fp8_8b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_8b()
  config.recipe = "fp8_tensorwise"
  return config
