"""A run's tokenizer as GGUF ``tokenizer.ggml.*`` metadata, so llama.cpp tokenizes as ``train.data`` does.

llama.cpp's byte-level BPE tokenizer (``tokenizer.ggml.model = "gpt2"``) splits a prompt with the
regular expression that ``tokenizer.ggml.pre`` names, maps every byte of each piece to one
printable character (GPT-2's byte-to-unicode table, :func:`byte_to_unicode`), merges adjacent
symbols by the rank of their pair in ``tokenizer.ggml.merges`` and looks the result up in
``tokenizer.ggml.tokens``. Two tokenizers reach it here:

- ``"byte"`` (``train.data``: ids 0-255 the bytes, then BOS, EOS, PAD): token ``b`` is byte
  ``b``'s character, so with no merge ever applying every byte becomes its own id. llama.cpp
  refuses a ``gpt2`` vocabulary without a merges array and GGUF has no empty arrays, so the
  file holds one merge of the BOS and EOS names, which can never apply (special tokens are
  matched whole before BPE runs; BPE's symbols are single characters).
- a Hugging Face ``tokenizer.json`` of a byte-level BPE model: its vocabulary, merges and added
  tokens (special ones as CONTROL), its BOS/EOS where ``train.data`` uses them, and the name
  llama.cpp gives its pre-tokenizer (:data:`PRE_TOKENIZERS`, recognised from the file's split
  pattern; pass ``pre=`` for another).

Ids the model has beyond the tokenizer's (``model.vocab_size`` is rounded up) are UNUSED tokens
``<|unused_<id>|>``: llama.cpp needs one token per embedding row.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from train import data

MODEL = "gpt2"  # llama.cpp's byte-level BPE tokenizer
# llama.cpp's token types (gguf.TokenType), written as ints so this module needs no gguf import.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
BYTE_SPECIALS = {data.BOS_ID: "<s>", data.EOS_ID: "</s>", data.PAD_ID: "<pad>"}  # names of train.data's specials
# The split patterns of the byte-level BPE tokenizers llama.cpp knows -> its tokenizer.ggml.pre name
# (llama.cpp's llama-vocab.cpp pre-tokenizer types). GPT-2's pattern is implicit in a ByteLevel
# pre-tokenizer with use_regex=true.
_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
PRE_TOKENIZERS = {
    "<ByteLevel use_regex>": "gpt-2",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}  # fmt: skip
BYTE_PRE = "default"  # any split gives the same ids when every byte is a token and nothing merges


@dataclasses.dataclass(frozen=True)
class Vocab:
  """What GGUF's ``tokenizer.ggml.*`` keys hold.

  Attributes:
    tokens: one string per id (``len == model vocab_size``).
    types: one llama.cpp token type per id.
    merges: ``"left right"`` pairs, by rank.
    pre: llama.cpp's pre-tokenizer name.
    bos_id, eos_id, pad_id: special ids (None: none).
    add_bos, add_eos: whether a prompt gets BOS / EOS (as ``train.data``'s ``encode_prompt``).
  """

  tokens: tuple[str, ...]
  types: tuple[int, ...]
  merges: tuple[str, ...]
  pre: str
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  add_bos: bool
  add_eos: bool = False


def byte_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> character table: printable Latin-1 bytes are themselves, the other 68 map to
  U+0100 onwards in byte order (what llama.cpp's ``gpt2`` tokenizer expects tokens to be written in)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  table, extra = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def _padded(tokens: dict[int, tuple[str, int]], vocab_size: int, who: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Tokens and types of ids ``0 .. vocab_size - 1``, ids the tokenizer lacks as UNUSED."""
  if tokens and max(tokens) >= vocab_size:
    raise ValueError(f"{who}: the tokenizer has id {max(tokens)} but the model only {vocab_size} embedding rows; "
                     "train with model.vocab_size >= the tokenizer's size")
  names = [tokens.get(i, (f"<|unused_{i}|>", UNUSED)) for i in range(vocab_size)]
  return tuple(name for name, _ in names), tuple(kind for _, kind in names)


def byte_vocab(vocab_size: int = data.VOCAB_SIZE) -> Vocab:
  """``train.data``'s byte tokenizer for a model with ``vocab_size`` embedding rows (>= 259)."""
  chars = byte_to_unicode()
  tokens = {b: (chars[b], NORMAL) for b in range(data.NUM_BYTES)}
  tokens |= {i: (name, CONTROL) for i, name in BYTE_SPECIALS.items()}
  names, types = _padded(tokens, vocab_size, "byte_vocab")
  unreachable_merge = f"{BYTE_SPECIALS[data.BOS_ID]} {BYTE_SPECIALS[data.EOS_ID]}"
  return Vocab(names, types, (unreachable_merge,), BYTE_PRE, data.BOS_ID, data.EOS_ID, data.PAD_ID, add_bos=True)


def _pre_tokenizer_key(pre_tokenizer: dict | None) -> str | None:
  """The split pattern of a tokenizer.json pre-tokenizer (``<ByteLevel use_regex>`` for GPT-2's implicit one)."""
  if not pre_tokenizer:
    return None
  kind = pre_tokenizer.get("type")
  if kind == "ByteLevel":
    if pre_tokenizer.get("add_prefix_space"):
      return "<ByteLevel add_prefix_space>"
    return "<ByteLevel use_regex>" if pre_tokenizer.get("use_regex", True) else None
  if kind == "Split":
    return (pre_tokenizer.get("pattern") or {}).get("Regex")
  if kind == "Sequence":
    keys = [_pre_tokenizer_key(p) for p in pre_tokenizer.get("pretokenizers", [])]
    splits = [k for k in keys if k is not None]
    return splits[0] if len(splits) == 1 else repr(splits)
  return f"<{kind}>"


def hf_vocab(path: str | pathlib.Path, vocab_size: int, pre: str | None = None) -> Vocab:
  """A byte-level BPE ``tokenizer.json`` (or a folder holding one) for a model with ``vocab_size`` rows.

  Args:
    path: the file or its folder.
    vocab_size: the model's embedding rows (>= the tokenizer's ids).
    pre: llama.cpp's pre-tokenizer name; None: recognised from the file (:data:`PRE_TOKENIZERS`).

  Raises:
    ValueError: not a byte-level BPE model, a pre-tokenizer llama.cpp would split differently
      (and no ``pre``), or more ids than embedding rows.
  """
  tokenizer = data.HFTokenizer(path)
  spec = json.loads(pathlib.Path(tokenizer.name).read_text())
  model = spec.get("model") or {}
  if model.get("type") != "BPE" or not _is_byte_level(spec):
    raise ValueError(f"{tokenizer.name}: only byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 style) go to GGUF's "
                     f"'{MODEL}' tokenizer; this one is {model.get('type')!r} with decoder "
                     f"{(spec.get('decoder') or {}).get('type')!r}")
  tokens = {int(i): (name, NORMAL) for name, i in model["vocab"].items()}
  for added in spec.get("added_tokens", []):
    tokens[int(added["id"])] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
  names, types = _padded(tokens, vocab_size, "hf_vocab")
  merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model.get("merges", []))
  bos_id, add_bos = _added_first(tokenizer)
  if not merges:  # every byte its own token (byte_tokenizer.py's file): any split gives the same ids
    multi = [name for name, _ in tokens.values() if len(name) > 1]
    if len(multi) < 2:
      raise ValueError(f"{tokenizer.name}: a BPE tokenizer without merges and without two multi-character tokens "
                       "for the unreachable merge GGUF needs")
    return Vocab(names, types, (f"{multi[0]} {multi[1]}",), pre or BYTE_PRE, bos_id, tokenizer.eos_id, None, add_bos)
  if pre is None:
    key = _pre_tokenizer_key(spec.get("pre_tokenizer"))
    if key not in PRE_TOKENIZERS:
      raise ValueError(f"{tokenizer.name}: llama.cpp has no pre-tokenizer known to split text as this file's "
                       f"({key!r}) does; pass pre=<llama.cpp tokenizer.ggml.pre name> if you know it "
                       f"(recognised: {', '.join(sorted(set(PRE_TOKENIZERS.values())))})")
    pre = PRE_TOKENIZERS[key]
  return Vocab(names, types, merges, pre, bos_id, tokenizer.eos_id, None, add_bos)


