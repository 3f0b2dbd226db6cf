"""``train.data``'s byte tokenizer as a Hugging Face ``tokenizer.json``, so an export carries its tokenizer.

The file is a byte-level BPE model without merges: token ``b`` (ids 0-255) is byte ``b`` written
as GPT-2's byte character (``gguf_tokenizer.byte_to_unicode``), then ``<s>`` (BOS, 256), ``</s>``
(EOS, 257) and ``<pad>`` (258); its post-processor puts BOS first. So
``tokenizers``, ``transformers`` (``PreTrainedTokenizerFast``) and ``train.data.HFTokenizer``
reading it give exactly ``train.data``'s ids: ``[BOS] + UTF-8 bytes`` for a prompt, plus EOS for a
document.
"""

from __future__ import annotations

import json
import pathlib

from train import data
from train.io.gguf_tokenizer import BYTE_SPECIALS, byte_to_unicode

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def write(folder: str | pathlib.Path) -> pathlib.Path:
  """Write the byte tokenizer's ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``; returns the first."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415

  chars = byte_to_unicode()
  # The specials are plain vocabulary entries, not added tokens: tokenizers would match an added
  # "<s>" inside text, where train.data reads three bytes (and nothing merges bytes into "<s>").
  vocab = {chars[b]: b for b in range(data.NUM_BYTES)} | {name: i for i, name in BYTE_SPECIALS.items()}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  bos = BYTE_SPECIALS[data.BOS_ID]
  tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, data.BOS_ID)])
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(folder / TOKENIZER_FILE))
  (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": BYTE_SPECIALS[data.EOS_ID],
      "pad_token": BYTE_SPECIALS[data.PAD_ID], "add_bos_token": True, "clean_up_tokenization_spaces": False,
  }, indent=2))  # fmt: skip
  return folder / TOKENIZER_FILE


__all__ = ["TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE", "write"]
