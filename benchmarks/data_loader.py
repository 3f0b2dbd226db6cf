"""Input pipeline throughput on the host: the trainer's loader against grain pipelines.

    PYTHONPATH=. python benchmarks/data_loader.py --out benchmarks/results/data_loader_cpu.json

Every loader yields the same batches, the trainer's (``train.data.WindowBatches``: stream
sequence ``i`` is a pure function of ``(tokens, seed, i)``), for the 1B configs' 8 x 2048
token batches (uint16 tokens), configs/finetune_llama.py's 16 x 2048 (uint32 tokens, as a
128k vocabulary stores them) and the 125M configs' 32 x 1024, over the default corpus (the
Python standard library, byte tokens) read from a token file through ``np.memmap``, as runs on
large corpora read it (the file sits in the page cache: what is measured is the loader, not the disk). Loaders:

- ``trainer``: ``stream.next()``, synchronous (what ``train.loop`` did before it read only its
  share: every process built the whole global batch);
- ``trainer_share_1/8``: one process's rows of each batch when the batch is split over 8
  processes (``next_global().read(rows)``, what the trainer now reads per host);
- ``trainer_placed_8dev``: what ``train.loop`` now does per step on 8 (virtual CPU) devices,
  ``train.runtime.place_global_batch`` (each device's shard reads its own rows), until the
  array is ready; ``whole_placed_8dev``: the former path, the whole batch read and then placed
  (``jaxlowbit.fsdp.shard_batch``'s ``device_put``);
- ``grain_map_batch tN``: ``grain.MapDataset`` over batch indices, each element a whole batch,
  ``to_iter_dataset(ReadOptions(num_threads=N, prefetch_buffer_size=2N))`` (N = 0: no prefetch);
- ``grain_map_records tN``: ``MapDataset`` over sequence indices, ``.batch(B)``, then as above;
- ``grain_dataloader wW``: ``grain.DataLoader`` with an ``IndexSampler`` (no shuffle: the order is
  the stream's), ``Batch(B)``, ``worker_count=W`` (W > 0: worker processes).

Each row reports batches/s (median of ``--reps`` windows of ``--seconds``, the loaders taking
turns window by window), with a simulated
step of ``--step_ms`` milliseconds (a sleep: the device computing while the host waits) how
long the loop waits for the next batch per step, and whether the loader's first batches are
the trainer's (``DataLoader`` workers batch their own records, so with W > 0 they are not).
Prints a table and writes JSON.
"""

from __future__ import annotations

import os

# Eight virtual CPU devices for the placed rows, as the tests use; set before jax starts a backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks import common  # noqa: E402
from train import data, runtime  # noqa: E402

# (batch_size, seq_len, vocab_size) of configs/*_1b.py, configs/finetune_llama.py (Llama 3's 128k
# vocabulary: uint32 token files) and configs/*_125m.py.
SHAPES = {"1b": (8, 2048, data.VOCAB_SIZE), "finetune": (16, 2048, 128_256), "125m": (32, 1024, data.VOCAB_SIZE)}
SEED = 0
RECORDS = 10**9  # stream sequences a grain pipeline may index (the stream itself is unbounded)


class WindowSource:
  """grain's random-access source of stream sequences (picklable: worker processes reopen the token file)."""

  def __init__(self, path: str, seq_len: int):
    self.path, self.seq_len, self._stream = path, seq_len, None

  def __len__(self) -> int:
    return RECORDS

  def __getitem__(self, index: int) -> np.ndarray:
    if self._stream is None:
      self._stream = data.WindowBatches(data.read_token_file(self.path)[0], self.seq_len, 1, SEED)
    return self._stream.sequence(int(index)).astype(np.int32)

  def __getstate__(self):
    return {"path": self.path, "seq_len": self.seq_len, "_stream": None}


