"""train.hf.save_gguf / train.io.gguf_ternary: a BitNet model as llama.cpp's TQ1_0 / TQ2_0 GGUF.

Every check reads the file back with llama.cpp's own Python package (``gguf.GGUFReader`` and
``gguf.quants.dequantize``), never with our code: the ternary values and scales it decodes must
be bit for bit those ``jaxlowbit.inference`` runs, and an independent float64 numpy forward of
the graph the file describes (read from the file alone) must give the converted model's logits.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowbit
from helpers import fresh_key, rel_err
from jaxlowbit import inference
from jaxlowbit_numerics import ternary
from train import hf
from train.io import gguf_ternary
from train.io.hf_config import _columns
from train.model import ModelConfig, Transformer

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GGML  # noqa: E402

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # logits against float64 references, also on a GPU

QTYPES = {"tq1_0": GGML.TQ1_0, "tq2_0": GGML.TQ2_0}
# A BitNet model whose projections' input widths (d_model, heads x head_dim, d_ff) are 256-multiples.
CONFIG = ModelConfig(vocab_size=97, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512,
                     recipe=jaxlowbit.BitNet(), dtype=jnp.float32, rope_theta=5e5)
# Our float64 forward of the file against the jaxlowbit model in float32: 3e-7 (8 seeds), unless
# an activation lands on an int8 rounding tie in one and not the other, which moves that token
# and the later ones of its sequence (6e-3 in 1 of 8 seeds). llama.cpp's bitnet graph, without
# the norms before q/k/v and gate/up, is 0.55-0.65 away from the model (8 seeds).
LOGITS_RTOL = 3e-2


def random_params(config: ModelConfig, key: jax.Array) -> dict:
  """The init with every value scaled by 1 +- 0.3 at random (norm scales too), so no tensor can pass for another."""
  params = Transformer(config).init(key, jnp.zeros((1, 8), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
  return jax.tree.unflatten(tree, [x * (1 + 0.3 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])


def read(file) -> tuple[dict[str, np.ndarray], dict[str, GGML], dict]:
  """``(float32 tensors in numpy order, their types, metadata)`` through llama.cpp's gguf-py only."""
  reader = gguf.GGUFReader(file)
  tensors = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
  types = {t.name: t.tensor_type for t in reader.tensors}
  meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
  return tensors, types, meta


