"""Llama 3 8B's trunk with the byte-level vocabulary, FSDP over 8 GPUs (train/config.py: llama_8b).

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the published 2B4T form (pre-norms plus
two sub-norms per layer, tied embeddings; train/model.py); weights travel packed 2 bits per value under FSDP.

    python -m train.main --config configs/bitnet_8b.py --workdir runs/bitnet_8b
"""

from train import config as train_config


def get_config():
  return train_config.with_recipe(train_config.llama_8b(), "bitnet")  # with its 2B4T model fields