def loaders(path: str, batch: int, seq_len: int, threads: list[int], workers: list[int]) -> dict[str, Callable]:
  """``name -> make()``; ``make()`` returns a ``next_batch()`` callable."""
  import grain  # noqa: PLC0415  (optional: pip install grain)

  tokens = data.read_token_file(path)[0]

  def trainer():
    return data.WindowBatches(tokens, seq_len, batch, SEED).next

  def trainer_share():
    stream, rows = data.WindowBatches(tokens, seq_len, batch, SEED), np.arange(batch // 8)
    return lambda: stream.next_global().read(rows)

  sharding = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("batch",)), P("batch"))

  def trainer_placed():
    stream = data.WindowBatches(tokens, seq_len, batch, SEED)
    return lambda: np.asarray(runtime.place_global_batch(stream.next_global(), sharding).block_until_ready())

  def whole_placed():
    stream = data.WindowBatches(tokens, seq_len, batch, SEED)
    return lambda: np.asarray(jax.device_put(stream.next(), sharding).block_until_ready())

  def grain_iter(dataset, n: int) -> Callable:
    options = grain.ReadOptions(num_threads=n, prefetch_buffer_size=2 * n)
    return iter(dataset.to_iter_dataset(options)).__next__

  def map_batch(n: int):
    stream = data.WindowBatches(tokens, seq_len, batch, SEED)
    rows = np.arange(batch)
    return grain_iter(grain.MapDataset.range(RECORDS // batch).map(lambda i: stream.rows(i * batch, rows)), n)

  def map_records(n: int):
    source = WindowSource(path, seq_len)
    return grain_iter(grain.MapDataset.range(RECORDS).map(source.__getitem__).batch(batch), n)

  def dataloader(w: int):
    sampler = grain.samplers.IndexSampler(num_records=RECORDS, shuffle=False, num_epochs=1, seed=SEED)
    loader = grain.DataLoader(data_source=WindowSource(path, seq_len), sampler=sampler,
                              operations=[grain.transforms.Batch(batch)], worker_count=w,
                              read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    return iter(loader).__next__

  out = {"trainer": trainer, "trainer_share_1/8": trainer_share, "trainer_placed_8dev": trainer_placed,
         "whole_placed_8dev": whole_placed}
  out |= {f"grain_map_batch t{n}": (lambda n=n: map_batch(n)) for n in threads}
  out |= {f"grain_map_records t{n}": (lambda n=n: map_records(n)) for n in threads}
  out |= {f"grain_dataloader w{w}": (lambda w=w: dataloader(w)) for w in workers}
  return out


def batches_per_s(makers: dict[str, Callable], seconds: float, reps: int) -> dict[str, float]:
  """``name -> batches/s``: the median of ``reps`` windows of ``seconds`` per loader, the loaders
  taking turns window by window, so a busy shared host slows them alike rather than whichever ran then."""
  iterators = {}
  for name, make in makers.items():
    iterators[name] = make()
    iterators[name]()  # start-up (threads, workers, first epoch's permutation)
  rates = {name: [] for name in makers}
  for _ in range(reps):
    for name, next_batch in iterators.items():
      count, start = 0, time.perf_counter()
      while time.perf_counter() - start < seconds:
        next_batch()
        count += 1
      rates[name].append(count / (time.perf_counter() - start))
  return {name: statistics.median(r) for name, r in rates.items()}


def wait_per_step_ms(next_batch: Callable, step_ms: float, steps: int) -> float:
  """Median ms the loop waits for a batch when each step takes ``step_ms`` (the host sleeps meanwhile)."""
  next_batch()
  waits = []
  for _ in range(steps):
    time.sleep(step_ms / 1e3)
    start = time.perf_counter()
    next_batch()
    waits.append((time.perf_counter() - start) * 1e3)
  return statistics.median(waits)


def same_batches(make: Callable, expected: list[np.ndarray]) -> bool:
  """Whether ``make()``'s first batches are ``expected`` (or their first rows, for a share)."""
  next_batch = make()
  return all(np.array_equal(got := np.asarray(next_batch()), want[: len(got)]) for want in expected)


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or "unknown"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--shapes", default="1b,finetune", help=f"comma-separated keys of {list(SHAPES)}")
  parser.add_argument("--seconds", type=float, default=1.0, help="length of one timing window")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--threads", default="0,2,4", help="grain ReadOptions.num_threads values")
  parser.add_argument("--workers", default="0,2", help="grain DataLoader worker_count values")
  parser.add_argument("--step_ms", type=float, default=20.0, help="simulated step for the wait measurement")
  parser.add_argument("--wait_steps", type=int, default=30)
  args = parser.parse_args()
  import grain  # noqa: PLC0415
  from absl import flags  # noqa: PLC0415

  flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags (their defaults here)

  corpus = data.load_text_corpus([], data.DEFAULT_SUFFIXES, 0.0)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for shape in args.shapes.split(","):
      batch, seq_len, vocab_size = SHAPES[shape]
      path = str(data.write_token_file(os.path.join(tmp, f"stdlib_{vocab_size}.bin"), corpus.train, vocab_size))
      reference = data.WindowBatches(data.read_token_file(path)[0], seq_len, batch, SEED)
      expected = [reference.next() for _ in range(3)]
      makers = loaders(path, batch, seq_len, [int(t) for t in args.threads.split(",")],
                       [int(w) for w in args.workers.split(",")])
      rates = batches_per_s(makers, args.seconds, args.reps)
      for name, make in makers.items():
        rate, same = rates[name], same_batches(make, expected)
        wait = wait_per_step_ms(make(), args.step_ms, args.wait_steps)
        row = {"shape": shape, "batch": f"{batch}x{seq_len}", "token": np.dtype(data.token_dtype(vocab_size)).name,
               "loader": name, "batches_per_s": rate,
               "ms_per_batch": 1e3 / rate, "tokens_per_s": rate * batch * seq_len, "wait_ms_per_step": wait,
               "same_batches": same}
        rows.append(row)
        print(common.table([row], list(row)), flush=True)
  print(common.table(rows, ["batch", "token", "loader", "batches_per_s", "ms_per_batch", "tokens_per_s", "wait_ms_per_step",
                            "same_batches"]))
  path = common.write_json(
      "data_loader_cpu", rows, args.out, grain=grain.__version__, numpy=np.__version__, cpu=cpu_model(),
      cpus=os.cpu_count(), corpus=f"{corpus.description}; {corpus.train.size:,} tokens via np.memmap",
      step_ms=args.step_ms, seconds=args.seconds, reps=args.reps)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
