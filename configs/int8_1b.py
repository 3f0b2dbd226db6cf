"""~1B Llama-style model: Llama 3.2 1B's trunk with the byte-level vocabulary, for speed runs on one GPU.

Recipe int8. INT8 mixed precision (torchao int8_mixed_precision): forward, grad_input and
grad_weight of every attention and MLP projection in int8; weights stay float32.

    python -m train.main --config configs/int8_1b.py --workdir runs/int8_1b
"""

from train import config as train_config


def get_config():
  config = train_config.llama_1b()
  config.recipe = "int8"
  return config
