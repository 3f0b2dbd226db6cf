"""~1B Llama-style model: Llama 3.2 1B's trunk with the byte-level vocabulary, for speed runs on one GPU.

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the forward, a straight-through
backward whose grad_input runs on int8 tensor cores (the ternary weight is exact in int8) and whose
grad_weight stays high precision, and an RMSNorm before each BitNet projection (train/model.py).
--config.recipe=bitnet_int8_bwd runs grad_weight in int8 too, bitnet_hp_bwd the whole backward in bf16.

    python -m train.main --config configs/bitnet_1b.py --workdir runs/bitnet_1b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_1b()
  config.recipe = "bitnet"
  return config