def _is_byte_level(spec: dict) -> bool:
  decoder = spec.get("decoder") or {}
  parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
  return any(part.get("type") == "ByteLevel" for part in parts)


def _added_first(tokenizer: data.HFTokenizer) -> tuple[int | None, bool]:
  """``(BOS id, whether encoding a prompt adds it)``, from what the file's post-processor does to one."""
  probe = "a"
  plain = tokenizer.tokenizer.encode(probe, add_special_tokens=False).ids
  full = tokenizer.tokenizer.encode(probe, add_special_tokens=True).ids
  if len(full) > len(plain) and full[1:] == plain:
    return full[0], True
  return None, False


def vocab_for(name: str, vocab_size: int, pre: str | None = None) -> Vocab:
  """``"byte"`` (or ``""``) or a ``tokenizer.json`` path, as ``config.data.tokenizer`` names it."""
  return byte_vocab(vocab_size) if name in ("", "byte") else hf_vocab(name, vocab_size, pre)


def add_to(writer, vocab: Vocab) -> None:
  """Write ``vocab`` into a ``gguf.GGUFWriter``."""
  writer.add_tokenizer_model(MODEL)
  writer.add_tokenizer_pre(vocab.pre)
  writer.add_token_list(list(vocab.tokens))
  writer.add_token_types(list(vocab.types))
  writer.add_token_merges(list(vocab.merges))
  for setter, value in ((writer.add_bos_token_id, vocab.bos_id), (writer.add_eos_token_id, vocab.eos_id),
                        (writer.add_pad_token_id, vocab.pad_id)):
    if value is not None:
      setter(value)
  writer.add_add_bos_token(vocab.add_bos)
  writer.add_add_eos_token(vocab.add_eos)


__all__ = ["BYTE_SPECIALS", "MODEL", "PRE_TOKENIZERS", "Vocab", "add_to", "byte_to_unicode", "byte_vocab", "hf_vocab",
           "vocab_for"]
