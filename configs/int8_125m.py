"""~122M Llama-style model: for convergence runs (benchmarks/convergence.py); same model and data for every recipe.

Recipe int8. INT8 mixed precision (torchao int8_mixed_precision): forward, grad_input and
grad_weight of every attention and MLP projection in int8; weights stay float32.

    python -m train.main --config configs/int8_125m.py --workdir runs/int8_125m
"""

from train import config as train_config


def get_config():
  config = train_config.llama_125m()
  config.recipe = "int8"
  return config
