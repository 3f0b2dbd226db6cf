"""Hugging Face Llama-family checkpoints and GGUF files in and out of ``train.model``: the public names and the command line.

    config, params = train.hf.load_pretrained("Llama-3.2-1B")          # a local HF folder
    logits = Transformer(config).apply({"params": params}, tokens)
    train.hf.save_pretrained("out", config, params)                      # transformers loads it
    train.hf.save_gguf("out", config, params, "tq2_0")                   # a BitNet model for llama.cpp

    python -m train.hf export --checkpoint RUN_DIR --out DIR [--scheme w8a16|w8a8|tq1_0|tq2_0]

The code lives in ``train/io/``, one module per concern:

=====================  ===============================================================================
``hf_config.py``       ``config.json`` <-> ``ModelConfig``; which HF tensor lands where in our parameters
``hf_reader.py``       reading a folder's safetensors (whole, or each device's blocks straight onto it)
``hf_writer.py``       writing a folder ``transformers`` loads (optionally int8 projections + scales)
``gguf.py``            a BitNet model as GGUF with llama.cpp's ternary TQ1_0 / TQ2_0 tensors
``gguf_ternary.py``    the TQ1_0 / TQ2_0 block bytes
=====================  ===============================================================================

Supported: ``LlamaForCausalLM`` (Llama 2/3.x, with Llama 3's ``rope_scaling``),
``Qwen2ForCausalLM`` (q/k/v biases) and ``MistralForCausalLM`` (its sliding window is not
applied: exact up to ``sliding_window`` tokens). BitNet models, whose extra norms a Llama
checkpoint cannot hold, go out as GGUF instead (:func:`save_gguf`).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp

from train import checkpoint, cli, data
from train.io.gguf import GGUF_ARCHITECTURE, GGUF_FILE, GGUF_SCHEMES, gguf_tensors, save_gguf
from train.io.hf_config import (
    ARCHITECTURES,
    QUANT_SCHEMES,
    UnsupportedCheckpointError,
    describe,
    hf_config,
    model_config_from_hf,
    read_config,
)
from train.io.hf_reader import abstract_params, load_pretrained, merge_into, weight_files
from train.io.hf_writer import EXPORT_DTYPES, hf_tensors, save_pretrained
from train.runs import load_run

__all__ = [
    "ARCHITECTURES",
    "GGUF_ARCHITECTURE",
    "GGUF_FILE",
    "GGUF_SCHEMES",
    "QUANT_SCHEMES",
    "UnsupportedCheckpointError",
    "abstract_params",
    "describe",
    "gguf_tensors",
    "hf_config",
    "hf_tensors",
    "load_pretrained",
    "merge_into",
    "model_config_from_hf",
    "read_config",
    "save_gguf",
    "save_pretrained",
    "weight_files",
]


def main(argv: list[str] | None = None) -> int:
  """``python -m train.hf export --checkpoint RUN_DIR --out DIR``: a run's latest (or ``--step``)
  checkpoint as a Hugging Face folder with the run's tokenizer.json, or (``--scheme tq1_0|tq2_0``,
  BitNet runs) as ``DIR/model.gguf``. A model the format cannot hold: one ``error:`` line, exit 2."""
  parser = argparse.ArgumentParser(prog="python -m train.hf", description=main.__doc__)
  parser.add_argument("command", choices=["export"])
  parser.add_argument("--checkpoint", required=True, help="a train.main --workdir")
  parser.add_argument("--out", required=True, help="the folder to write")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--dtype", default="bfloat16",
                      help=f"stored dtype of high-precision weights ({', '.join(EXPORT_DTYPES)}); int8: --scheme")
  parser.add_argument("--architecture", default="", help="default: init_from's, else LlamaForCausalLM")
  parser.add_argument("--scheme", default=None, choices=(*QUANT_SCHEMES, *GGUF_SCHEMES),
                      help="w8a16|w8a8: int8 projections + scales (save_pretrained); tq1_0|tq2_0: a BitNet run as "
                      "GGUF (save_gguf)")
  args = parser.parse_args(argv)
  if args.dtype not in EXPORT_DTYPES:
    raise cli.UserError(f"--dtype {args.dtype}: choose one of {', '.join(EXPORT_DTYPES)}; for int8 weights (with "
                        "per-channel scales) use --scheme w8a16 or w8a8")
  config, model_config, params, step = load_run(args.checkpoint, args.step)  # verified checkpoints only
  cli.check_output_dir(args.out, "--out")  # a file in the way, a read-only folder: one line, before any work
  tokenizer = data.tokenizer_for(config.data.get("tokenizer", "byte"))
  tokenizer_json = tokenizer.name if isinstance(tokenizer, data.HFTokenizer) else None
  try:
    if args.scheme in GGUF_SCHEMES:
      written = save_gguf(args.out, model_config, params, args.scheme, jnp.dtype(args.dtype),
                          tokenizer=tokenizer_json or "byte")
      print(f"wrote {written} (step {step}, {GGUF_ARCHITECTURE}, {args.scheme}, {args.dtype})")
      return 0
    architecture = args.architecture
    if not architecture and config.get("init_from"):
      architecture = (read_config(config.init_from).get("architectures") or ["LlamaForCausalLM"])[0]
    folder = save_pretrained(args.out, model_config, params, architecture or "LlamaForCausalLM", jnp.dtype(args.dtype),
                             tokenizer=tokenizer_json, scheme=args.scheme)
  except (ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {folder} (step {step}, {architecture or 'LlamaForCausalLM'}, {args.dtype})")
  return 0


if __name__ == "__main__":
  raise SystemExit(cli.run(main, codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),)))
