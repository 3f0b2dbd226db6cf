"""Hugging Face checkpoints and GGUF files in and out of ``train.model``: the public names and the command line.

    config, params = train.hf.load_pretrained("Llama-3.2-1B")          # a local HF folder
    logits = Transformer(config).apply({"params": params}, tokens)
    train.hf.save_pretrained("out", config, params)                      # transformers loads it
    train.hf.save_gguf("out", config, params)                            # llama.cpp runs out/model.gguf

    python -m train.hf export --checkpoint RUN_DIR --out DIR [--format safetensors|gguf] ...

The code lives in ``train/io/``, one module per concern:

=====================  ===============================================================================
``hf_config.py``       ``config.json`` <-> ``ModelConfig``; which HF tensor lands where in our parameters
``hf_reader.py``       reading a folder's safetensors (whole, or each device's blocks straight onto it)
``hf_writer.py``       writing a folder ``transformers`` loads (optionally int8 projections + scales)
``hf_bitnet.py``       BitNet models as ``BitNetForCausalLM`` folders (packed 2-bit or master weights)
``gguf.py``            any model as a GGUF llama.cpp runs: its ``llama`` graph or (BitNet) its ``bitnet``
``gguf_ternary.py``    the TQ1_0 / TQ2_0 block bytes
``gguf_tokenizer.py``  a run's tokenizer as GGUF ``tokenizer.ggml.*``
``byte_tokenizer.py``  ``train.data``'s byte tokenizer as a ``tokenizer.json``
=====================  ===============================================================================

Supported: ``LlamaForCausalLM`` (Llama 2/3.x, with Llama 3's ``rope_scaling``),
``Qwen2ForCausalLM`` (q/k/v biases), ``MistralForCausalLM`` (its sliding window is not
applied: exact up to ``sliding_window`` tokens) and ``BitNetForCausalLM`` (BitNet b1.58, the
sub-norm placement). How to serve an export: ``docs/inference.md``, "Serve it".
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import warnings

import jax.numpy as jnp

from train import checkpoint, cli, data
from train.io import byte_tokenizer, gguf, hf_bitnet
from train.io.gguf import GGUF_FILE, gguf_tensors, save_gguf
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
    "GGUF_FILE",
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


FORMATS = ("safetensors", "gguf")
# What safetensors raises when writing a file fails (its I/O errors are not OSErrors); matched by name, as the
# class lives in its compiled module.
WRITE_ERROR = "SafetensorError"


def _staged(out: pathlib.Path, write) -> pathlib.Path:
  """Run ``write(folder)`` on a temporary folder beside ``out``, then move its files into ``out`` one
  rename each: a failed export leaves ``out`` as it was, never a partial file."""
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
  try:
    write(staging)
    out.mkdir(exist_ok=True)
    for file in sorted(staging.iterdir()):
      os.replace(file, out / file.name)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return out


def _verified_step(run_dir: str, step: int | None) -> int:
  """The step to export: ``--step``, or the newest checkpoint if it is verified. A corrupt or
  unverified newest one is refused (checkpoint.CorruptCheckpointError) naming the fallback, not
  silently replaced by an older one."""
  skipped = []
  chosen = checkpoint.verified_step(run_dir, step, notify=skipped.append)
  if skipped:
    raise checkpoint.CorruptCheckpointError("; ".join(line.removeprefix("warning: ") for line in skipped)
                                            + f". The newest verified checkpoint is step {chosen}: export it with "
                                            f"--step {chosen}")
  return chosen


def main(argv: list[str] | None = None) -> int:
  """``python -m train.hf export --checkpoint RUN_DIR --out DIR``: a run's newest verified (or ``--step``)
  checkpoint, with its tokenizer, as

  - ``--format safetensors`` (default): a Hugging Face folder; Llama-family for bf16 / INT8 / FP8 runs
    (``--scheme w8a16|w8a8``: int8 projections + scales), ``BitNetForCausalLM`` for BitNet runs trained
    with sub-norms (``--bitnet-weights packed|master``);
  - ``--format gguf``: ``DIR/model.gguf`` for llama.cpp (``--qtype``: tq2_0 / tq1_0 for BitNet runs,
    f16 / bf16 / q8_0 / f32 for the others; ``--weights int8``: an INT8 run's forward weights).

  A model the format cannot hold, or a corrupt newest checkpoint (under ``cli.run``): one ``error:`` line, exit 2."""
  parser = argparse.ArgumentParser(prog="python -m train.hf", description=main.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("command", choices=["export"])
  parser.add_argument("--checkpoint", required=True, help="a train.main --workdir")
  parser.add_argument("--out", required=True, help="the folder to write")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest, if verified)")
  parser.add_argument("--format", default="safetensors", choices=FORMATS)
  parser.add_argument("--dtype", default="bfloat16",
                      help=f"safetensors: stored dtype of high-precision weights ({', '.join(EXPORT_DTYPES)}); "
                      "int8: --scheme")
  parser.add_argument("--architecture", default="", help="safetensors: default init_from's, else LlamaForCausalLM")
  parser.add_argument("--scheme", default=None, choices=(*QUANT_SCHEMES, *gguf.TERNARY_QTYPES),
                      help="safetensors: w8a16|w8a8 int8 projections + scales; tq1_0|tq2_0: --format gguf --qtype")
  parser.add_argument("--bitnet-weights", default="packed", choices=hf_bitnet.FORMATS,
                      help="safetensors, BitNet runs: packed 2-bit codes (exact) or the float master weights")
  parser.add_argument("--qtype", default=None, choices=gguf.QTYPES, help="gguf: the weights' type")
  parser.add_argument("--weights", default="master", choices=gguf.WEIGHT_SOURCES,
                      help="gguf, INT8 runs: master weights, or int8 (the weights the INT8 forward multiplies)")
  args = parser.parse_args(argv)
  if args.scheme in gguf.TERNARY_QTYPES:  # the older spelling of a BitNet GGUF export
    args.format, args.qtype, args.scheme = "gguf", args.scheme, None
  if args.dtype not in EXPORT_DTYPES:
    raise cli.UserError(f"--dtype {args.dtype}: choose one of {', '.join(EXPORT_DTYPES)}; for int8 weights (with "
                        "per-channel scales) use --scheme w8a16 or w8a8")
  step = _verified_step(args.checkpoint, args.step)
  spec, model_config, params, step = load_run(args.checkpoint, step)
  cli.check_output_dir(args.out, "--out")  # a file in the way, a read-only folder: one line, before any work
  tokenizer_name = spec.data.tokenizer or "byte"
  tokenizer_json = None if tokenizer_name == "byte" else data.HFTokenizer(tokenizer_name).name
  out = pathlib.Path(args.out)
  try:
    if args.format == "gguf":
      with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        written = save_gguf(out, model_config, params, args.qtype, tokenizer=tokenizer_json or "byte",
                            weights=args.weights)
      for note in notes:
        print(f"note: {note.message}", file=sys.stderr)
      arch, qtype = gguf.check(model_config, args.qtype, args.weights)
      print(f"wrote {written} (step {step}, llama.cpp {arch}, {qtype})")
      return 0

    def write(folder: pathlib.Path) -> str:
      if tokenizer_json is None:
        byte_tokenizer.write(folder)
      if gguf.architecture(model_config) == gguf.BITNET:
        hf_bitnet.save_pretrained(folder, model_config, params, args.bitnet_weights, jnp.dtype(args.dtype),
                                  tokenizer=tokenizer_json, bos_id=data.BOS_ID if tokenizer_json is None else None,
                                  eos_id=data.EOS_ID if tokenizer_json is None else None)
        return f"{hf_bitnet.ARCHITECTURE}, {args.bitnet_weights} weights"
      architecture = args.architecture
      if not architecture and spec.init_from:
        architecture = (read_config(spec.init_from).get("architectures") or ["LlamaForCausalLM"])[0]
      save_pretrained(folder, model_config, params, architecture or "LlamaForCausalLM", jnp.dtype(args.dtype),
                      tokenizer=tokenizer_json, scheme=args.scheme)
      return architecture or "LlamaForCausalLM"

    described = []
    _staged(out, lambda folder: described.append(write(folder)))
  except (ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except Exception as e:
    if isinstance(e, OSError) or type(e).__name__ == WRITE_ERROR:  # a full disk, a file-size limit, an I/O error
      raise cli.UserError(f"--out {out}: writing the export failed ({cli.one_line(e)}); nothing of it was left "
                          "there: free space (or raise the file-size limit) or choose another --out") from None
    raise
  print(f"wrote {out} (step {step}, {described[0]}, {args.dtype})")
  return 0


if __name__ == "__main__":
  raise SystemExit(cli.run(main, codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),)))
