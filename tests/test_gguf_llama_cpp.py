"""Our GGUF files in llama.cpp itself (``llama_cpp``, llama-cpp-python's bindings, CPU).

Each family (bf16, INT8, FP8, BitNet with sub-norms and tied embeddings) is trained for a few
dozen steps on this repository's own source (a trained model's logits carry signal; a random
init's are noise that any 8-bit rounding reorders), exported with ``train.io.gguf``,
loaded by llama.cpp, and its prompt logits compared with our float32 forward of the same
weights: relative L2 within 5e-3 for F16 / BF16 / TQ2_0 / TQ1_0 and 1e-2 for Q8_0, and the
greedy continuation identical. Tokenizers: llama.cpp must turn a prompt into the ids
``train.data`` gives, for the byte tokenizer and for byte-level BPE ``tokenizer.json`` files.
Skipped when ``llama_cpp`` is not installed (``.ci/run`` installs it from ``../shared/wheels``).
"""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlowbit
from helpers import rel_err
from jaxlowbit import inference
from train import data
from train.io import gguf as gguf_export
from train.io import gguf_tokenizer
from train.model import ModelConfig, Transformer

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("float32_matmuls")

LOGITS_RTOL = {"f16": 5e-3, "bf16": 5e-3, "tq2_0": 5e-3, "tq1_0": 5e-3, "q8_0": 1e-2}
# Rows of 256 values: what TQ1_0 / TQ2_0 blocks need (d_model, heads x head_dim, d_ff).
BASE = ModelConfig(vocab_size=384, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, dtype=jnp.float32,
                   rope_theta=5e5)
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LEN = 60, 8, 64
PROMPT = "def encode(text: str) -> np.ndarray:\n  return"
NEW_TOKENS = 12
N_CTX = 64


def bitnet_config(**overrides) -> ModelConfig:
  return dataclasses.replace(BASE, recipe=jaxlowbit.BitNet(), bitnet_norm_placement="sub", tie_embeddings=True,
                             **overrides)


@functools.cache
def trained(config: ModelConfig) -> dict:
  """``config``'s parameters after :data:`TRAIN_STEPS` AdamW steps on train/data.py's bytes (fixed seed)."""
  tokens = np.asarray(data.encode(pathlib.Path(data.__file__).read_bytes()), np.int32)
  model = Transformer(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  optimizer = optax.adamw(3e-3)

  def loss(p, batch):
    logits = model.apply({"params": p}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  @jax.jit
  def step(p, state, batch):
    grads = jax.grad(loss)(p, batch)
    updates, state = optimizer.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  state, rng = optimizer.init(params), np.random.default_rng(0)
  for _ in range(TRAIN_STEPS):
    starts = rng.integers(0, len(tokens) - TRAIN_LEN - 1, TRAIN_BATCH)
    params, state = step(params, state, jnp.asarray(np.stack([tokens[s : s + TRAIN_LEN + 1] for s in starts])))
  return params


def our_forward(config: ModelConfig, params, weights: str = "master"):
  """``tokens [T] -> logits [T, vocab]`` float32: what the file should compute. BitNet: the ternary
  inference model (``generate --scheme ternary``); INT8 ``weights="int8"``: its int8 forward weights
  (w8a16, float activations); else the high-precision model of the master weights."""
  if gguf_export.architecture(config) == gguf_export.BITNET:
    scheme = "ternary"
  else:
    scheme = "w8a16" if weights == "int8" else None
    config = dataclasses.replace(config, recipe=None)
  model = Transformer(config)
  if scheme is not None:
    params = inference.quantize_params(params, scheme, filter_fqns=())
    model = inference.convert_for_inference(model, scheme)
  apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens[None])[0])
  return lambda tokens: np.asarray(apply(jnp.asarray(tokens, jnp.int32)))


def llama_cpp_logits(llm, tokens: list[int]) -> np.ndarray:
  llm.reset()
  llm.eval(tokens)
  return np.array(llm.scores[: len(tokens)], np.float32)


