"""Llama 3 8B's trunk with the byte-level vocabulary, FSDP over 8 GPUs (train/config.py: llama_8b).

Recipe int8. INT8 mixed precision (torchao int8_mixed_precision): forward, grad_input and grad_weight of every
attention and MLP projection in int8; weights stay float32 and travel in int8 under FSDP.

    python -m train.main --config configs/int8_8b.py --workdir runs/int8_8b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_8b()
  config.recipe = "int8"
  return config
