"""Training data: tokenizers, corpora, and deterministic, resumable batches.

Tokenizers (``config.data.tokenizer``): ``"byte"`` (below), or the path of a Hugging Face
``tokenizer.json`` (the ``tokenizers`` package; e.g. the one of a checkpoint imported with
``train.hf``): its ids, its BOS (added by its post-processor, as Llama 3's does) and an EOS
appended to every document when it has one (:class:`HFTokenizer`). Text, HF datasets and
``python -m train.data --tokenizer ...`` token files use it; ``train.generate`` decodes with it.

Byte tokenizer: every byte of UTF-8 text is one token (ids 0-255), plus three specials::

    BOS_ID = 256   starts every document
    EOS_ID = 257   ends every document
    PAD_ID = 258   reserved (packed batches never pad)

so ``VOCAB_SIZE = 259``. No merges, no files, nothing to download; models round their
embedding up (``model.vocab_size``, 384 in the shipped configs) for tensor-core friendly
shapes. Token files written by other tokenizers may use any vocabulary up to 2**32.

Sources (``config.data.source``):

- ``"text"``: UTF-8 files, or folders searched recursively for ``data.suffixes``. With
  ``data.path = ""`` the corpus is the Python standard library's own sources
  (``sysconfig.get_paths()["stdlib"]``, ``*.py``, ``site-packages`` excluded): ~31 MB and
  ~1,800 files on CPython 3.11, present on every machine with Python and needing no
  network. It differs a little between Python versions; compare runs on one machine.
- ``"tokens"``: a pre-tokenized flat file of uint16/uint32 tokens read through
  ``np.memmap`` (written by :func:`write_token_file` or ``python -m train.data``).
- ``"synthetic"``: arithmetic byte sequences generated from the position, for speed runs.
- ``"hf"``: a Hugging Face ``datasets`` text dataset, byte-tokenized (only when
  ``datasets`` is installed and the dataset is in its local cache or reachable).

Validation split: text and HF documents go to validation when the CRC-32 of their name
(path relative to the corpus root, or index) falls in the first ``val_fraction`` of the
hash range, so the split does not depend on the seed or on which files came before.
Token files take the last ``val_fraction`` of their tokens (or a separate ``val_path``).

Batches: the training stream cuts the token array into windows of ``seq_len + 1`` tokens
(``seq_len`` apart, so every token is predicted once per epoch), and visits them in a
seeded random order that changes every epoch, with a random start offset per epoch. Batch
``i`` is a pure function of ``(tokens, seed, position)`` where ``position`` counts the
sequences consumed so far; that integer is saved in every checkpoint, so a resumed run
reads exactly the batches an uninterrupted run would have. Because any row of any batch can
be computed on its own, a stream hands out each global batch unread (:class:`GlobalBatch`):
the trainer reads only the rows the devices of its process hold (``train/runtime.py``), so
with several hosts each reads its share of the batch and no more.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from train import cli

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
TOKEN_DTYPE = np.uint16  # in-memory dtype of byte-tokenized corpora (ids < 2**16)
DEFAULT_SUFFIXES = (".py",)
# Folders of the stdlib tree that hold installed third-party packages or bytecode, not the stdlib.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
HASH_RANGE = 2**32  # zlib.crc32 values


# ---------------------------------------------------------------------------------------------
# Tokenizer


TOKEN_DTYPES = ("uint16", "uint32")  # what write_token_file writes


def token_dtype(vocab_size: int):
  """uint16 for vocabularies up to 2**16, else uint32."""
  return np.uint16 if vocab_size <= 2**16 else np.uint32


class ByteTokenizer:
  """The byte-level tokenizer (module doc) behind the :class:`HFTokenizer` interface."""

  name = "byte"
  vocab_size = VOCAB_SIZE
  eos_id = EOS_ID

  def encode_document(self, text: str | bytes) -> np.ndarray:
    return encode_document(text)

  def encode_prompt(self, text: str) -> np.ndarray:
    return np.concatenate([[BOS_ID], encode(text)]).astype(np.int32)

  def decode(self, tokens: Iterable[int]) -> str:
    return decode(tokens)


# EOS tokens of common tokenizer.json files (Llama 3, Llama 2 / Mistral, Qwen2 / GPT-2).
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>")


class HFTokenizer:
  """A Hugging Face ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``).

  Documents are ``encode(text).ids`` (the file's post-processor adds BOS where the model wants
  one) plus the EOS id when the vocabulary has one of :data:`EOS_NAMES`.
  """

  def __init__(self, path: str | os.PathLike):
    try:
      from tokenizers import Tokenizer  # noqa: PLC0415  (optional dependency: pip install tokenizers)
    except ImportError as e:
      raise ImportError("data.tokenizer=<tokenizer.json> needs Hugging Face tokenizers: pip install tokenizers") from e
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    if not path.is_file():
      raise FileNotFoundError(f"data.tokenizer: {path} not found (a tokenizer.json, or a folder holding one)")
    self.name = str(path)
    self.tokenizer = Tokenizer.from_file(str(path))
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = next((i for i in map(self.tokenizer.token_to_id, EOS_NAMES) if i is not None), None)

  def encode_document(self, text: str | bytes) -> np.ndarray:
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    ids = self.tokenizer.encode(text).ids + ([self.eos_id] if self.eos_id is not None else [])
    return np.asarray(ids, token_dtype(self.vocab_size))

  def encode_prompt(self, text: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(text).ids, np.int32)

  def decode(self, tokens: Iterable[int]) -> str:
    return self.tokenizer.decode([int(t) for t in tokens])


def tokenizer_for(name: str) -> ByteTokenizer | HFTokenizer:
  """``"byte"`` or the path of a ``tokenizer.json`` (or of a folder holding one)."""
  return ByteTokenizer() if name in ("", "byte") else HFTokenizer(name)


def encode(text: str | bytes) -> np.ndarray:
  """Byte-level tokens of ``text`` (UTF-8 for str): uint16 ``[n_bytes]``, no specials."""
  data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return np.frombuffer(data, np.uint8).astype(TOKEN_DTYPE)


def encode_document(text: str | bytes) -> np.ndarray:
  """``[BOS] + encode(text) + [EOS]`` as uint16."""
  return np.concatenate([[BOS_ID], encode(text), [EOS_ID]]).astype(TOKEN_DTYPE)


def decode(tokens: Iterable[int]) -> str:
  """Text of byte tokens; specials (and ids >= 256) are dropped, bad UTF-8 is replaced."""
  data = bytes(int(t) for t in tokens if 0 <= int(t) < NUM_BYTES)
  return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Corpora: (train tokens, validation tokens) as 1-D arrays


@dataclasses.dataclass
class Corpus:
  """Train and validation token arrays (1-D, uint16/uint32, possibly memory-mapped)."""

  train: np.ndarray
  validation: np.ndarray
  vocab_size: int
  description: str
  documents: int | None = None  # text corpora: files (split whole between train and validation); None: a token split


def stdlib_root() -> pathlib.Path:
  """The Python standard library's source folder (the default text corpus)."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def find_text_files(roots: Sequence[str | os.PathLike], suffixes: Sequence[str]) -> list[tuple[str, pathlib.Path]]:
  """``(name, path)`` of every file under ``roots``, sorted by name.

  A root that is a file is taken as it is (name: its file name); a folder is searched
  recursively for files ending in one of ``suffixes`` (name: the path relative to the root),
  skipping :data:`SKIPPED_DIRS`.
  """
  found = []
  for root in roots:
    root = pathlib.Path(root).expanduser()
    if root.is_file():
      found.append((root.name, root))
    elif root.is_dir():
      for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for filename in filenames:
          if filename.endswith(tuple(suffixes)):
            path = pathlib.Path(dirpath, filename)
            found.append((path.relative_to(root).as_posix(), path))
    else:
      raise FileNotFoundError(f"data.path: {root} is neither a file nor a folder")
  return sorted(found, key=lambda item: item[0])


