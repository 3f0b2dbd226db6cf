"""~1B Llama-style model: Llama 3.2 1B's trunk with the byte-level vocabulary, for speed runs on one GPU.

Recipe bf16. bf16 baseline: every matmul in bfloat16 with float32 master weights.

    python -m train.main --config configs/bf16_1b.py --workdir runs/bf16_1b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_1b()
  config.recipe = "bf16"
  return config
