"""Training throughput of the 1B configs per recipe (bf16, INT8, FP8, BitNet), in ONE process.

    PYTHONPATH=. python benchmarks/train_throughput.py --out benchmarks/results/train_throughput.json

Every row uses the trainer's own jitted step (``train.steps.step_functions``: fp32 master
weights, bf16 compute, AdamW, clipping, donated state) on synthetic batches, so it measures
what ``python -m train.main`` runs. Per config: initialize, compile (timed on its own, with
XLA's memory estimate), run ``--warmup`` steps, then time ``--steps`` steps and block on the
result. MFU counts model FLOPs (6 N T plus causal attention, ``train.model``) against the
device's bf16 dense peak for every recipe, so low-bit rows can pass what bf16 reaches.

Every row also lists the compiled step's collectives (``jaxlowbit.parallel.hlo``: bytes per step per
op and replica group size, so a ``fsdp x tensor`` mesh shows each axis's traffic apart).

Prints a table last and writes JSON to ``--out``. Needs no network (synthetic data). On CPU,
``--configs configs/tiny.py --extra_recipes int8,bitnet --steps 2`` checks that it runs.

``--peers qwix_int8,qwix_fp8,flax_fp8`` adds rows for the JAX libraries a user could pick instead
(``benchmarks/peers.py``): the first config's model in bf16, quantized by the peer, same data and optimizer,
one device. A peer whose library is not installed (Qwix) is skipped with a note.

One device by default (``mesh.fsdp=1``); ``--set mesh.fsdp=0`` times the FSDP step over every
visible device (``train.main``'s default there), MFU then counting all of their peaks; adding
``--set mesh.tensor=2 --set model.fused_projections=False`` times FSDP x tensor parallelism.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import platform
import sys
import time
import traceback

import jax
import numpy as np

from benchmarks import common, peers
from jaxlowbit.parallel.hlo import collectives, summarize
from train import config as train_config
from train import data, metrics
from train.model import param_count, train_flops_per_token
from train.spec import resolve
from train.steps import step_functions

DEFAULT_CONFIGS = ("configs/bf16_1b.py", "configs/int8_1b.py", "configs/fp8_1b.py", "configs/bitnet_1b.py")
GIB = 2**30


def parse_value(text: str):
  """``"3"`` -> 3, ``"1e-3"`` -> 0.001, ``"true"`` -> True, anything else stays a string."""
  lowered = text.lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_overrides(pairs: list[str]) -> dict:
  overrides = {}
  for pair in pairs:
    if "=" not in pair:
      raise SystemExit(f"--set expects KEY=VALUE (e.g. model.remat_policy=full), got {pair!r}")
    key, value = pair.split("=", 1)
    overrides[key] = parse_value(value)
  return overrides


def bench_one(config, steps: int, warmup: int, peak: float | None, peer: str | None = None) -> dict:
  """Time the trainer's step for ``config`` (or ``peer``'s, ``benchmarks.peers``, on its bf16 model); one table row."""
  spec = resolve(config)
  model_config = spec.model
  functions = step_functions(spec) if peer is None else peers.step_functions(spec, peer)
  stream = data.SyntheticBatches(config.seq_len, config.batch_size, config.seed)
  batches = [functions.shard_train_batch(stream.next()) for _ in range(warmup + steps)]

  state = functions.init()
  started = time.perf_counter()
  compiled = functions.train_step.lower(state, batches[0]).compile()
  compile_s = time.perf_counter() - started
  memory = compiled.memory_analysis()
  moved = summarize(collectives(compiled.as_text()), by_group=True)  # per op and replica group size
  temp_gib = getattr(memory, "temp_size_in_bytes", 0) / GIB if memory is not None else None

  for batch in batches[:warmup]:
    state, step_metrics = compiled(state, batch)
  jax.block_until_ready((state, step_metrics))
  started = time.perf_counter()
  for batch in batches[warmup:]:
    state, step_metrics = compiled(state, batch)
  jax.block_until_ready((state, step_metrics))
  elapsed = time.perf_counter() - started

  tokens_per_step = config.batch_size * config.seq_len
  step_time = elapsed / steps
  flops_per_step = train_flops_per_token(model_config, config.seq_len) * tokens_per_step
  loss = float(step_metrics["loss"])
  del state, compiled
  return {
      "recipe": peer or config.recipe,
      "params": param_count(model_config)["total"],
      "batch_size": config.batch_size,
      "seq_len": config.seq_len,
      "remat_policy": config.model.remat_policy,
      "tokens_per_s": tokens_per_step / step_time,
      "step_time_s": step_time,
      "mfu": metrics.mfu(flops_per_step, step_time, peak, functions.runtime.num_devices),
      "devices": functions.runtime.num_devices,
      "compile_s": compile_s,
      "temp_gib": temp_gib,
      "collectives": moved,
      "moved_mib": sum(e["bytes"] for e in moved.values()) / 2**20,  # per device and step
      "last_loss": loss,
  }


def format_table(rows: list[dict]) -> str:
  header = ["config", "recipe", "tokens/s", "step ms", "MFU", "speed-up", "compile s", "temp GiB", "moved MiB"]
  lines = []
  base = next((r["tokens_per_s"] for r in rows if "error" not in r), None)
  for r in rows:
    if "error" in r:
      lines.append([r["name"], r.get("recipe", "?"), "error: " + r["error"][:60], "", "", "", "", "", ""])
      continue
    lines.append([
        r["name"],
        r["recipe"],
        f"{r['tokens_per_s']:,.0f}",
        f"{1e3 * r['step_time_s']:.1f}",
        "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
        f"{r['tokens_per_s'] / base:.2f}x",
        f"{r['compile_s']:.1f}",
        "-" if r["temp_gib"] is None else f"{r['temp_gib']:.1f}",
        f"{r['moved_mib']:,.1f}",
    ])
  widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]

  def fmt(cells: list) -> str:
    return " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))

  note = (f"speed-up: tokens/s relative to the first row ({rows[0]['name']}); moved: result bytes of each device's "
          "collectives per step, as hlo.Collective.bytes counts them (JSON: per op and replica group size)")
  return "\n".join([fmt(header), "-+-".join("-" * w for w in widths), *map(fmt, lines), note])


def write_result(args, device, peak: float | None, overrides: dict, rows: list[dict]) -> pathlib.Path:
  """The JSON of the rows so far (speed-ups against the first row that ran)."""
  base = next((r for r in rows if "error" not in r), None)
  for r in rows:
    if "error" not in r and base is not None:
      r["speedup_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
  result = {
      "benchmark": "train_throughput",
      "device": device.device_kind,
      "platform": device.platform,
      "jax": jax.__version__,
      "python": platform.python_version(),
      "commit": common.commit(),
      "steps": args.steps,
      "warmup": args.warmup,
      "overrides": overrides,
      "peak_tflops": peak,
      "rows": rows,
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated config files")
  parser.add_argument("--extra_recipes", default="", help="also run the first config with these recipes, e.g. "
                      "fp8_rowwise,bitnet_int8_bwd")
  parser.add_argument("--extra_optimizers", default="", help="also run the first config with these optimizers "
                      "(jaxlowbit.optim.make names), e.g. adamw_8bit,adamw_4bit")
  parser.add_argument("--peers", default="", help="also run the first config's bf16 model through these JAX "
                      f"libraries (benchmarks/peers.py): {','.join(peers.PEERS)}")
  parser.add_argument("--steps", type=int, default=20, help="timed steps per config")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field in every run, e.g. --set model.remat_policy=full")
  parser.add_argument("--peak_tflops", type=float, default=None, help="bf16 dense peak (default: by device)")
  parser.add_argument("--out", required=True, help="JSON file to write")
  args = parser.parse_args(argv)

  overrides = {"data.source": "synthetic", "mesh.fsdp": 1, **parse_overrides(args.set)}
  runs = [(path, None, None) for path in args.configs.split(",") if path]  # (config, field, value)
  runs += [(runs[0][0], "recipe", recipe) for recipe in args.extra_recipes.split(",") if recipe]
  runs += [(runs[0][0], "optimizer", name) for name in args.extra_optimizers.split(",") if name]
  runs += [(runs[0][0], "peer", name) for name in args.peers.split(",") if name]
  peak = args.peak_tflops or metrics.peak_tflops()
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, bf16 peak {peak} TFLOP/s")

  rows = []
  for path, field, value in runs:
    name = pathlib.Path(path).stem + (f"+{value}" if value else "")
    peer = value if field == "peer" else None
    run_overrides = {**overrides, **({"recipe": "bf16"} if peer else {field: value} if field else {})}
    if peer and peers.missing(peer):
      print(peers.missing(peer), flush=True)
      continue
    try:
      config = train_config.load_file(path, run_overrides)
      train_config.check(config)
      row = {"name": name, **bench_one(config, args.steps, args.warmup, peak, peer)}
      print(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, {1e3 * row['step_time_s']:.1f} ms/step, "
            f"loss {row['last_loss']:.3f}", flush=True)
    except Exception as e:  # one failing recipe (e.g. out of memory) must not lose the others
      traceback.print_exc()
      row = {"name": name, "recipe": value if field in ("recipe", "peer") else "?", "error": f"{type(e).__name__}: {e}"}
    rows.append(row)
    write_result(args, device, peak, overrides, rows)  # after every config: a later crash keeps these
    gc.collect()

  out = write_result(args, device, peak, overrides, rows)
  print(f"\nwrote {out}\n")
  print(format_table(rows))
  if any("error" in r for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  np.set_printoptions(precision=4)
  main()