def is_validation(name: str, val_fraction: float) -> bool:
  """Whether the document called ``name`` belongs to the validation split (CRC-32 of the name)."""
  return zlib.crc32(name.encode("utf-8")) < val_fraction * HASH_RANGE


def split_documents(
    documents: Iterable[tuple[str, bytes]], val_fraction: float, tokenizer: ByteTokenizer | HFTokenizer | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Encode ``(name, text)`` documents (byte tokenizer by default) and concatenate them into
  (train, validation) arrays (uint16, or uint32 for vocabularies over 2**16)."""
  tokenizer = tokenizer or ByteTokenizer()
  parts = {False: [], True: []}
  for name, text in documents:
    parts[is_validation(name, val_fraction)].append(tokenizer.encode_document(text))
  empty = np.zeros((0,), token_dtype(tokenizer.vocab_size))
  return tuple(np.concatenate(parts[split]) if parts[split] else empty for split in (False, True))


def load_text_corpus(
    paths: Sequence[str], suffixes: Sequence[str], val_fraction: float, tokenizer: ByteTokenizer | HFTokenizer | None = None
) -> Corpus:
  """Tokenized text files or folders (byte tokenizer by default); ``paths=()`` means the standard library's sources."""
  tokenizer = tokenizer or ByteTokenizer()
  roots = list(paths) or [stdlib_root()]
  files = find_text_files(roots, suffixes)
  if not files:
    raise FileNotFoundError(f"data.path: no files ending in {tuple(suffixes)} under {[str(r) for r in roots]}")
  train, validation = split_documents(((name, path.read_bytes()) for name, path in files), val_fraction, tokenizer)
  where = "the Python standard library" if not paths else ", ".join(str(p) for p in paths)
  return Corpus(train, validation, tokenizer.vocab_size, f"text: {len(files)} files from {where}, {tokenizer.name} tokens",
                len(files))


def load_hf_corpus(
    name: str, config_name: str, split: str, text_field: str, max_docs: int, val_fraction: float,
    tokenizer: ByteTokenizer | HFTokenizer | None = None,
) -> Corpus:
  """The first ``max_docs`` documents of a Hugging Face dataset split, tokenized (bytes by default)."""
  try:
    import datasets  # noqa: PLC0415  (optional dependency)
  except ImportError as e:
    raise ImportError("data.source='hf' needs Hugging Face datasets: pip install datasets") from e
  dataset = datasets.load_dataset(name, config_name or None, split=split)
  count = min(max_docs, len(dataset)) if max_docs > 0 else len(dataset)
  documents = ((f"{i}", dataset[i][text_field]) for i in range(count))
  tokenizer = tokenizer or ByteTokenizer()
  train, validation = split_documents(documents, val_fraction, tokenizer)
  return Corpus(train, validation, tokenizer.vocab_size, f"hf: {name}/{config_name or '-'}[{split}], {count} documents")


class DataError(cli.UserError, ValueError):
  """The data config or corpus cannot make the run's batches (too few tokens, a resume whose data stream differs, a
  source without its path): a user mistake, one line saying what to change (exit 2)."""


def _meta_path(path: str | os.PathLike) -> pathlib.Path:
  return pathlib.Path(f"{path}.json")


def write_token_file(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int = VOCAB_SIZE) -> pathlib.Path:
  """Write 1-D ``tokens`` as a flat binary file plus ``<path>.json`` (dtype, vocab_size, count).

  The dtype is :func:`token_dtype` (uint16 when ``vocab_size <= 2**16``, else uint32). Returns ``path``.
  """
  dtype = token_dtype(vocab_size)
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"write_token_file: tokens must be 1-D, got shape {tokens.shape}")
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f"write_token_file: token ids must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tokens.astype(dtype).tofile(path)
  meta = {"dtype": np.dtype(dtype).name, "vocab_size": int(vocab_size), "num_tokens": int(tokens.size)}
  _meta_path(path).write_text(json.dumps(meta, indent=1) + "\n")
  return path