def greedy(logits_of, prompt: list[int], new: int) -> list[int]:
  """Greedy continuation with a full forward per token over a fixed-length buffer (one compile)."""
  tokens = list(prompt)
  for _ in range(new):
    buffer = np.zeros(N_CTX, np.int32)
    buffer[: len(tokens)] = tokens
    tokens.append(int(np.argmax(logits_of(buffer)[len(tokens) - 1])))
  return tokens[len(prompt) :]


def llama_cpp_greedy(llm, prompt: list[int], new: int) -> list[int]:
  llm.reset()
  llm.eval(prompt)
  out = []
  for _ in range(new):
    out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval([out[-1]])
  return out


@functools.cache
def llama_cpp_knows_relu2() -> bool:
  """Whether this llama.cpp maps the activation name "relu2" (its bitnet graph reads
  ``bitnet.hidden_activation`` only in builds whose activation table has it; 0.3.36's has not)."""
  libraries = (pathlib.Path(llama_cpp.__file__).parent / "lib").glob("libllama*")
  return any(b"relu2\0" in library.read_bytes() for library in libraries if library.is_file())


def load(file) -> "llama_cpp.Llama":
  return llama_cpp.Llama(model_path=str(file), logits_all=True, n_ctx=N_CTX, n_threads=2, verbose=False)