# ---------------------------------------------------------------------------------------------
# The block formats.


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_blocks_decode_exactly_with_ggufs_reader(qtype):
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  codes = rng.integers(-1, 2, (243, 3 * 256)).astype(np.int8)
  # Every base-3 digit group of a block takes every value once: all 243 five-code bytes, all 81 four-code ones.
  digits = (np.arange(243)[:, None] // 3 ** np.arange(4, -1, -1)) % 3 - 1  # [243, 5], most significant first
  codes[:, [0, 32, 64, 96, 128]] = digits
  codes[:, [160, 176, 192, 208, 224]] = digits
  codes[:, [240, 244, 248, 252]] = digits[:, 1:]
  blocks = gguf_ternary.encode(codes, qtype)
  assert blocks.dtype == np.uint8 and blocks.shape == (243, 3 * gguf_ternary.BLOCK_BYTES[qtype])
  np.testing.assert_array_equal(gguf.quants.dequantize(blocks, QTYPES[qtype]), codes.astype(np.float32))
  # gguf-py's own quantizer (block scale = the block's max |value|: 1 here) writes the same bytes.
  np.testing.assert_array_equal(gguf.quants.quantize(codes.astype(np.float32), QTYPES[qtype]), blocks)
  scaled = gguf_ternary.encode(codes[:2], qtype, block_scale=0.3)
  np.testing.assert_array_equal(gguf.quants.dequantize(scaled, QTYPES[qtype]), codes[:2] * np.float32(np.float16(0.3)))

  with pytest.raises(ValueError, match="not a multiple of the 256-value block"):
    gguf_ternary.encode(codes[:, :100], qtype)
  with pytest.raises(ValueError, match="must lie in"):
    gguf_ternary.encode(2 * codes, qtype)


# ---------------------------------------------------------------------------------------------
# The model.


def qparams_of(config: ModelConfig, params) -> dict:
  """What jaxlowbit.inference runs for a BitNet model (generate --scheme ternary): LM head high precision."""
  return inference.quantize_params(params, "ternary")


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("layout", [dict(), dict(scan_layers=False, fused_projections=False, tie_embeddings=True,
                                                rope_scaling=(8.0, 1.0, 4.0, 16.0))],
                         ids=["scan_fused", "unrolled_unfused_tied_llama3rope"])
def test_gguf_holds_exactly_the_weights_jaxlowbit_inference_runs(qtype, layout, tmp_path):
  config = dataclasses.replace(CONFIG, **layout)
  params = random_params(config, fresh_key())
  file = hf.save_gguf(tmp_path, config, params, qtype)
  tensors, types, meta = read(file)
  assert meta["general.architecture"] == hf.GGUF_ARCHITECTURE and meta["general.file_type"] == getattr(
      gguf.LlamaFileType, f"MOSTLY_{qtype.upper()}")
  arch = hf.GGUF_ARCHITECTURE
  assert meta[f"{arch}.block_count"] == 2 and meta[f"{arch}.attention.head_count_kv"] == 2
  assert meta[f"{arch}.rope.freq_base"] == 5e5 and meta[f"{arch}.feed_forward_length"] == 512

  qparams = qparams_of(config, params)
  fused = config.fused_projections
  projections = {"attn_q": ("attn/qkv", "q") if fused else ("attn/q", None),
                 "attn_k": ("attn/qkv", "k") if fused else ("attn/k", None),
                 "attn_v": ("attn/qkv", "v") if fused else ("attn/v", None),
                 "attn_output": ("attn/out", None),
                 "ffn_gate": ("mlp/gate_up", "gate") if fused else ("mlp/gate", None),
                 "ffn_up": ("mlp/gate_up", "up") if fused else ("mlp/up", None), "ffn_down": ("mlp/down", None)}
  for i in range(config.n_layers):
    layer = jax.tree.map(lambda x, i=i: x[i], qparams["layers"]) if config.scan_layers else qparams[f"layers_{i}"]
    for stem, (path, part) in projections.items():
      leaves = layer
      for key in path.split("/"):
        leaves = leaves[key]
      runs = np.asarray(inference.dequantize_weight(leaves, "ternary")).T  # [out, in] float32: what inference runs
      codes = np.asarray(ternary.unpack_2bit(leaves["kernel_packed"], axis=-1))
      rows = _columns(config, part) if part else slice(None)
      name = f"blk.{i}.{stem}"
      assert types[f"{name}.weight"] == QTYPES[qtype]
      np.testing.assert_array_equal(tensors[f"{name}.weight"], codes[rows])  # block scale 1.0: the codes themselves
      np.testing.assert_array_equal(tensors[f"{name}.scale"], np.reshape(leaves["kernel_scale"], (1,)))
      np.testing.assert_array_equal(tensors[f"{name}.weight"] * tensors[f"{name}.scale"], runs[rows])
  # The high-precision tensors are the parameters themselves (float32 export).
  np.testing.assert_array_equal(tensors["token_embd.weight"], params["embed"]["embedding"])
  assert ("output.weight" in tensors) == (not config.tie_embeddings)
  if not config.tie_embeddings:
    np.testing.assert_array_equal(tensors["output.weight"], np.asarray(params["lm_head"]["kernel"]).T)
  norms = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_sub_norm": "attn/out_norm",
           "ffn_sub_norm": "mlp/down_norm"}
  norms |= {"attn_qkv_in_norm": "attn/qkv_norm", "ffn_gate_up_in_norm": "mlp/gate_up_norm"} if fused else {
      "attn_q_in_norm": "attn/q_norm", "ffn_up_in_norm": "mlp/up_norm"}
  layer1 = jax.tree.map(lambda x: x[1], params["layers"]) if config.scan_layers else params["layers_1"]
  for stem, path in norms.items():
    node = layer1
    for key in path.split("/"):
      node = node[key]
    np.testing.assert_array_equal(tensors[f"blk.1.{stem}.weight"], node["scale"])
  if config.rope_scaling:  # llama.cpp's rope_freqs: the divisor of each frequency (Llama 3's rule, in numpy)
    factor, low, high, original = config.rope_scaling
    wavelength = 2 * np.pi * config.rope_theta ** (np.arange(0, 64, 2) / 64)
    smooth = np.clip((original / wavelength - low) / (high - low), 0, 1)
    np.testing.assert_allclose(tensors["rope_freqs.weight"], 1 / ((1 - smooth) / factor + smooth), rtol=1e-6)
    assert np.isclose(tensors["rope_freqs.weight"].max(), factor, rtol=1e-6)  # low frequencies divided by factor
    assert tensors["rope_freqs.weight"].min() < 2  # and the blend band
  per_layer = 4 + 7 * 2 + (2 if fused else 5)  # norms, projections + scales, the extra BitNet norms
  top = 2 + (not config.tie_embeddings) + bool(config.rope_scaling)
  assert len(tensors) == top + 2 * per_layer