def read_token_file(path: str | os.PathLike) -> tuple[np.ndarray, int]:
  """``(tokens, vocab_size)``: a read-only ``np.memmap`` of a file from :func:`write_token_file`."""
  meta_path = _meta_path(path)
  if not meta_path.exists():
    raise FileNotFoundError(
        f"{path}: no {meta_path.name} beside it; write token files with train.data.write_token_file"
    )
  meta = cli.read_json(meta_path, "token file description", "write token files with python -m train.data")
  dtype, vocab_size, count = meta.get("dtype"), meta.get("vocab_size"), meta.get("num_tokens")
  if dtype not in TOKEN_DTYPES or not all(isinstance(v, int) and v >= 0 for v in (vocab_size, count)):
    raise cli.UserError(f"{meta_path}: needs dtype (one of {TOKEN_DTYPES}), vocab_size and num_tokens (integers), got "
                        f"{dict(meta)}; write token files with python -m train.data")
  tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
  if tokens.size != count:
    raise cli.UserError(f"{path}: holds {tokens.size} tokens but {meta_path.name} says {count} (cut short?)")
  top = int(tokens.max()) if tokens.size else -1  # one pass; an id past the vocabulary would index past the embedding
  if top >= vocab_size:
    raise cli.UserError(f"{path}: holds token id {top}, outside its vocabulary of {vocab_size} ({meta_path.name}); "
                        "rewrite the file with the tokenizer that made it, or fix vocab_size there")
  return tokens, vocab_size