FAMILIES = {
    "bf16": (lambda: BASE, ["f16", "bf16", "q8_0"], "master"),
    "int8": (lambda: dataclasses.replace(BASE, recipe=jaxlowbit.Int8MixedPrecision()), ["f16"], "master"),
    "int8_forward_weights": (lambda: dataclasses.replace(BASE, recipe=jaxlowbit.Int8MixedPrecision()), ["f16"],
                             "int8"),
    "fp8": (lambda: dataclasses.replace(BASE, recipe=jaxlowbit.Float8()), ["q8_0"], "master"),
    "bitnet": (bitnet_config, ["tq2_0", "tq1_0"], "master"),
    "bitnet_relu2_unfused": (lambda: bitnet_config(mlp_activation="relu2", fused_projections=False, scan_layers=False),
                             ["tq2_0"], "master"),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:a relu2 BitNet model needs")  # the test says what this llama.cpp runs
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_runs_our_export_with_our_logits_and_greedy_text(family, tmp_path):
  make_config, qtypes, weights = FAMILIES[family]
  config = make_config()
  # The high-precision families share one trained model: their master weights are what the file
  # holds (an INT8 or FP8 run's recipe only changes its forward, which the export does not keep).
  params = trained(config if gguf_export.architecture(config) == gguf_export.BITNET else BASE)
  runs = config
  if config.mlp_activation == "relu2" and not llama_cpp_knows_relu2():
    # This llama.cpp ignores bitnet.hidden_activation and runs SwiGLU; everything else must still agree.
    runs = dataclasses.replace(config, mlp_activation="silu")
  ours = our_forward(runs, params, weights)
  for qtype in qtypes:
    file = gguf_export.save_gguf(tmp_path / qtype, config, params, qtype, tokenizer="byte", weights=weights)
    llm = load(file)
    if config is not runs:
      assert llm.metadata["bitnet.hidden_activation"] == "relu2"
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
    assert prompt == data.ByteTokenizer().encode_prompt(PROMPT).tolist()
    error = rel_err(llama_cpp_logits(llm, prompt), ours(prompt))
    print(f"{family} {qtype}: relative L2 {error:.2e}" + (" (llama.cpp runs silu)" if config is not runs else ""))
    assert error < LOGITS_RTOL[qtype], (family, qtype, error)
    assert llama_cpp_greedy(llm, prompt, NEW_TOKENS) == greedy(ours, prompt, NEW_TOKENS), (family, qtype)


# ---------------------------------------------------------------------------------------------
# Tokenizers.

TEXTS = ["def main():\n    return 42", "  leading spaces, trailing  ", "café ☕ naïve 日本語 🙂",
         "x=1;y=22;z=333\t\r\n", "<s> is not special in text </s>", ""]


def tiny_llama(vocab_size: int) -> tuple[ModelConfig, dict]:
  config = dataclasses.replace(BASE, vocab_size=vocab_size, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128)
  return config, Transformer(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]


def vocab_only(file) -> "llama_cpp.Llama":
  return llama_cpp.Llama(model_path=str(file), vocab_only=True, verbose=False)


def test_byte_tokenizer_gives_train_datas_ids_in_llama_cpp(tmp_path):
  config, params = tiny_llama(384)
  llm = vocab_only(gguf_export.save_gguf(tmp_path, config, params, "f32", tokenizer="byte"))
  ours = data.ByteTokenizer()
  for text in [*TEXTS, bytes(range(1, 256)).decode("latin-1")]:
    assert llm.tokenize(text.encode(), add_bos=True) == ours.encode_prompt(text).tolist(), text
    assert llm.detokenize(ours.encode_prompt(text).tolist()[1:]) == text.encode()
  assert llm.token_bos() == data.BOS_ID and llm.token_eos() == data.EOS_ID
  assert llm.n_vocab() == 384  # the model's rows beyond the tokenizer's 259 are unused tokens


def bpe_tokenizer(folder: pathlib.Path, style: str) -> pathlib.Path:
  """A byte-level BPE tokenizer.json trained here: GPT-2's implicit split or Llama 3's explicit one, with a BOS."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  tokenizer = tokenizers.Tokenizer(models.BPE())
  if style == "gpt-2":
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    pattern = next(k for k, v in gguf_tokenizer.PRE_TOKENIZERS.items() if v == style)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin|>", "<|end_of_text|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = pathlib.Path(data.__file__).read_text().splitlines()
  tokenizer.train_from_iterator(corpus, trainer)
  tokenizer.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", 0)])
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(folder / "tokenizer.json"))
  return folder / "tokenizer.json"


@pytest.mark.parametrize("style", ["gpt-2", "llama-bpe"])
def test_hf_bpe_tokenizer_gives_train_datas_ids_in_llama_cpp(style, tmp_path):
  path = bpe_tokenizer(tmp_path / "tok", style)
  ours = data.HFTokenizer(path)
  config, params = tiny_llama(416)  # rounded up past the tokenizer's 400
  llm = vocab_only(gguf_export.save_gguf(tmp_path, config, params, "f32", tokenizer=str(path)))
  vocab = gguf_tokenizer.hf_vocab(path, 416)
  assert vocab.pre == style and vocab.bos_id == 0 and vocab.add_bos and vocab.eos_id == 1
  for text in TEXTS:
    assert llm.tokenize(text.encode(), add_bos=True) == ours.encode_prompt(text).tolist(), text
  assert llm.token_bos() == 0 and llm.token_eos() == 1


def test_tokenizer_errors(tmp_path):
  path = bpe_tokenizer(tmp_path / "tok", "gpt-2")
  with pytest.raises(ValueError, match="the tokenizer has id 399 but the model only 300 embedding rows"):
    gguf_tokenizer.hf_vocab(path, 300)
  spec = json.loads(path.read_text())
  spec["pre_tokenizer"]["add_prefix_space"] = True  # llama.cpp's gpt2 tokenizer never adds a space
  path.write_text(json.dumps(spec))
  with pytest.raises(ValueError, match="llama.cpp has no pre-tokenizer known to split text as"):
    gguf_tokenizer.hf_vocab(path, 416)
  assert gguf_tokenizer.hf_vocab(path, 416, pre="gpt-2").pre == "gpt-2"
  with pytest.raises(ValueError, match="the tokenizer has id 258 but the model only 200"):
    gguf_tokenizer.byte_vocab(200)


def test_a_byte_runs_exported_tokenizer_json_gives_the_same_ids_in_llama_cpp(tmp_path):
  """The tokenizer.json a byte-level run's export writes (train/io/byte_tokenizer.py, no merges) goes to GGUF too."""
  from train.io import byte_tokenizer

  path = byte_tokenizer.write(tmp_path / "tok")
  vocab = gguf_tokenizer.hf_vocab(path, 384)
  assert vocab.pre == gguf_tokenizer.BYTE_PRE and vocab.bos_id == data.BOS_ID and vocab.add_bos
  config, params = tiny_llama(384)
  llm = vocab_only(gguf_export.save_gguf(tmp_path, config, params, "f32", tokenizer=str(path)))
  for text in TEXTS:
    assert llm.tokenize(text.encode(), add_bos=True) == data.ByteTokenizer().encode_prompt(text).tolist(), text
