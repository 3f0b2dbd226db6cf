"""Llama 3 8B's layers, 4 deep: the 8B trunk's GEMM shapes and per-layer traffic on 2 x 80 GB (issue 29).

One file for every recipe: the part after ``:`` is the recipe (default bf16; BitNet gets its published
2B4T form, as configs/bitnet_*.py: ``train.config.with_recipe``).

    python -m train.main --config configs/layers_8b.py:int8 --workdir runs/layers_8b_int8
    python benchmarks/train_throughput.py --set mesh.fsdp=0 --out layers_8b.json \\
        --configs configs/layers_8b.py:bf16,configs/layers_8b.py:int8,configs/layers_8b.py:fp8_tensorwise,configs/layers_8b.py:bitnet

Shape: d_model 4096, 32 heads, 8 KV heads, SwiGLU 14336 (``train.config.llama_8b``), 4 layers, the byte
vocabulary: 875.6M parameters, 874.0M of them in the projections (218.5M per layer). A step is 16
sequences of 2048 tokens in one microbatch, layers unrolled, no rematerialization: FSDP over two GPUs
gives each 8 sequences (16,384 tokens).

Memory per GPU, FSDP over 2 (GB = 1e9 bytes):

=====================================================  =========  ==========================================
what                                                   GB         from
=====================================================  =========  ==========================================
float32 parameters + AdamW m and v                     5.3        12 B x 875.6M / 2
float32 gradients (sharded)                            1.8        4 B x 875.6M / 2, plus one linear's whole
                                                                  dW (<= 0.24 GB) before its reduce-scatter
gathered weights kept for the backward                 1.7        2 B per projection parameter: bf16, or
                                                                  int8 / fp8 W and W^T (ternary unpacked)
activations kept for the backward                      11.8       16,384 tokens x 4 layers x <= 180 KB: per
                                                                  token and layer the bf16 inputs of the 7
                                                                  projections, q/k/v, the residuals and
                                                                  SwiGLU's gate/up/hidden (6 x 4096 + 2048
                                                                  + 3 x 14336 values, 139 KB) and a low-bit
                                                                  recipe's 8-bit copies (<= 37 KB)
logits (float32)                                       0.03       16,384 x 384 x 4 B
total before XLA's temporaries                         ~21
=====================================================  =========  ==========================================

So 4 layers leave room on an 80 GB GPU; ``--config.model.n_layers=8`` needs ~41 GB. One GPU
(``--config.mesh.fsdp=1 --config.batch_size=8``, the same 8 sequences) needs ~28 GB: the whole state
with its gradients (16 B x 875.6M = 14 GB), the bf16 weights (1.7) and the same activations.
"""

from train import config as train_config


def get_config(recipe: str = "bf16"):
  return train_config.with_recipe(train_config.llama_8b_layers(), recipe)
