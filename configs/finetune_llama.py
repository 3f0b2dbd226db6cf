"""Fine-tune a Hugging Face Llama-family model (Llama 3.x, Qwen2/2.5, Mistral) with a low-bit recipe.

    python -m train.main --config configs/finetune_llama.py --workdir runs/ft \\
        --config.init_from=/models/Llama-3.2-1B --config.recipe=int8 --config.data.path=my_texts/

``init_from`` is a local Hugging Face folder (config.json, safetensors, tokenizer.json): the
model's shape comes from its config.json, its weights replace the init, and its tokenizer.json
tokenizes the data (``train.hf``, ``train.data``). The LM head and the embeddings stay high
precision (as torchtitan does); attention and MLP projections run the recipe. Without
``init_from`` this trains a Llama 3.2 1B-shaped model from scratch (its 128k vocabulary needs a
tokenizer.json in ``data.tokenizer``). Export the result with
``python -m train.hf export --checkpoint runs/ft --out runs/ft/hf``. docs/finetune.md walks
through it.
"""

from train import config as train_config


def get_config():
  config = train_config.base_config()
  # Llama 3.2 1B's shape (replaced by init_from's config.json when given).
  config.model.update(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                      rope_theta=500000.0, rope_scaling="32.0,1.0,4.0,8192.0", norm_eps=1e-5, tie_embeddings=True,
                      scan_layers=False)
  config.update(steps=500, batch_size=16, seq_len=2048, lr=2e-5, warmup_steps=50, min_lr_ratio=0.1,
                weight_decay=0.0, grad_clip=1.0)
  config.update(log_every=10, eval_every=100, eval_batches=8, checkpoint_every=250, keep_checkpoints=2)
  config.data.suffixes = ".py,.md,.txt"
  return config