def load_token_corpus(path: str, val_path: str, val_fraction: float) -> Corpus:
  """A token file, split by ``val_path`` if given, else its last ``val_fraction`` of tokens."""
  tokens, vocab_size = read_token_file(path)
  if val_path:
    validation, val_vocab = read_token_file(val_path)
    vocab_size = max(vocab_size, val_vocab)
    train = tokens
  else:
    cut = tokens.size - int(tokens.size * val_fraction)
    train, validation = tokens[:cut], tokens[cut:]
  return Corpus(train, validation, vocab_size, f"tokens: {path} ({tokens.size} tokens)")


# ---------------------------------------------------------------------------------------------
# Batches


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
  """One global batch ``[batch_size, seq_len + 1]`` of a stream, not yet read.

  :meth:`read` computes only the rows asked for, so each process of a multi-host run reads
  the rows its devices hold and never the whole batch (``train/runtime.py`` asks per device).

  Attributes:
    read_rows: global row ids int ``[n]`` -> int32 ``[n, seq_len + 1]``.
    shape: ``(batch_size, seq_len + 1)``.
  """

  read_rows: Callable[[np.ndarray], np.ndarray]
  shape: tuple[int, int]

  @classmethod
  def of(cls, batch: np.ndarray | GlobalBatch) -> GlobalBatch:
    """``batch`` itself, or a batch already in host memory (int ``[B, T + 1]``) as a GlobalBatch."""
    if isinstance(batch, GlobalBatch):
      return batch
    batch = np.asarray(batch)
    return cls(lambda rows: batch[rows].astype(np.int32), batch.shape)

  def read(self, rows: np.ndarray | None = None) -> np.ndarray:
    """int32 ``[len(rows), seq_len + 1]``: the given global rows (default: the whole batch)."""
    rows = np.arange(self.shape[0]) if rows is None else np.asarray(rows, np.int64).reshape(-1)
    return self.read_rows(rows)


class _Stream:
  """What the two streams share: ``sequence(index)`` makes stream sequence ``index``; batches
  of ``batch_size`` consecutive sequences start at ``position``."""

  seq_len: int
  batch_size: int
  position: int

  def sequence(self, index: int) -> np.ndarray:
    raise NotImplementedError

  def rows(self, position: int, rows: np.ndarray) -> np.ndarray:
    """int32 ``[len(rows), seq_len + 1]``: stream sequences ``position + rows`` (rows of the batch at ``position``)."""
    out = np.empty((len(rows), self.seq_len + 1), np.int32)
    for i, row in enumerate(rows):
      out[i] = self.sequence(position + int(row))
    return out

  def next_global(self) -> GlobalBatch:
    """The next global batch, unread (:class:`GlobalBatch`); advances ``position``."""
    batch = GlobalBatch(functools.partial(self.rows, self.position), (self.batch_size, self.seq_len + 1))
    self.position += self.batch_size
    return batch

  def next(self) -> np.ndarray:
    """The next batch, read whole: int32 ``[batch_size, seq_len + 1]``; advances ``position``."""
    return self.next_global().read()


