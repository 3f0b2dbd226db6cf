"""~1B Llama-style model: Llama 3.2 1B's trunk with the byte-level vocabulary, for speed runs on one GPU.

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the forward, straight-through
backward, and an RMSNorm inserted before each BitNet projection (train/model.py).
--config.recipe=bitnet_int8_bwd runs the backward matmuls in int8 too.

    python -m train.main --config configs/bitnet_1b.py --workdir runs/bitnet_1b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_1b()
  config.recipe = "bitnet"
  return config
