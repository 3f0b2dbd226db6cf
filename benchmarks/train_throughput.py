"""Training throughput of the 1B configs per recipe (bf16, INT8, FP8, BitNet), in ONE process.

    PYTHONPATH=. python benchmarks/train_throughput.py --out benchmarks/results/train_throughput.json

Every row uses the trainer's own jitted step (``train.steps.step_functions``: fp32 master
weights, bf16 compute, AdamW, clipping, donated state) on synthetic batches, so it measures
what ``python -m train.main`` runs. Per config: initialize, compile (timed on its own, with
XLA's memory estimate), run ``--warmup`` steps, then time ``--steps`` steps and block on the
result. MFU counts model FLOPs (6 N T plus causal attention, ``train.model``) against the
device's bf16 dense peak for every recipe, so low-bit rows can pass what bf16 reaches.

Every row also lists its compile time and the compiled step's collectives (``jaxlowbit.parallel.hlo``):
bytes per step per op and replica group size, and per mesh axis, op and element type
(``bytes_by_axis``: ``{"fsdp": {"all-gather": {"u8": ...}, "reduce-scatter": {"f32": ...}}}``), each
device's result bytes with loops counted; the table prints the per-axis bytes under the timings.

``--variants "A;B"`` runs every config once per variant, each a comma-separated list of KEY=VALUE
overrides on top of ``--set`` ("" = as configured), e.g. ``";mesh.xla_overlap=false"`` times each config
with and without collective overlap in one process. A key ``policy.NAME`` sets the dispatch constant
``pallas_kernels.policy.NAME`` for that variant's rows instead (restored after each), so a kernel is timed
against the default dispatch in one process, e.g. ``";policy.TERNARY_WEIGHTS_ON_KERNEL=false"`` (XLA's
quantization of BitNet's weights against the tile kernel). ``speedup_vs_bf16`` compares a row with the bf16
row of the same model shape, device count and variant. ``--one_device_row`` adds the first config's
bf16 step on one device with the same sequences per device (``batch_size / devices``), against which
FSDP rows report ``per_device_vs_one_device``. ``--time_budget_s`` starts no row after that many seconds
(such rows are listed as skipped), so a lent machine's call ends in time.

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
import contextlib
import gc
import json
import pathlib
import sys
import time
import traceback
from unittest import mock

import jax
import numpy as np

from benchmarks import common, peers
from jaxlowbit.parallel.hlo import bytes_by_axis, collectives, summarize
from pallas_kernels import policy
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


def config_name(path: str) -> str:
  """``configs/int8_1b.py`` -> ``int8_1b``; ``configs/layers_8b.py:int8`` -> ``layers_8b:int8``."""
  path, _, arg = path.partition(".py:")
  return pathlib.Path(path).stem + (f":{arg}" if arg else "")


def parse_overrides(pairs: list[str]) -> dict:
  overrides = {}
  for pair in pairs:
    if "=" not in pair:
      raise SystemExit(f"--set expects KEY=VALUE (e.g. model.remat_policy=full), got {pair!r}")
    key, value = pair.split("=", 1)
    overrides[key] = parse_value(value)
  return overrides


POLICY_PREFIX = "policy."


def split_policy(variant: dict) -> tuple[dict, dict]:
  """A variant's ``(config overrides, pallas_kernels.policy constants)``; SystemExit naming an unknown constant."""
  values = {k[len(POLICY_PREFIX):]: v for k, v in variant.items() if k.startswith(POLICY_PREFIX)}
  unknown = [name for name in values if not name.isupper() or not hasattr(policy, name)]
  if unknown:
    raise SystemExit(f"--variants: pallas_kernels.policy has no constant {', '.join(unknown)} "
                     f"(e.g. {POLICY_PREFIX}TERNARY_WEIGHTS_ON_KERNEL=false)")
  return {k: v for k, v in variant.items() if not k.startswith(POLICY_PREFIX)}, values


def policy_set(values: dict):
  """``pallas_kernels.policy`` constants set to ``values`` while a row is built and timed (read as the step traces;
  ``train.steps`` caches steps on them, so the row traces afresh)."""
  return mock.patch.multiple(policy, **values) if values else contextlib.nullcontext()


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
  found = collectives(compiled.as_text())
  moved = summarize(found, by_group=True)  # per op and replica group size
  mesh_shape = getattr(functions.runtime, "mesh_shape", None)  # {axis: size} under FSDP; None on one device
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
      "tokens_per_s_per_device": tokens_per_step / step_time / functions.runtime.num_devices,
      "model_shape": model_shape(model_config, config),
      "mesh": mesh_shape,
      "compiler_options": dict(getattr(functions, "compiler_options", {})),
      "grad_reduce_dtype": spec.fsdp.grad_reduce_dtype,
      "compile_s": compile_s,
      "temp_gib": temp_gib,
      "collectives": moved,
      "bytes_by_axis": bytes_by_axis(found, mesh_shape) if mesh_shape else {},
      "moved_mib": sum(e["bytes"] for e in moved.values()) / 2**20,  # per device and step
      "last_loss": loss,
  }


