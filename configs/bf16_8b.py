"""Llama 3 8B's trunk with the byte-level vocabulary, FSDP over 8 GPUs (train/config.py: llama_8b).

Recipe bf16. bf16 baseline: every matmul in bfloat16 with float32 master weights.

    python -m train.main --config configs/bf16_8b.py --workdir runs/bf16_8b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_8b()
  config.recipe = "bf16"
  return config
