"""~122M Llama-style model: for convergence runs (benchmarks/convergence.py); the trunk and data of every recipe's 125M.

Recipe bitnet. BitNet b1.58: ternary weights x int8 activations in the forward, a straight-through
backward whose two matmuls run on int8 tensor cores: grad_input (the ternary weight is exact in int8)
and grad_weight (x^T and g^T int8 per feature, as the INT8 recipe's; 0.4% of 125M validation loss). The published BitNet b1.58 2B4T form (train/model.py): the pre-norms
plus two sub-norms per layer (before the attention output and down projections) and tied input/output
embeddings (the tied head stays high precision). --config.model.bitnet_norm_placement=every_projection
puts an RMSNorm before every BitNet projection instead (torchao's surgery);
--config.model.mlp_activation=relu2 is 2B4T's squared-ReLU MLP (default SwiGLU).
--config.recipe=bitnet_int8_gi keeps grad_weight in bf16, bitnet_hp_bwd the whole backward.
Learning rate 2e-3, twice bf16's (below; docs/bitnet.md has the comparison).

    python -m train.main --config configs/bitnet_125m.py --workdir runs/bitnet_125m
"""

from train import config as train_config


# BitNet trains at a higher learning rate than bf16 (as its authors train it). 2000 steps on four H100s in one run
# (benchmarks/results/bitnet_lr_125m_h100x4_e9e95cc.json): best validation loss BitNet lr 2e-3 0.5376, 3e-3 0.5513;
# bf16 lr 1e-3 0.5265, 2e-3 0.5338. So BitNet takes 2e-3 (+2.1% over bf16's best) and bf16 keeps 1e-3.
LR = 2e-3


def get_config():
  config = train_config.with_recipe(train_config.llama_125m(), "bitnet")  # with its 2B4T model fields
  config.lr = LR
  return config
