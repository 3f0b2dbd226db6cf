"""train.data: tokenizer, corpora, splits, token files, deterministic resumable streams, and
global batches that each process reads only its share of (one process with 8 devices, and two
real ``jax.distributed`` processes)."""

import json
import sys
import types

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import run_distributed_workers
from train import data, runtime


def _data_config(**overrides):
  config = ml_collections.ConfigDict(
      dict(source="text", tokenizer="byte", path="", suffixes=".py", val_path="", val_fraction=0.05, hf_name="",
           hf_config="", hf_split="train", hf_text_field="text", hf_max_docs=0)
  )
  config.update(overrides)
  return config


def _write_tree(root, count=40, size=400):
  rng = np.random.default_rng(0)
  for i in range(count):
    folder = root / f"pkg{i % 3}"
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(rng.choice(list("abcdefgh \n")) for _ in range(size))
    (folder / f"m{i}.py").write_text(f"# doc {i}\n{text}")
  (root / "notes.txt").write_text("not python")
  (root / "site-packages").mkdir()
  (root / "site-packages" / "third_party.py").write_text("skip me")


def test_tokenizer_round_trip_and_specials():
  text = "def f(x):\n  return 'héllo' + x  # ✓\n"
  tokens = data.encode(text)
  assert tokens.dtype == np.uint16 and tokens.size == len(text.encode("utf-8"))
  assert data.decode(tokens) == text
  doc = data.encode_document(text)
  assert doc[0] == data.BOS_ID and doc[-1] == data.EOS_ID and np.array_equal(doc[1:-1], tokens)
  assert data.decode(doc) == text  # specials are dropped
  assert data.VOCAB_SIZE == 259 and max(data.BOS_ID, data.EOS_ID, data.PAD_ID) == data.VOCAB_SIZE - 1


def test_default_corpus_is_the_stdlib():
  files = dict(data.find_text_files([data.stdlib_root()], data.DEFAULT_SUFFIXES))
  assert "os.py" in files and "json/decoder.py" in files
  assert not any("site-packages" in name for name in files)
  assert len(files) > 500


def test_text_corpus_folders_suffixes_and_split(tmp_path):
  _write_tree(tmp_path)
  files = data.find_text_files([tmp_path], [".py"])
  names = [n for n, _ in files]
  assert len(files) == 40 and names == sorted(names) and "notes.txt" not in names
  assert not any("third_party" in n for n in names)
  corpus = data.load_text_corpus([str(tmp_path)], [".py"], val_fraction=0.25)
  val_names = [n for n in names if data.is_validation(n, 0.25)]
  assert 0 < len(val_names) < 40
  # Every document sits whole in exactly one split: count BOS markers and bytes.
  n_val_bytes = sum(len(p.read_bytes()) for n, p in files if n in val_names)
  assert np.sum(corpus.validation == data.BOS_ID) == len(val_names)
  assert np.sum(corpus.train == data.BOS_ID) == 40 - len(val_names)
  assert corpus.validation.size == n_val_bytes + 2 * len(val_names)
  # The split does not depend on which other files exist.
  assert data.is_validation(val_names[0], 0.25)
  again = data.load_text_corpus([str(tmp_path / "pkg0"), str(tmp_path / "pkg1")], [".py"], 0.25)
  assert again.train.size + again.validation.size < corpus.train.size + corpus.validation.size
  with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
    data.load_text_corpus([str(tmp_path / "missing")], [".py"], 0.1)


def test_stream_is_deterministic_seeded_and_covers_each_epoch():
  seq_len, batch = 8, 4
  tokens = np.arange(203, dtype=np.uint32)  # token i == position i, so windows reveal their start
  a = data.WindowBatches(tokens, seq_len, batch, seed=3)
  b = data.WindowBatches(tokens, seq_len, batch, seed=3)
  c = data.WindowBatches(tokens, seq_len, batch, seed=4)
  batches_a = [a.next() for _ in range(30)]
  batches_b = [b.next() for _ in range(30)]
  assert all(np.array_equal(x, y) for x, y in zip(batches_a, batches_b))
  assert not all(np.array_equal(x, y) for x, y in zip(batches_a, [c.next() for _ in range(30)]))
  rows = np.concatenate(batches_a)
  assert rows.dtype == np.int32 and rows.shape[1] == seq_len + 1
  assert np.all(np.diff(rows, axis=1) == 1)  # contiguous windows of the corpus
  # Epoch e visits each of its windows exactly once, starting at the epoch's offset.
  start = 0
  for epoch in range(3):
    offset, perm = a._epoch(epoch)
    starts = rows[start : start + len(perm), 0]
    assert sorted(starts) == [offset + i * seq_len for i in range(len(perm))]
    start += len(perm)


def test_stream_resumes_at_saved_position():
  tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
  full = data.WindowBatches(tokens, 16, 5, seed=1)
  expected = [full.next() for _ in range(40)]  # crosses several epochs (312 windows / 5 per batch)
  first = data.WindowBatches(tokens, 16, 5, seed=1)
  for _ in range(23):
    first.next()
  state = json.loads(json.dumps(first.state()))  # what a checkpoint stores
  resumed = data.WindowBatches(tokens, 16, 5, seed=1)
  resumed.restore(state)
  assert resumed.position == 23 * 5
  assert all(np.array_equal(resumed.next(), expected[i]) for i in range(23, 40))
  other = data.WindowBatches(tokens[:-100], 16, 5, seed=1)
  with pytest.raises(ValueError, match="num_tokens"):
    other.restore(state)