def reference_logits(file, tokens: np.ndarray, in_norms: bool = True) -> np.ndarray:
  """The graph the GGUF file describes (its metadata and tensors only), in float64 numpy.

  ``in_norms=False`` skips the ``*_in_norm`` tensors: llama.cpp's ``bitnet`` graph.
  """
  t, _, meta = read(file)
  t = {k: v.astype(np.float64) for k, v in t.items()}
  arch = meta["general.architecture"]
  heads, kv_heads = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
  eps, theta = meta[f"{arch}.attention.layer_norm_rms_epsilon"], meta[f"{arch}.rope.freq_base"]
  hd = meta[f"{arch}.embedding_length"] // heads
  b, seq = tokens.shape

  def norm(x, name):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * t[name]

  def before(x, p, stem, fused_stem):
    """The BitNet norm the file has before projection ``stem`` (its own, or its fused group's)."""
    for name in (f"{p}{stem}_in_norm.weight", f"{p}{fused_stem}_in_norm.weight"):
      if in_norms and name in t:
        return norm(x, name)
    return x

  def linear(x, name):
    """Ternary matmul with int8 per-token activations (BitNet); float weights as they are."""
    if f"{name}.scale" not in t:
      return x @ t[f"{name}.weight"].T
    s = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5) / 127
    q = np.clip(np.round(x / s), -127, 127)  # numpy rounds half to even, like jnp.round
    return (q @ t[f"{name}.weight"].T) * s * t[f"{name}.scale"]

  inv_freq = theta ** (-np.arange(0, hd, 2) / hd)
  angles = np.arange(seq)[:, None] * inv_freq[None]
  cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

  def rope(x):  # NEOX / rotate-half
    return x * cos + np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

  x = t["token_embd.weight"][tokens]
  causal = np.triu(np.full((seq, seq), -np.inf), 1)
  for i in range(meta[f"{arch}.block_count"]):
    p = f"blk.{i}."
    h = norm(x, p + "attn_norm.weight")
    q, k, v = (linear(before(h, p, f"attn_{z}", "attn_qkv"), p + f"attn_{z}") for z in "qkv")
    q = rope(q.reshape(b, seq, heads, hd).transpose(0, 2, 1, 3))
    k = rope(k.reshape(b, seq, kv_heads, hd).transpose(0, 2, 1, 3))
    v = v.reshape(b, seq, kv_heads, hd).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + causal
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    attn = (probs / probs.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(b, seq, heads * hd)
    x = x + linear(norm(attn, p + "attn_sub_norm.weight"), p + "attn_output")
    h = norm(x, p + "ffn_norm.weight")
    gate, up = (linear(before(h, p, f"ffn_{z}", "ffn_gate_up"), p + f"ffn_{z}") for z in ("gate", "up"))
    x = x + linear(norm(gate / (1 + np.exp(-gate)) * up, p + "ffn_sub_norm.weight"), p + "ffn_down")
  x = norm(x, "output_norm.weight")
  return x @ t.get("output.weight", t["token_embd.weight"]).T


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_the_files_graph_gives_the_converted_models_logits(qtype, tmp_path):
  params = random_params(CONFIG, fresh_key())
  file = hf.save_gguf(tmp_path, CONFIG, params, qtype)
  tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 24))
  model = inference.convert_for_inference(Transformer(CONFIG), "ternary")
  ours = model.apply({"params": qparams_of(CONFIG, params)}, jnp.asarray(tokens))
  assert rel_err(ours, reference_logits(file, tokens)) < LOGITS_RTOL
  # llama.cpp's bitnet graph (no norm between attn_norm/ffn_norm and the projections) is another model.
  assert rel_err(ours, reference_logits(file, tokens, in_norms=False)) > 10 * LOGITS_RTOL


