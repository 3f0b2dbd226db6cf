"""train.io.gguf / gguf_ternary: models as GGUF files for llama.cpp, read back with llama.cpp's gguf-py.

Every check reads the file with llama.cpp's own Python package (``gguf.GGUFReader`` and
``gguf.quants.dequantize``), never with our code: a BitNet file's ternary values and scales must
be bit for bit those ``jaxlowbit.inference`` runs, its tensor names exactly those llama.cpp's
``bitnet`` graph loads, and an independent float64 numpy forward of that graph (read from the file
alone) must give the converted model's logits; a ``llama`` file holds the master weights with q/k
rows in llama.cpp's RoPE order. llama.cpp itself runs the files in tests/test_gguf_llama_cpp.py.
"""

import dataclasses
import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowbit
import bitnet_reference
from helpers import fresh_key, rel_err
from jaxlowbit import inference
from jaxlowbit_numerics import ternary
from train import checkpoint, cli, data, hf
from train.io import gguf as gguf_io
from train.io import gguf_ternary
from train.io.hf_config import _columns
from train.model import ModelConfig, Transformer

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GGML  # noqa: E402

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # logits against float64 references, also on a GPU

QTYPES = {"tq1_0": GGML.TQ1_0, "tq2_0": GGML.TQ2_0}
# A BitNet b1.58 model as published (sub-norms, tied head) whose projections' input widths
# (d_model, heads x head_dim, d_ff) are 256-multiples.
BASE = ModelConfig(vocab_size=384, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, dtype=jnp.float32,
                   rope_theta=5e5)
CONFIG = dataclasses.replace(BASE, recipe=jaxlowbit.BitNet(), tie_embeddings=True, bitnet_norm_placement="sub")
# Our float64 forward of the file against the jaxlowbit model in float32: 3e-7 (8 seeds), unless
# an activation lands on an int8 rounding tie in one and not the other, which moves that token
# and the later ones of its sequence (6e-3 in 1 of 8 seeds).
LOGITS_RTOL = 3e-2
# llama.cpp's bitnet graph: exactly these tensors (token_embd is also the output head).
BITNET_TOP = {"token_embd.weight", "output_norm.weight"}
BITNET_LAYER = {"attn_norm.weight", "attn_sub_norm.weight", "ffn_norm.weight", "ffn_sub_norm.weight"} | {
    f"{stem}.{kind}" for stem in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for kind in ("weight", "scale")}


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


def layer_of(tree, config: ModelConfig, i: int):
  return jax.tree.map(lambda x: x[i], tree["layers"]) if config.scan_layers else tree[f"layers_{i}"]


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
# BitNet: llama.cpp's bitnet graph.


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("layout", [dict(), dict(scan_layers=False, fused_projections=False, mlp_activation="relu2")],
                         ids=["scan_fused", "unrolled_unfused_relu2"])
def test_bitnet_file_holds_exactly_the_weights_jaxlowbit_inference_runs(qtype, layout, tmp_path):
  config = dataclasses.replace(CONFIG, **layout)
  params = random_params(config, fresh_key())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    file = gguf_io.save_gguf(tmp_path, config, params, qtype, embedding_qtype="f32")
  assert any("relu2" in str(w.message) for w in caught) == bool(layout)  # older llama.cpp runs silu instead
  tensors, types, meta = read(file)
  assert meta["general.architecture"] == "bitnet" and meta["general.file_type"] == getattr(
      gguf.LlamaFileType, f"MOSTLY_{qtype.upper()}")
  assert meta["bitnet.block_count"] == 2 and meta["bitnet.attention.head_count_kv"] == 2
  assert meta["bitnet.rope.freq_base"] == 5e5 and meta["bitnet.feed_forward_length"] == 512
  assert meta.get("bitnet.hidden_activation") == ("relu2" if layout else None)
  assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.bos_token_id"] == data.BOS_ID
  assert set(tensors) == BITNET_TOP | {f"blk.{i}.{name}" for i in range(2) for name in BITNET_LAYER}

  qparams = inference.quantize_params(params, "ternary")
  fused = config.fused_projections
  projections = {"attn_q": ("attn/qkv", "q") if fused else ("attn/q", None),
                 "attn_k": ("attn/qkv", "k") if fused else ("attn/k", None),
                 "attn_v": ("attn/qkv", "v") if fused else ("attn/v", None),
                 "attn_output": ("attn/out", None),
                 "ffn_gate": ("mlp/gate_up", "gate") if fused else ("mlp/gate", None),
                 "ffn_up": ("mlp/gate_up", "up") if fused else ("mlp/up", None), "ffn_down": ("mlp/down", None)}
  for i in range(config.n_layers):
    layer = layer_of(qparams, config, i)
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
  np.testing.assert_array_equal(tensors["token_embd.weight"], params["embed"]["embedding"])
  layer1 = layer_of(params, config, 1)
  for stem, (module, norm) in {"attn_norm": ("attn_norm", None), "ffn_norm": ("mlp_norm", None),
                               "attn_sub_norm": ("attn", "out_norm"), "ffn_sub_norm": ("mlp", "down_norm")}.items():
    node = layer1[module] if norm is None else layer1[module][norm]
    np.testing.assert_array_equal(tensors[f"blk.1.{stem}.weight"], node["scale"])