def test_synthetic_stream_deterministic_and_resumable():
  a = data.SyntheticBatches(seq_len=32, batch_size=3, seed=0)
  expected = [a.next() for _ in range(5)]
  assert np.all((np.diff(expected[0], axis=1) - expected[0][:, 1:2] + expected[0][:, :1]) % 256 == 0)
  b = data.SyntheticBatches(seq_len=32, batch_size=3, seed=0)
  b.restore({**a.state(), "position": 6})
  assert np.array_equal(b.next(), expected[2])
  with pytest.raises(ValueError, match="seed"):
    b.restore({**a.state(), "seed": 1})


def test_token_files_round_trip_and_split(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 300, 10_000)
  path = data.write_token_file(tmp_path / "corpus.bin", tokens, vocab_size=300)
  loaded, vocab = data.read_token_file(path)
  assert isinstance(loaded, np.memmap) and loaded.dtype == np.uint16 and vocab == 300
  assert np.array_equal(loaded, tokens)
  big = data.write_token_file(tmp_path / "big.bin", np.array([0, 70_000, 5]), vocab_size=100_000)
  assert data.read_token_file(big)[0].dtype == np.uint32
  corpus = data.load_token_corpus(str(path), "", val_fraction=0.1)
  assert corpus.validation.size == 1000 and np.array_equal(corpus.validation, tokens[-1000:])
  with pytest.raises(ValueError, match="token ids must lie"):
    data.write_token_file(tmp_path / "bad.bin", np.array([0, 300]), vocab_size=300)
  (tmp_path / "orphan.bin").write_bytes(b"\0\0")
  with pytest.raises(FileNotFoundError, match="orphan.bin.json"):
    data.read_token_file(tmp_path / "orphan.bin")


def test_token_file_cli_and_build(tmp_path):
  _write_tree(tmp_path / "src")
  data.main([str(tmp_path / "out" / "corpus"), str(tmp_path / "src"), "--val_fraction", "0.3"])
  config = _data_config(source="tokens", path=str(tmp_path / "out" / "corpus.train.bin"),
                        val_path=str(tmp_path / "out" / "corpus.val.bin"))
  built = data.build(config, seq_len=16, batch_size=2, eval_batches=3, seed=0)
  assert built.vocab_size == data.VOCAB_SIZE
  assert built.train.next().shape == (2, 17) and 1 <= len(built.validation) <= 3
  from_text = data.build(_data_config(path=str(tmp_path / "src"), val_fraction=0.3), 16, 2, 3, 0)
  assert np.array_equal(from_text.train.tokens, built.train.tokens)  # same tokens either way


def test_validation_batches_fixed_and_checked():
  tokens = np.arange(1000, dtype=np.uint16)
  batches = data.validation_batches(tokens, seq_len=10, batch_size=4, num_batches=100)
  assert len(batches) == 99 // 4 and batches[0][0, 0] == 0 and batches[0][1, 0] == 10
  with pytest.raises(ValueError, match="fewer than one batch"):
    data.validation_batches(tokens[:30], seq_len=10, batch_size=4, num_batches=1)


def test_bad_source_and_small_corpus_errors():
  with pytest.raises(ValueError, match="choose 'text'"):
    data.load_corpus(_data_config(source="parquet"))
  with pytest.raises(ValueError, match="too few"):
    data.WindowBatches(np.zeros(10, np.uint16), seq_len=8, batch_size=1, seed=0)


def test_hf_source_with_a_stand_in_datasets_module(monkeypatch):
  docs = [{"text": f"document number {i} " * 5} for i in range(50)]
  fake = types.SimpleNamespace(load_dataset=lambda name, config, split: docs)
  monkeypatch.setitem(sys.modules, "datasets", fake)
  corpus = data.load_hf_corpus("some/dataset", "", "train", "text", max_docs=20, val_fraction=0.2)
  assert np.sum(corpus.train == data.BOS_ID) + np.sum(corpus.validation == data.BOS_ID) == 20
  monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
  with pytest.raises(ImportError, match="pip install datasets"):
    data.load_hf_corpus("some/dataset", "", "train", "text", 20, 0.2)


