"""Tiny bf16 model on the standard-library corpus: a CPU run in well under a minute.

    python -m train.main --config configs/tiny.py --workdir runs/tiny

2 layers of width 64 on 64-byte windows; the loss falls from ~5.9 (uniform over 384 ids)
to below ~3 in 200 steps. Try another recipe with ``--config.recipe=int8`` (or fp8_tensorwise,
fp8_rowwise, fp8_rowwise_gw_hp, bitnet, bitnet_int8_bwd).
"""

from train import config as train_config


def get_config():
  config = train_config.base_config()
  config.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192)
  config.update(steps=200, batch_size=16, seq_len=64, lr=3e-3, warmup_steps=20)
  config.update(log_every=20, eval_every=100, eval_batches=2, checkpoint_every=100, keep_checkpoints=2)
  return config
