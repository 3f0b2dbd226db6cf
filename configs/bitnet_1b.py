"""~1B Llama-style model: Llama 3.2 1B's trunk with the byte-level vocabulary, for speed runs on one GPU.

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the forward, a straight-through
backward whose two matmuls run on int8 tensor cores: grad_input (the ternary weight is exact in int8)
and grad_weight (x^T and g^T int8 per feature, as the INT8 recipe's; 0.4% of 125M validation loss). The published BitNet b1.58 2B4T form (train/model.py): the pre-norms
plus two sub-norms per layer (before the attention output and down projections) and tied input/output
embeddings (the tied head stays high precision). --config.model.bitnet_norm_placement=every_projection
puts an RMSNorm before every BitNet projection instead (torchao's surgery);
--config.model.mlp_activation=relu2 is 2B4T's squared-ReLU MLP (default SwiGLU).
--config.recipe=bitnet_int8_gi keeps grad_weight in bf16, bitnet_hp_bwd the whole backward.

    python -m train.main --config configs/bitnet_1b.py --workdir runs/bitnet_1b
"""

from train import config as train_config


def get_config():
  return train_config.with_recipe(train_config.llama_1b(), "bitnet")  # with its 2B4T model fields
