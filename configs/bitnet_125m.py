"""~122M Llama-style model: for convergence runs (benchmarks/convergence.py); same model and data for every recipe.

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the forward, straight-through
backward, and an RMSNorm inserted before each BitNet projection (train/model.py).
--config.recipe=bitnet_int8_bwd runs the backward matmuls in int8 too.

    python -m train.main --config configs/bitnet_125m.py --workdir runs/bitnet_125m
"""

from train import config as train_config


def get_config():
  config = train_config.llama_125m()
  config.recipe = "bitnet"
  return config
