"""One process of test_train_data's 2-process run: ``python data_share_worker.py OUT``.

The test sets ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES=2`` and ``JAX_PROCESS_ID``; the
two processes' 2 CPU devices each form one 4-device mesh. Each process places the same two
global batches of a token stream (``train.runtime.place_global_batch``, without and with
gradient accumulation) and writes to OUT which stream sequences it read and what its devices hold.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlowbit import fsdp
from train import data, runtime

# A stream whose token i is i: each row's first token names the window it came from.
TOKENS, SEQ_LEN, BATCH, SEED = 4000, 16, 8, 3
ACCUMS = (1, 2)


def stream() -> data.WindowBatches:
  return data.WindowBatches(np.arange(TOKENS, dtype=np.uint16), SEQ_LEN, BATCH, SEED)


def main(out: str) -> None:
  assert fsdp.initialize_distributed(), "the environment must name a 2-process run"
  batches, read = stream(), []
  sequence = batches.sequence
  batches.sequence = lambda index: read.append(index) or sequence(index)
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), P("batch"))
  shards = []
  for accum in ACCUMS:
    placed = runtime.place_global_batch(batches.next_global(), sharding, accum)
    shards.append([{"rows": [s.index[0].start, s.index[0].stop], "data": np.asarray(s.data).tolist()}
                   for s in placed.addressable_shards])
  with open(out, "w") as f:
    json.dump({"read": read, "shards": shards, "process_count": jax.process_count(),
               "device_count": jax.device_count()}, f)


if __name__ == "__main__":
  main(sys.argv[1])