def test_clear_errors(tmp_path, monkeypatch):
  params = Transformer(CONFIG).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  int8 = dataclasses.replace(CONFIG, recipe=jaxlowbit.Int8MixedPrecision())
  with pytest.raises(ValueError, match="no BitNet projection.*save_pretrained"):
    hf.save_gguf(tmp_path, int8, params)
  odd = dataclasses.replace(CONFIG, d_ff=384)
  with pytest.raises(ValueError, match="layers.mlp.down has 384 input features, not a multiple of tq2_0's 256"):
    hf.save_gguf(tmp_path, odd, params)
  with pytest.raises(ValueError, match="scheme must be one of"):
    hf.save_gguf(tmp_path, CONFIG, params, "q4_0")
  with pytest.raises(ValueError, match="dtype must be one of"):
    hf.save_gguf(tmp_path, CONFIG, params, dtype=jnp.int8)
  with pytest.raises(ValueError, match="save_pretrained: a BitNet model.*--scheme tq2_0"):
    hf.save_pretrained(tmp_path, CONFIG, params)
  monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
  with pytest.raises(ImportError, match="pip install gguf"):
    hf.save_gguf(tmp_path, CONFIG, params)
  assert not (tmp_path / hf.GGUF_FILE).exists()


def test_export_command_writes_a_runs_gguf(tmp_path, capsys):
  """``python -m train.hf export --scheme tq2_0`` on a BitNet run: its checkpoint's inference codes, bf16 embedding."""
  from test_train_loop import micro_config

  from train import loop, runs

  config = micro_config("", recipe="bitnet", steps=2, checkpoint_every=2, eval_every=100, data__source="synthetic",
                        model__d_model=256, model__n_heads=4, model__n_kv_heads=2, model__d_ff=256, seq_len=16)
  assert loop.train(config, tmp_path / "run").status == "completed"
  out = tmp_path / "gguf"
  assert hf.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--scheme", "tq2_0"]) == 0
  assert "model.gguf" in capsys.readouterr().out
  tensors, types, meta = read(out / hf.GGUF_FILE)
  assert meta["jaxlowbit.tokenizer"].startswith("byte") and types["token_embd.weight"] == GGML.BF16
  _, model_config, params, _ = runs.load_run(tmp_path / "run")
  leaves = qparams_of(model_config, params)["layers"]["mlp"]["down"]
  np.testing.assert_array_equal(tensors["blk.0.ffn_down.weight"],
                                np.asarray(ternary.unpack_2bit(leaves["kernel_packed"][0], axis=-1)))
  np.testing.assert_array_equal(tensors["blk.0.ffn_down.scale"], np.reshape(leaves["kernel_scale"][0], (1,)))

  assert hf.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
  assert "--scheme tq2_0" in capsys.readouterr().err
