"""Does transformers' ``BitNetForCausalLM`` run our BitNet export with our logits?

    python benchmarks/hf_bitnet_check.py benchmarks/results/hf_bitnet_check_h200.json

Trains a tiny BitNet b1.58 model (sub-norms, tied embeddings) for a few dozen steps on this
repository's sources, exports it with ``train.io.hf_bitnet.save_pretrained`` (packed 2-bit weights,
Microsoft's ``bitlinear`` layout; and the float master weights, ``autobitlinear`` online, for an
unfused model), loads each folder with ``transformers.BitNetForCausalLM`` in float32 (on the GPU
when there is one: transformers' BitNet layers want one) and compares its logits on held-out text
with our ``ternary`` inference forward: relative L2 and the fraction of positions whose argmax
agrees. Prints a table and writes JSON. Needs torch and transformers (exit 2 without them); no
network.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS = 96
EXIT_MISSING = 2


def train_tiny(config, steps: int, seq_len: int = 128, batch: int = 16):
  """``config``'s parameters after ``steps`` AdamW steps on train/ sources (byte tokens, fixed seed)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  from train import data  # noqa: PLC0415
  from train.model import Transformer  # noqa: PLC0415

  text = b"".join(p.read_bytes() for p in sorted((ROOT / "train").glob("*.py")))
  tokens = np.asarray(data.encode(text), np.int32)
  model = Transformer(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  optimizer = optax.adamw(3e-3)

  def loss(p, b):
    logits = model.apply({"params": p}, b[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

  @jax.jit
  def step(p, state, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, state = optimizer.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  state, rng, value = optimizer.init(params), np.random.default_rng(0), None
  for _ in range(steps):
    starts = rng.integers(0, len(tokens) - seq_len - 1, batch)
    params, state, value = step(params, state, jnp.asarray(np.stack([tokens[s : s + seq_len + 1] for s in starts])))
  held_out = np.asarray(data.encode((ROOT / "README.md").read_bytes()), np.int32)[:PROMPT_TOKENS]
  return params, float(value), held_out


def ours(config, params, tokens: np.ndarray) -> np.ndarray:
  import jax.numpy as jnp  # noqa: PLC0415

  from jaxlowbit import inference  # noqa: PLC0415
  from train.model import Transformer  # noqa: PLC0415

  model = inference.convert_for_inference(Transformer(config), "ternary")
  qparams = inference.quantize_params(params, "ternary")
  return np.asarray(model.apply({"params": qparams}, jnp.asarray(tokens[None]))[0], np.float64)


def theirs(folder: pathlib.Path, tokens: np.ndarray) -> tuple[np.ndarray, str]:
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.BitNetForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, device_map=device)
  with torch.no_grad():
    logits = model(torch.as_tensor(tokens[None], device=device)).logits[0]
  return logits.float().cpu().numpy().astype(np.float64), device


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out", help="the JSON file to write")
  parser.add_argument("--steps", type=int, default=100, help="training steps of the tiny model")
  args = parser.parse_args(argv)
  try:
    import torch
    import transformers
  except ImportError as e:
    print(f"error: this check needs torch and transformers ({e}); nothing measured", file=sys.stderr)
    return EXIT_MISSING

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jaxlowbit  # noqa: PLC0415
  from benchmarks.common import metadata  # noqa: PLC0415
  from train.io import hf_bitnet  # noqa: PLC0415
  from train.model import ModelConfig  # noqa: PLC0415

  base = ModelConfig(vocab_size=384, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, dtype=jnp.float32,
                     recipe=jaxlowbit.BitNet(), bitnet_norm_placement="sub", tie_embeddings=True, rope_theta=5e5)
  cases = [
      ("packed", dict(mlp_activation="relu2")),
      ("packed", dict(mlp_activation="silu")),
      ("master", dict(mlp_activation="relu2", fused_projections=False)),
  ]
  rows = []
  with jax.default_matmul_precision("highest"), tempfile.TemporaryDirectory() as scratch:
    for weights, overrides in cases:
      config = dataclasses.replace(base, **overrides)
      params, loss, tokens = train_tiny(config, args.steps)
      folder = hf_bitnet.save_pretrained(pathlib.Path(scratch) / f"{weights}_{len(rows)}", config, params, weights)
      reference = ours(config, params, tokens)
      try:
        logits, device = theirs(folder, tokens)
      except Exception as e:  # noqa: BLE001  (report what transformers said, keep the other rows)
        rows.append({"weights": weights, **overrides, "error": f"{type(e).__name__}: {e}"[:500]})
        print(f"{weights} {overrides}: transformers failed: {rows[-1]['error']}")
        continue
      rel = float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))
      agree = float(np.mean(logits.argmax(-1) == reference.argmax(-1)))
      rows.append({"weights": weights, **overrides, "train_loss": loss, "tokens": int(tokens.size),
                   "relative_l2": rel, "argmax_agree": agree, "torch_device": device})
  print(f"{'weights':8} {'activation':10} {'fused':6} {'rel L2':>9} {'argmax':>7}")
  for row in rows:
    if "error" not in row:
      print(f"{row['weights']:8} {row['mlp_activation']:10} {str(row.get('fused_projections', True)):6} "
            f"{row['relative_l2']:9.2e} {row['argmax_agree']:7.3f}")
  result = {"benchmark": "hf_bitnet_check", **metadata(), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": {"d_model": 256, "n_layers": 4, "d_ff": 768},
            "train_steps": args.steps, "rows": rows}
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
  print(f"wrote {args.out}")
  return 0 if rows and all("error" not in row for row in rows) else 1


if __name__ == "__main__":
  raise SystemExit(main())