# Where llama.cpp's bitnet graph finds each tensor of block i (tests/bitnet_reference.py's roles).
GGUF_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight", "attn_sub_norm": "blk.{i}.attn_sub_norm.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight", "ffn_sub_norm": "blk.{i}.ffn_sub_norm.weight",
    "q": "blk.{i}.attn_q", "k": "blk.{i}.attn_k", "v": "blk.{i}.attn_v", "o": "blk.{i}.attn_output",
    "gate": "blk.{i}.ffn_gate", "up": "blk.{i}.ffn_up", "down": "blk.{i}.ffn_down",
}


def reference_logits(file, tokens: np.ndarray) -> np.ndarray:
  """llama.cpp's bitnet graph of a GGUF file (its metadata and tensors only), in float64 numpy."""
  t, _, meta = read(file)
  t = {k: v.astype(np.float64) for k, v in t.items()}
  heads = meta["bitnet.attention.head_count"]

  def linear(x, name):
    """Ternary matmul with int8 per-token activations (BitNet)."""
    s = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5) / 127
    q = np.clip(np.round(x / s), -127, 127)  # numpy rounds half to even, like jnp.round
    return (q @ t[f"{name}.weight"].T) * s * t[f"{name}.scale"]

  shape = bitnet_reference.Shape(heads, meta["bitnet.attention.head_count_kv"],
                                 meta["bitnet.embedding_length"] // heads,
                                 meta["bitnet.attention.layer_norm_rms_epsilon"], meta["bitnet.rope.freq_base"],
                                 meta.get("bitnet.hidden_activation", "silu"))
  embedding = t["token_embd.weight"]  # also the bitnet graph's head
  return bitnet_reference.bitnet_logits(
      tokens, embedding=embedding, head=embedding, final_norm=t["output_norm.weight"],
      n_layers=meta["bitnet.block_count"], names=GGUF_NAMES, norm_weight=t.__getitem__, linear=linear, shape=shape)


@pytest.mark.filterwarnings("ignore:a relu2 BitNet model needs")
@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_the_bitnet_files_graph_gives_the_converted_models_logits(activation, tmp_path):
  config = dataclasses.replace(CONFIG, mlp_activation=activation)
  params = random_params(config, fresh_key())
  file = gguf_io.save_gguf(tmp_path, config, params, "tq1_0", embedding_qtype="f32")
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 24))
  model = inference.convert_for_inference(Transformer(config), "ternary")
  ours = model.apply({"params": inference.quantize_params(params, "ternary")}, jnp.asarray(tokens))
  assert rel_err(ours, reference_logits(file, tokens)) < LOGITS_RTOL