def model_shape(model_config, config) -> str:
  """What makes two rows comparable (a recipe's extra norms aside): the model's shape and the batch."""
  m = model_config
  return f"d{m.d_model} L{m.n_layers} h{m.n_heads}/{m.n_kv_heads} ff{m.d_ff} b{config.batch_size}x{config.seq_len}"


def _ratio(value, base) -> str:
  return "-" if value is None or base is None else f"{value / base:.2f}x"


# Short names of the collective ops in the printed table.
_OP_NAMES = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
             "collective-permute": "CP"}


def _size(n: int) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def format_axis_bytes(table: dict) -> str:
  """``{axis: {op: {dtype: bytes}}}`` as ``fsdp: AG u8 1.23 GB, RS f32 3.90 GB; data: ...`` (GB = 1e9 bytes)."""
  parts = []
  for axis, ops in table.items():
    cells = [f"{_OP_NAMES.get(op, op)} {dtype} {_size(n)}" for op, per in ops.items() for dtype, n in per.items()]
    parts.append(f"{axis}: {', '.join(cells)}")
  return "; ".join(parts) or "-"


def format_table(rows: list[dict]) -> str:
  header = ["config", "recipe", "tokens/s", "per device", "step ms", "MFU", "vs bf16", "vs first", "compile s",
            "temp GiB", "moved MiB"]
  lines, axis_lines = [], []
  base = next((r["tokens_per_s"] for r in rows if "tokens_per_s" in r), None)
  for r in rows:
    if "tokens_per_s" not in r:
      reason = "error: " + r["error"][:60] if "error" in r else "skipped: " + r.get("skipped", "?")
      lines.append([r["name"], r.get("recipe", "?"), reason, *[""] * (len(header) - 3)])
      continue
    lines.append([
        r["name"],
        r["recipe"],
        f"{r['tokens_per_s']:,.0f}",
        f"{r['tokens_per_s_per_device']:,.0f}",
        f"{1e3 * r['step_time_s']:.1f}",
        "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
        "-" if r.get("speedup_vs_bf16") is None else f"{r['speedup_vs_bf16']:.2f}x",
        _ratio(r["tokens_per_s"], base),
        f"{r['compile_s']:.1f}",
        "-" if r["temp_gib"] is None else f"{r['temp_gib']:.1f}",
        f"{r['moved_mib']:,.1f}",
    ])
    if r.get("bytes_by_axis"):
      axis_lines.append(f"  {r['name']}: {format_axis_bytes(r['bytes_by_axis'])}")
  widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]

  def fmt(cells: list) -> str:
    return " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))

  one = [f"{r['name']}: per device {r['per_device_vs_one_device']:.1%} of one device" for r in rows
         if r.get("per_device_vs_one_device") is not None and r["recipe"] == "bf16"]
  note = (f"vs bf16: tokens/s over the bf16 row of the same model shape, devices and variant; vs first: over the first "
          f"row ({rows[0]['name']}); moved: result bytes of each device's collectives per step, as "
          "hlo.Collective.bytes counts them")
  blocks = [fmt(header), "-+-".join("-" * w for w in widths), *map(fmt, lines), note]
  if axis_lines:
    blocks += ["collective bytes per step and device, by mesh axis, op and element type:", *axis_lines]
  return "\n".join(blocks + one)


def add_ratios(rows: list[dict]) -> None:
  """``speedup_vs_first``, ``speedup_vs_bf16`` (the bf16 row of the same model shape, devices and variant)
  and, for FSDP rows, ``per_device_vs_one_device`` (the one-device bf16 row of the same model shape and
  sequences per device), where those rows ran."""
  timed = [r for r in rows if "tokens_per_s" in r]
  base = timed[0] if timed else None
  bf16 = {}
  for r in timed:
    if r["recipe"] == "bf16":
      bf16.setdefault((r["model_shape"], r["devices"], r.get("variant_name", "")), r)
  for r in timed:
    r["speedup_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
    ref = bf16.get((r["model_shape"], r["devices"], r.get("variant_name", "")))
    r["speedup_vs_bf16"] = None if ref is None else r["tokens_per_s"] / ref["tokens_per_s"]
  one = next((r for r in timed if r.get("one_device_baseline")), None)
  for r in timed:
    if one is not None and r["devices"] > 1 and r["batch_size"] // r["devices"] == one["batch_size"] and (
        r["model_shape"].split(" b")[0] == one["model_shape"].split(" b")[0]):
      r["per_device_vs_one_device"] = r["tokens_per_s_per_device"] / one["tokens_per_s"]