def test_a_tokenizer_json_tokenizes_text_token_files_and_hf_datasets(tmp_path, monkeypatch):
  """config.data.tokenizer=<tokenizer.json>: every document is ``encode(text).ids + [EOS]`` for text
  folders, ``python -m train.data --tokenizer`` token files and HF datasets alike; decode inverts encode."""
  tokenizers = pytest.importorskip("tokenizers")
  _write_tree(tmp_path / "src")
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  tokenizer.train([str(p) for p in (tmp_path / "src").rglob("m*.py")],
                  tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                 initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  path = tmp_path / "tok" / "tokenizer.json"
  path.parent.mkdir()
  tokenizer.save(str(path))
  ours = data.tokenizer_for(str(path.parent))  # a folder holding tokenizer.json works too
  assert ours.vocab_size == tokenizer.get_vocab_size() and ours.eos_id == tokenizer.token_to_id("</s>")

  files = data.find_text_files([tmp_path / "src"], [".py"])
  expected = np.concatenate([tokenizer.encode(p.read_text()).ids + [ours.eos_id] for _, p in files])
  data.main([str(tmp_path / "out" / "c"), str(tmp_path / "src"), "--suffixes", ".py", "--val_fraction", "0",
             "--tokenizer", str(path)])
  tokens, vocab_size = data.read_token_file(tmp_path / "out" / "c.train.bin")
  assert vocab_size == ours.vocab_size and tokens.dtype == np.uint16
  np.testing.assert_array_equal(tokens, expected)
  built = data.build(_data_config(path=str(tmp_path / "src"), val_fraction=0.3, tokenizer=str(path)), 16, 2, 1, 0)
  assert built.vocab_size == ours.vocab_size and "tokenizer.json tokens" in built.description
  kept = [tokenizer.encode(p.read_text()).ids + [ours.eos_id] for name, p in files if not data.is_validation(name, 0.3)]
  np.testing.assert_array_equal(built.train.tokens, np.concatenate(kept))

  docs = [{"text": p.read_text()} for _, p in files]
  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, config, split: docs))
  corpus = data.load_hf_corpus("some/dataset", "", "train", "text", 0, 0.0, ours)
  np.testing.assert_array_equal(corpus.train, expected)

  text = "# doc 7\nabc def"
  assert ours.decode(ours.encode_prompt(text)) == text



# ---------------------------------------------------------------------------------------------
# Global batches read row by row: each process reads only its devices' rows.


def counting(stream):
  """``stream`` whose ``sequence`` calls are recorded in the returned list."""
  calls, sequence = [], stream.sequence
  stream.sequence = lambda index: calls.append(index) or sequence(index)
  return calls


def test_global_batches_read_only_the_rows_asked_for():
  tokens = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint16)
  for make in (lambda: data.WindowBatches(tokens, 16, 6, seed=1), lambda: data.SyntheticBatches(16, 6, seed=1)):
    reference = make()
    expected = [reference.next(), reference.next()]
    stream = make()
    calls = counting(stream)
    first, second = stream.next_global(), stream.next_global()
    assert stream.position == 12 and not calls, "handing out a batch reads nothing"
    assert first.shape == (6, 17)
    np.testing.assert_array_equal(second.read([4, 1]), expected[1][[4, 1]])
    assert calls == [6 + 4, 6 + 1]
    np.testing.assert_array_equal(first.read(), expected[0])
    assert first.read([]).shape == (0, 17)
  held = data.GlobalBatch.of(expected[0])
  np.testing.assert_array_equal(held.read([2, 0]), expected[0][[2, 0]])
  assert data.GlobalBatch.of(held) is held


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_placing_a_batch_over_8_devices_reads_each_row_once(accum):
  stream = data.WindowBatches(np.arange(5000, dtype=np.uint16), 8, 32, seed=2)
  expected = data.WindowBatches(np.arange(5000, dtype=np.uint16), 8, 32, seed=2).next()
  calls = counting(stream)
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), P("batch"))
  placed = runtime.place_global_batch(stream.next_global(), sharding, accum)
  assert sorted(calls) == list(range(32)), "every row read once, by the device that holds it"
  # Microbatch a is rows [8a, 8a + 8) of the batch, each device holding its slice of every microbatch.
  layout = expected if accum == 1 else expected.reshape(accum, 32 // accum, 9).swapaxes(0, 1)
  np.testing.assert_array_equal(np.asarray(placed), layout)
  for shard in placed.addressable_shards:
    assert shard.data.shape[0] == 32 // accum // 8


def test_two_processes_each_read_only_their_rows(tmp_path):
  """jax.distributed over 2 processes x 2 CPU devices: each process reads exactly the half of every
  global batch its devices hold (never the other half), and holds the rows one process would."""
  run_distributed_workers("data_share_worker.py", [[str(tmp_path / f"p{i}.json")] for i in range(2)], 300)
  import data_share_worker as worker_module

  results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
  assert [r["process_count"] for r in results] == [2, 2] and results[0]["device_count"] == 4
  batch = worker_module.BATCH
  reads = [sorted(r["read"]) for r in results]
  assert len(reads[0]) == len(reads[1]) == batch * len(worker_module.ACCUMS) // 2, "half of each batch per process"
  assert sorted(reads[0] + reads[1]) == list(range(batch * len(worker_module.ACCUMS))), "together: every row once"
  one = worker_module.stream()
  for b, accum in enumerate(worker_module.ACCUMS):
    full = one.next()
    layout = full if accum == 1 else full.reshape(accum, batch // accum, -1).swapaxes(0, 1)
    for result in results:
      for shard in result["shards"][b]:
        start, stop = shard["rows"]
        np.testing.assert_array_equal(shard["data"], layout[start:stop])
