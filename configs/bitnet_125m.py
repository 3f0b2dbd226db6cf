"""~122M Llama-style model: for convergence runs (benchmarks/convergence.py); same model and data for every recipe.

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the forward, a straight-through
backward whose grad_input runs on int8 tensor cores (the ternary weight is exact in int8) and whose
grad_weight stays high precision, and an RMSNorm before each BitNet projection (train/model.py).
--config.recipe=bitnet_int8_bwd runs grad_weight in int8 too, bitnet_hp_bwd the whole backward in bf16.

    python -m train.main --config configs/bitnet_125m.py --workdir runs/bitnet_125m
"""

from train import config as train_config


def get_config():
  config = train_config.llama_125m()
  config.recipe = "bitnet"
  return config