def write_result(args, peak: float | None, overrides: dict, rows: list[dict]) -> pathlib.Path:
  """The JSON of the rows so far (with :func:`add_ratios`), headed by ``common.metadata()`` (device, jax, date,
  commit)."""
  add_ratios(rows)
  result = {
      "benchmark": "train_throughput",
      **common.metadata(),
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
  parser.add_argument("--variants", default="", help="';'-separated variants, each comma-separated KEY=VALUE "
                      "overrides ('' = as configured); every config runs once per variant, e.g. "
                      "';mesh.xla_overlap=false'")
  parser.add_argument("--one_device_row", action="store_true", help="also time the first config in bf16 on one "
                      "device with batch_size / devices sequences (the FSDP rows' per-device baseline)")
  parser.add_argument("--time_budget_s", type=float, default=None, help="start no row after this many seconds")
  parser.add_argument("--peak_tflops", type=float, default=None, help="bf16 dense peak (default: by device)")
  parser.add_argument("--out", required=True, help="JSON file to write")
  args = parser.parse_args(argv)
  started = time.perf_counter()

  overrides = {"data.source": "synthetic", "mesh.fsdp": 1, **parse_overrides(args.set)}
  runs = [(path, None, None) for path in args.configs.split(",") if path]  # (config, field, value)
  runs += [(runs[0][0], "recipe", recipe) for recipe in args.extra_recipes.split(",") if recipe]
  runs += [(runs[0][0], "optimizer", name) for name in args.extra_optimizers.split(",") if name]
  runs += [(runs[0][0], "peer", name) for name in args.peers.split(",") if name]
  variants = [parse_overrides([pair for pair in text.split(",") if pair.strip()]) for text in args.variants.split(";")]
  for variant in variants:
    split_policy(variant)  # an unknown policy constant stops the run before anything compiles
  first = runs[0][0]
  runs = [(path, field, value, variant) for variant in variants for path, field, value in runs]
  if args.one_device_row:  # after the first variant's rows: a time budget cuts the other variants first
    runs.insert(len(runs) // len(variants), (first, "one_device", None, {}))
  peak = args.peak_tflops or metrics.peak_tflops()
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, bf16 peak {peak} TFLOP/s")

  rows = []
  for path, field, value, variant in runs:
    variant_name = ",".join(f"{k}={v}" for k, v in variant.items())
    name = config_name(path) + (f"+{value}" if value else "") + (f" [{variant_name}]" if variant_name else "")
    peer = value if field == "peer" else None
    config_variant, policy_values = split_policy(variant)
    run_overrides = {**overrides, **config_variant, **({"recipe": "bf16"} if peer else {field: value} if field else {})}
    if field == "one_device":
      name = config_name(path).split(":")[0] + ":bf16 one device"
      run_overrides = {**overrides, "mesh.fsdp": 1, "recipe": "bf16"}
    if peer and peers.missing(peer):
      print(peers.missing(peer), flush=True)
      continue
    if args.time_budget_s is not None and time.perf_counter() - started > args.time_budget_s:
      rows.append({"name": name, "recipe": value if field == "recipe" else "?", "skipped": "time budget"})
      print(f"{name}: skipped (time budget of {args.time_budget_s:.0f} s spent)", flush=True)
      continue
    try:
      config = train_config.load_file(path, run_overrides)
      if field == "one_device":  # the sequences one device of the FSDP rows computes
        fsdp_size = overrides.get("mesh.fsdp", 1)
        config.batch_size //= jax.device_count() if fsdp_size == train_config.MESH_AUTO else fsdp_size
      train_config.check(config)
      with policy_set(policy_values):
        timed = bench_one(config, args.steps, args.warmup, peak, peer)
      row = {"name": name, **timed, "variant": variant, "variant_name": variant_name,
             "one_device_baseline": field == "one_device"}
      print(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, {1e3 * row['step_time_s']:.1f} ms/step, "
            f"loss {row['last_loss']:.3f}", flush=True)
    except Exception as e:  # one failing recipe (e.g. out of memory) must not lose the others
      traceback.print_exc()
      row = {"name": name, "recipe": value if field in ("recipe", "peer") else "?", "error": f"{type(e).__name__}: {e}"}
      jax.clear_caches()  # e.g. out of memory: drop what the failed row compiled before the next one
    rows.append(row)
    write_result(args, peak, overrides, rows)  # after every config: a later crash keeps these
    gc.collect()

  out = write_result(args, peak, overrides, rows)
  print(f"\nwrote {out}\n")
  print(format_table(rows))
  if any("error" in r for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  np.set_printoptions(precision=4)
  main()