class WindowBatches(_Stream):
  """The training stream over a 1-D token array: ``next()`` -> int32 ``[batch_size, seq_len + 1]``.

  Epoch ``e`` uses ``rng = np.random.default_rng((seed, e))``: a start offset in
  ``[0, seq_len)`` and a permutation of the ``(n - offset - 1) // seq_len`` windows after it.
  Sequence ``i`` of the stream is window ``perm_e[i mod W_e]`` of epoch ``e = i div W_e`` (W
  varies by one at most between epochs, so epochs are counted exactly with ``_locate``).
  """

  kind = "windows"

  def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, position: int = 0):
    if tokens.ndim != 1:
      raise ValueError(f"WindowBatches: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size < 2 * seq_len + 1:
      raise DataError(
          f"WindowBatches: the corpus has {tokens.size} training tokens, too few for seq_len={seq_len}; "
          "use a larger corpus or a shorter seq_len"
      )
    self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
    self.position = position
    self._epoch_cache: tuple[int, int, np.ndarray] | None = None  # (epoch, offset, permutation)
    self._epoch_starts = [0]  # first stream index of epochs 0, 1, ... (extended on demand)

  def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
    if self._epoch_cache is None or self._epoch_cache[0] != epoch:
      rng = np.random.default_rng((self.seed, epoch))
      offset = int(rng.integers(self.seq_len))
      windows = (self.tokens.size - offset - 1) // self.seq_len
      self._epoch_cache = (epoch, offset, rng.permutation(windows))
    return self._epoch_cache[1], self._epoch_cache[2]

  def _locate(self, index: int) -> tuple[int, int]:
    """``(epoch, index within the epoch)`` of stream sequence ``index``."""
    while self._epoch_starts[-1] <= index:
      epoch = len(self._epoch_starts) - 1
      self._epoch_starts.append(self._epoch_starts[-1] + len(self._epoch(epoch)[1]))
    epoch = int(np.searchsorted(self._epoch_starts, index, side="right")) - 1
    return epoch, index - self._epoch_starts[epoch]

  def sequence(self, index: int) -> np.ndarray:
    """Stream sequence ``index``: ``seq_len + 1`` consecutive tokens."""
    epoch, within = self._locate(index)
    offset, perm = self._epoch(epoch)
    start = offset + int(perm[within]) * self.seq_len
    return self.tokens[start : start + self.seq_len + 1]

  def state(self) -> dict[str, Any]:
    """What a checkpoint stores to resume this stream (JSON-serializable)."""
    return {"kind": self.kind, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
            "num_tokens": int(self.tokens.size)}

  def restore(self, state: dict[str, Any]) -> None:
    """Continue from a :meth:`state`; ValueError if it belongs to a different stream."""
    self.position = _checked_position(state, self.state())


def _checked_position(saved: dict[str, Any], mine: dict[str, Any]) -> int:
  for key, value in mine.items():
    if key != "position" and saved.get(key) != value:
      raise DataError(
          f"data: the checkpoint's stream has {key}={saved.get(key)!r} but this run's has {value!r}, so resuming "
          "would not continue the same batches; restore the original data config or start a new workdir"
      )
  return int(saved["position"])


class SyntheticBatches(_Stream):
  """Arithmetic byte sequences for speed runs: row ``i`` is ``(a_i + k * s_i) mod 256``, ``k = 0..seq_len``.

  ``(a_i, s_i)`` come from ``np.random.default_rng((seed, i))`` for stream sequence ``i``, so the
  stream is deterministic and resumable like :class:`WindowBatches`, costs nothing to load,
  and is learnable (the loss falls towards zero once the model has read two tokens).
  """

  kind = "synthetic"

  def __init__(self, seq_len: int, batch_size: int, seed: int, position: int = 0):
    self.seq_len, self.batch_size, self.seed, self.position = seq_len, batch_size, seed, position

  def sequence(self, index: int) -> np.ndarray:
    start, stride = np.random.default_rng((self.seed, index)).integers(NUM_BYTES, size=2)
    return ((start + stride * np.arange(self.seq_len + 1)) % NUM_BYTES).astype(TOKEN_DTYPE)

  def state(self) -> dict[str, Any]:
    return {"kind": self.kind, "position": self.position, "seed": self.seed, "seq_len": self.seq_len}

  def restore(self, state: dict[str, Any]) -> None:
    self.position = _checked_position(state, self.state())


def validation_batches(tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int,
                       advice: str = "raise data.val_fraction or lower batch_size / seq_len") -> list[np.ndarray]:
  """The fixed validation set: the first ``num_batches`` batches of consecutive windows.

  Returns fewer batches when the validation tokens run out (at least one); int32
  ``[batch_size, seq_len + 1]`` each. The same list is used at every evaluation.
  """
  windows = (tokens.size - 1) // seq_len
  if windows < batch_size:
    raise DataError(
        f"data: the validation split has {tokens.size} tokens, fewer than one batch of {batch_size} x "
        f"{seq_len + 1}; {advice}"
    )
  count = min(num_batches, windows // batch_size)
  starts = np.arange(count * batch_size) * seq_len
  rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
  return list(rows.reshape(count, batch_size, seq_len + 1))


@dataclasses.dataclass
class Datasets:
  """What the loop consumes: the training stream and the fixed validation batches."""

  train: WindowBatches | SyntheticBatches
  validation: list[np.ndarray]
  vocab_size: int
  description: str


def load_corpus(data_config) -> Corpus:
  """The corpus named by ``data_config`` (``train.spec.DataSpec``, or ``config.data``: ``source``, ``path``, ...)."""
  source = data_config.source
  paths = [p for p in data_config.path.split(",") if p]
  tokenizer = tokenizer_for(data_config.tokenizer)
  if source == "text":
    suffixes = [s for s in data_config.suffixes.split(",") if s]
    return load_text_corpus(paths, suffixes, data_config.val_fraction, tokenizer)
  if source == "tokens":
    if len(paths) != 1:
      raise DataError("data.source='tokens' needs data.path=<one token file> (see python -m train.data --help)")
    return load_token_corpus(paths[0], data_config.val_path, data_config.val_fraction)
  if source == "hf":
    if not data_config.hf_name:
      raise DataError("data.source='hf' needs data.hf_name, e.g. --config.data.hf_name=roneneldan/TinyStories")
    return load_hf_corpus(
        data_config.hf_name, data_config.hf_config, data_config.hf_split, data_config.hf_text_field,
        data_config.hf_max_docs, data_config.val_fraction, tokenizer,
    )
  raise DataError(f"data.source={source!r}: choose 'text', 'tokens', 'synthetic' or 'hf'")


def _split_advice(corpus: Corpus) -> str:
  """What makes a validation split big enough: a text corpus is split by whole files, so with few files raising
  data.val_fraction may change nothing."""
  if corpus.documents is None:
    return "raise data.val_fraction or lower batch_size / seq_len"
  if corpus.documents < 2:
    return ("a one-file corpus cannot be split (files go whole to train or validation, by a hash of their name): "
            "split the text into several files, or write tokens with python -m train.data OUT FILE --val_fraction 0 "
            "and train with data.source=tokens data.path=OUT.train.bin (its last data.val_fraction of tokens "
            "validates)")
  return (f"files go whole to train or validation (by a hash of their name) and {corpus.documents} files gave this "
          "split: raise data.val_fraction, add files, or lower batch_size / seq_len")


def build(data_config, seq_len: int, batch_size: int, eval_batches: int, seed: int) -> Datasets:
  """Training stream (at position 0) and validation batches for ``data_config`` (``train.spec.DataSpec``)."""
  if data_config.source == "synthetic":
    validation = [SyntheticBatches(seq_len, batch_size, seed + 1).next() for _ in range(max(eval_batches, 1))]
    return Datasets(SyntheticBatches(seq_len, batch_size, seed), validation, NUM_BYTES, "synthetic byte sequences")
  corpus = load_corpus(data_config)
  train = WindowBatches(corpus.train, seq_len, batch_size, seed)
  validation = validation_batches(corpus.validation, seq_len, batch_size, max(eval_batches, 1), _split_advice(corpus))
  description = f"{corpus.description}; {corpus.train.size:,} train / {corpus.validation.size:,} validation tokens"
  return Datasets(train, validation, corpus.vocab_size, description)


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m train.data OUT_PREFIX [PATH ...]``: write OUT_PREFIX.{train,val}.bin token files."""
  import argparse  # noqa: PLC0415

  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument("out_prefix", help="writes <out_prefix>.train.bin and <out_prefix>.val.bin (+ .json)")
  parser.add_argument("paths", nargs="*", help="text files or folders (default: the Python standard library)")
  parser.add_argument("--suffixes", default=",".join(DEFAULT_SUFFIXES), help="file endings searched in folders")
  parser.add_argument("--val_fraction", type=float, default=0.02)
  parser.add_argument("--tokenizer", default="byte", help='"byte" or a tokenizer.json (or a folder holding one)')
  args = parser.parse_args(argv)
  tokenizer = tokenizer_for(args.tokenizer)
  corpus = load_text_corpus(args.paths, args.suffixes.split(","), args.val_fraction, tokenizer)
  for split, tokens in (("train", corpus.train), ("val", corpus.validation)):
    path = write_token_file(f"{args.out_prefix}.{split}.bin", tokens, tokenizer.vocab_size)
    print(f"{path}: {tokens.size:,} tokens")


if __name__ == "__main__":
  raise SystemExit(cli.run(main))