# ---------------------------------------------------------------------------------------------
# Everything else: llama.cpp's llama graph.


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16", "q8_0"])
def test_llama_file_holds_the_master_weights_with_q_k_rows_in_llama_cpp_rope_order(qtype, tmp_path):
  config = dataclasses.replace(BASE, recipe=jaxlowbit.Int8MixedPrecision(), attention_bias=True,
                               rope_scaling=(8.0, 1.0, 4.0, 16.0))
  params = random_params(config, fresh_key())
  tensors, types, meta = read(gguf_io.save_gguf(tmp_path / "a.gguf", config, params, qtype))
  assert meta["general.architecture"] == "llama" and types["blk.0.attn_q.weight"] == GGML[qtype.upper()]
  assert types["blk.0.attn_norm.weight"] == GGML.F32 and "output.weight" in tensors
  tolerance = {"f32": 0, "f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2}[qtype]
  layer = layer_of(params, config, 1)
  hd, q, kv = config.head_dim, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
  qkv, bias = np.asarray(layer["attn"]["qkv"]["kernel"]).T, np.asarray(layer["attn"]["qkv"]["bias"])
  for stem, rows in {"attn_q": slice(0, q), "attn_k": slice(q, q + kv)}.items():
    got = tensors[f"blk.1.{stem}.weight"].reshape(-1, hd // 2, 2, config.d_model)
    want = qkv[rows].reshape(-1, 2, hd // 2, config.d_model).transpose(0, 2, 1, 3)  # halves -> adjacent pairs
    assert rel_err(got, want) <= tolerance
    np.testing.assert_array_equal(tensors[f"blk.1.{stem}.bias"].reshape(-1, hd // 2, 2),
                                  bias[rows].reshape(-1, 2, hd // 2).transpose(0, 2, 1))
  assert rel_err(tensors["blk.1.attn_v.weight"], qkv[q + kv :]) <= tolerance  # v keeps its order
  assert rel_err(tensors["blk.1.ffn_down.weight"], np.asarray(layer["mlp"]["down"]["kernel"]).T) <= tolerance
  assert rel_err(tensors["output.weight"], np.asarray(params["lm_head"]["kernel"]).T) <= tolerance
  assert "rope_freqs.weight" in tensors

  # An INT8 run's forward weights instead: int8 per output channel, as jaxlowbit.inference's w8a16.
  tensors, _, _ = read(gguf_io.save_gguf(tmp_path / "b.gguf", config, params, "f32", weights="int8"))
  int8 = layer_of(inference.quantize_params(params, "w8a16"), config, 1)["mlp"]["down"]
  np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"],
                                np.asarray(inference.dequantize_weight(int8, "w8a16")).T)


def test_clear_errors(tmp_path, monkeypatch):
  params = Transformer(BASE).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  with pytest.raises(ValueError, match="tq2_0 stores BitNet ternary weights, and this model has no BitNet"):
    gguf_io.save_gguf(tmp_path, BASE, params, "tq2_0")
  with pytest.raises(ValueError, match="qtype must be one of"):
    gguf_io.save_gguf(tmp_path, BASE, params, "q4_0")
  with pytest.raises(ValueError, match="weights='int8' gives an INT8-trained run's forward weights"):
    gguf_io.save_gguf(tmp_path, BASE, params, weights="int8")
  odd = dataclasses.replace(BASE, d_ff=48)
  with pytest.raises(ValueError, match="layers.mlp.down has rows of 48 values, not a multiple of Q8_0's 32"):
    gguf_io.save_gguf(tmp_path, odd, params, "q8_0")
  bitnet = dataclasses.replace(BASE, recipe=jaxlowbit.BitNet())  # every_projection norms, untied head
  with pytest.raises(ValueError, match="bitnet_norm_placement=sub"):
    gguf_io.save_gguf(tmp_path, bitnet, params)
  with pytest.raises(ValueError, match="always takes the output head from token_embd.*tie_embeddings=true"):
    gguf_io.save_gguf(tmp_path, dataclasses.replace(CONFIG, tie_embeddings=False), params)
  with pytest.raises(ValueError, match="layers.mlp.down has 384 input features, not a multiple of tq2_0's 256"):
    gguf_io.save_gguf(tmp_path, dataclasses.replace(CONFIG, d_ff=384), params)
  with pytest.raises(ValueError, match="a BitNet model goes to llama.cpp's bitnet graph with ternary weights"):
    gguf_io.save_gguf(tmp_path, CONFIG, params, "q8_0")
  with pytest.raises(ValueError, match="llama.cpp's llama graph is SwiGLU"):
    gguf_io.save_gguf(tmp_path, dataclasses.replace(BASE, mlp_activation="relu2"), params)
  # A failure while writing leaves no file, not even a partial one.
  monkeypatch.setattr(gguf_io, "_encode", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
  with pytest.raises(OSError, match="disk full"):
    gguf_io.save_gguf(tmp_path, BASE, params)
  assert not list(tmp_path.iterdir())
  monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
  with pytest.raises(ImportError, match="pip install gguf"):
    gguf_io.save_gguf(tmp_path, BASE, params)


# ---------------------------------------------------------------------------------------------
# The command line.


def _train(tmp_path, name: str, **overrides):
  from test_train_loop import micro_config

  from train import loop

  config = micro_config("", steps=4, checkpoint_every=2, eval_every=100, data__source="synthetic", seq_len=16,
                        **overrides)
  assert loop.train(config, tmp_path / name).status == "completed"
  return tmp_path / name


def test_export_command_writes_a_bitnet_runs_gguf_and_hf_folder(tmp_path, capsys):
  from train.io import hf_bitnet

  run = _train(tmp_path, "bitnet", recipe="bitnet", model__d_model=256, model__n_heads=4, model__n_kv_heads=2,
               model__d_ff=256, model__bitnet_norm_placement="sub", model__tie_embeddings=True)
  assert hf.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "gguf"), "--format", "gguf"]) == 0
  assert "llama.cpp bitnet, tq2_0" in capsys.readouterr().out
  tensors, types, meta = read(tmp_path / "gguf" / gguf_io.GGUF_FILE)
  assert meta["general.architecture"] == "bitnet" and types["token_embd.weight"] == GGML.F16
  _, model_config, params, _ = hf.load_run(run)
  leaves = inference.quantize_params(params, "ternary")["layers"]["mlp"]["down"]
  np.testing.assert_array_equal(tensors["blk.0.ffn_down.weight"],
                                np.asarray(ternary.unpack_2bit(leaves["kernel_packed"][0], axis=-1)))
  np.testing.assert_array_equal(tensors["blk.0.ffn_down.scale"], np.reshape(leaves["kernel_scale"][0], (1,)))

  assert hf.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
  assert "BitNetForCausalLM, packed weights" in capsys.readouterr().out
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BitNetForCausalLM"]
  assert data.HFTokenizer(tmp_path / "hf").encode_prompt("é x").tolist() == data.ByteTokenizer().encode_prompt(
      "é x").tolist()
  config, imported = hf.load_pretrained(tmp_path / "hf", dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 259, (1, 12)))
  model = inference.convert_for_inference(Transformer(dataclasses.replace(model_config, dtype=jnp.float32)), "ternary")
  again = inference.convert_for_inference(Transformer(config), "ternary")
  assert rel_err(again.apply({"params": inference.quantize_params(imported, "ternary")}, tokens),
                 model.apply({"params": inference.quantize_params(params, "ternary")}, tokens)) < 1e-5
  assert hf_bitnet.is_bitnet(hf.read_config(tmp_path / "hf"))


def test_export_refuses_a_corrupt_newest_checkpoint_naming_the_fallback(tmp_path, capsys):
  run = _train(tmp_path, "bf16")
  newest = max(checkpoint.saved_steps(run))
  files = [p for p in (run / checkpoint.CHECKPOINT_DIR / str(newest) / "state").rglob("*") if p.is_file()]
  victim = max(files, key=lambda p: p.stat().st_size)  # array data
  victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, other bytes: only the CRC sees it
  out = tmp_path / "out"
  code = cli.run(hf.main, ["export", "--checkpoint", str(run), "--out", str(out), "--format", "gguf"],
                 codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),))
  err = capsys.readouterr().err
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert f"checkpoint {run / checkpoint.CHECKPOINT_DIR / str(newest)}" in err and "corrupt" in err
  assert f"export it with --step {newest - 2}" in err and not out.exists()
  assert hf.main(["export", "--checkpoint", str(run), "--out", str(out), "--step", str(newest - 2)]) == 0
  # A byte-level run's safetensors export carries its tokenizer: train.data's ids, as a tokenizer.json.
  tokenizer = data.HFTokenizer(out)
  for text in ["def main():\n  return 0", "café 🙂", "<s> stays bytes"]:
    assert tokenizer.encode_document(text).tolist() == data.ByteTokenizer().encode_document(text).tolist()
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                   "tokenizer_config.json"]
