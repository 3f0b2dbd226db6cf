"""train.io.hf_bitnet: our BitNet model as Hugging Face ``BitNetForCausalLM`` folders, and back.

Without torch, the folder is checked by an independent float64 numpy forward of the graph
``BitNetForCausalLM`` runs with transformers' BitLinear layers (read from the folder alone:
its config.json and safetensors, the 2-bit row packing unpacked here, activations quantized to
int8 per token with scale 127 / absmax, the output divided by ``weight_scale``). With torch and
transformers installed, transformers itself loads the folder (skipped otherwise; the GPU runner
runs benchmarks/hf_bitnet_check.py).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowbit
import bitnet_reference
from helpers import fresh_key, rel_err
from jaxlowbit import inference
from jaxlowbit_numerics import ternary
from train import hf
from train.io import hf_bitnet
from train.model import ModelConfig, Transformer

pytest.importorskip("safetensors")
from safetensors.numpy import load_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("float32_matmuls")

CONFIG = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, dtype=jnp.float32,
                     rope_theta=5e5, recipe=jaxlowbit.BitNet(), bitnet_norm_placement="sub", tie_embeddings=True)
# The numpy forward against ours: 1e-6 typically; an activation on an int8 rounding tie in one
# and not the other (127 / absmax times x there, x over absmax / 127 here) moves its token.
LOGITS_RTOL = 3e-2


def random_params(config: ModelConfig, key) -> dict:
  """The init with every value scaled by 1 +- 0.3 at random (norm scales too), so no tensor can pass for another."""
  params = Transformer(config).init(key, jnp.zeros((1, 8), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
  return jax.tree.unflatten(tree, [x * (1 + 0.3 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])


def ternary_logits(config: ModelConfig, params, tokens) -> np.ndarray:
  """Our BitNet inference forward (``generate --scheme ternary``), float32."""
  model = inference.convert_for_inference(Transformer(config), "ternary")
  return np.asarray(model.apply({"params": inference.quantize_params(params, "ternary")}, jnp.asarray(tokens)))


def test_row_packing_is_transformers_layout():
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  codes = rng.integers(-1, 2, (12, 7)).astype(np.int8)
  packed = hf_bitnet.pack_rows(codes)
  assert packed.shape == (3, 7) and packed.dtype == np.uint8
  for r in range(3):  # row r holds rows r, r + 3, r + 6, r + 9, two bits each, lowest first
    expected = sum((codes[r + 3 * i].astype(np.int32) + 1) << (2 * i) for i in range(4))
    np.testing.assert_array_equal(packed[r], expected)
  np.testing.assert_array_equal(hf_bitnet.unpack_rows(packed), codes)


# Where transformers' BitNetForCausalLM keeps each tensor of layer i (tests/bitnet_reference.py's roles).
HF_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "attn_sub_norm": "model.layers.{i}.self_attn.attn_sub_norm.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_sub_norm": "model.layers.{i}.mlp.ffn_sub_norm.weight",
    **{z: f"model.layers.{{i}}.self_attn.{z}_proj" for z in "qkvo"},
    **{z: f"model.layers.{{i}}.mlp.{z}_proj" for z in ("gate", "up", "down")},
}


def hf_reference_logits(folder, tokens: np.ndarray) -> np.ndarray:
  """BitNetForCausalLM with transformers' BitLinear, from the folder alone, in float64 numpy."""
  cfg = json.loads((folder / "config.json").read_text())
  t = load_file(str(folder / "model.safetensors"))

  def bitlinear(x, name):
    rows = t[f"{name}.weight"].shape[0]
    w = np.concatenate([((t[f"{name}.weight"] >> (2 * i)) & 3).astype(np.float64) - 1 for i in range(4)], 0)
    assert w.shape[0] == 4 * rows
    scale = 127 / np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5)
    q = np.clip(np.round(x * scale), -128, 127)
    return (q @ w.T) / (scale * t[f"{name}.weight_scale"].astype(np.float64))

  embed = t["model.embed_tokens.weight"].astype(np.float64)
  head = t["lm_head.weight"].astype(np.float64) if "lm_head.weight" in t else embed
  shape = bitnet_reference.Shape(cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                 cfg["rms_norm_eps"], cfg["rope_theta"], cfg["hidden_act"])
  return bitnet_reference.bitnet_logits(
      tokens, embedding=embed, head=head, final_norm=t["model.norm.weight"].astype(np.float64),
      n_layers=cfg["num_hidden_layers"], names=HF_NAMES, norm_weight=lambda name: t[name].astype(np.float64),
      linear=bitlinear, shape=shape)


LAYOUTS = {"scan_fused_silu": {}, "unrolled_unfused_relu2_untied": dict(
    scan_layers=False, fused_projections=False, mlp_activation="relu2", tie_embeddings=False)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_folder_is_transformers_bitnet_with_our_codes_and_logits(layout, tmp_path):
  config = dataclasses.replace(CONFIG, **LAYOUTS[layout])
  params = random_params(config, fresh_key())
  folder = hf_bitnet.save_pretrained(tmp_path / "hf", config, params)
  cfg = json.loads((folder / "config.json").read_text())
  assert cfg["architectures"] == ["BitNetForCausalLM"] and cfg["model_type"] == "bitnet"
  assert cfg["quantization_config"] == {"quant_method": "bitnet", "linear_class": "bitlinear",
                                        "quantization_mode": "offline"}
  assert cfg["hidden_act"] == config.mlp_activation and cfg["tie_word_embeddings"] == config.tie_embeddings
  # The codes and scale of one projection are those jaxlowbit.inference runs.
  t = load_file(str(folder / "model.safetensors"))
  qparams = inference.quantize_params(params, "ternary")
  down = jax.tree.map(lambda x: x[1], qparams["layers"]) if config.scan_layers else qparams["layers_1"]
  down = down["mlp"]["down"]
  np.testing.assert_array_equal(hf_bitnet.unpack_rows(t["model.layers.1.mlp.down_proj.weight"]),
                                np.asarray(ternary.unpack_2bit(down["kernel_packed"], axis=-1)))
  np.testing.assert_allclose(t["model.layers.1.mlp.down_proj.weight_scale"], 1 / np.asarray(down["kernel_scale"]),
                             rtol=1e-7)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))
  assert rel_err(hf_reference_logits(folder, tokens), ternary_logits(config, params, tokens)) < LOGITS_RTOL


@pytest.mark.parametrize("weights", hf_bitnet.FORMATS)
def test_import_gives_back_the_exported_models_forward(weights, tmp_path):
  """Export a fused, scanned model and import it (unfused, as transformers' scales are per linear):
  the BitNet forward is the same; master weights come back exactly."""
  params = random_params(CONFIG, fresh_key())
  hf_bitnet.save_pretrained(tmp_path / "hf", CONFIG, params, weights=weights)
  config, imported = hf_bitnet.load_pretrained(tmp_path / "hf", dtype=jnp.float32)
  assert config.bitnet_norm_placement == "sub" and not config.fused_projections and config.tie_embeddings
  assert config.d_ff == CONFIG.d_ff and config.n_kv_heads == CONFIG.n_kv_heads
  tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 16))
  ours = ternary_logits(CONFIG, params, tokens)
  # The imported weights export to the same tensors (the master weights bit for bit; packed: the same codes,
  # scales within float32 rounding of their means), unfused and fused alike.
  fused, refused = hf_bitnet.load_pretrained(tmp_path / "hf", dtype=jnp.float32, fused_projections=True)
  before = dict(hf_bitnet.hf_tensors(CONFIG, params, weights))
  for model_config, model_params in ((config, imported), (fused, refused)):
    again = dict(hf_bitnet.hf_tensors(model_config, model_params, weights))
    assert again.keys() == before.keys()
    for name, value in again.items():
      if weights == "master" or not name.endswith(hf_bitnet.SCALE_SUFFIX):
        np.testing.assert_array_equal(value, before[name], err_msg=name)
      else:  # two float32 means over the weight's n values (the export's, the import's requantization)
        n = before[name.removesuffix(hf_bitnet.SCALE_SUFFIX) + ".weight"].size * hf_bitnet.CODES_PER_BYTE
        np.testing.assert_allclose(value, before[name], rtol=2 * n * 2.0**-24, err_msg=name)
  if weights == "master":  # q, k, v now quantized on their own: the same weights, another forward
    return
  # The same codes; the scales' last-bit differences can move an activation across an int8 rounding tie (seen
  # once in CI: 4.4e-4), hence the tie bound of the numpy comparison rather than 1e-5.
  assert rel_err(ternary_logits(config, imported, tokens), ours) < LOGITS_RTOL
  assert rel_err(ternary_logits(fused, refused, tokens), ours) < LOGITS_RTOL


def test_clear_errors(tmp_path):
  params = Transformer(CONFIG).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  every = dataclasses.replace(CONFIG, bitnet_norm_placement="every_projection")
  with pytest.raises(ValueError, match="bitnet_norm_placement=sub"):
    hf_bitnet.save_pretrained(tmp_path / "a", every, params)
  with pytest.raises(ValueError, match="every attention and MLP linear"):
    hf_bitnet.save_pretrained(tmp_path / "b", dataclasses.replace(CONFIG, filter_fqns=("down",)), params)
  assert not list(tmp_path.iterdir())  # nothing written, not even a partial folder
  llama = hf.hf_config(dataclasses.replace(CONFIG, recipe=None))
  assert not hf_bitnet.is_bitnet(llama)
  with pytest.raises(hf.UnsupportedCheckpointError, match="hidden_act='gelu'"):
    hf_bitnet.model_config_from_hf({**llama, "architectures": ["BitNetForCausalLM"], "hidden_act": "gelu"})


def test_transformers_loads_it_with_our_logits(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  params = random_params(CONFIG, fresh_key())
  folder = hf_bitnet.save_pretrained(tmp_path / "hf", CONFIG, params)
  try:
    model = transformers.BitNetForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
  except RuntimeError as e:  # older transformers: "No GPU found. A GPU is needed for quantization."
    pytest.skip(f"transformers does not load BitNet models here: {e}")
  tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 16))
  with torch.no_grad():
    theirs = model(torch.as_tensor(tokens).to(model.device)).logits.float().cpu().numpy()
  assert rel_err(theirs, ternary_logits(CONFIG, params, tokens)) < LOGITS_RTOL


def test_finetune_from_a_bitnet_folder_keeps_its_forward(tmp_path, capsys):
  """``train.main --config.init_from=<BitNetForCausalLM folder>``: the run becomes a BitNet model with
  sub-norms and the folder's activation, and (lr 1e-30) its checkpoint computes what the folder did."""
  from test_train_loop import micro_config

  from train import loop, runs

  config = dataclasses.replace(CONFIG, vocab_size=384, mlp_activation="relu2", fused_projections=False)
  params = random_params(config, fresh_key())
  folder = hf_bitnet.save_pretrained(tmp_path / "hf", config, params)
  run = micro_config("", init_from=str(folder), steps=2, lr=1e-30, checkpoint_every=2, eval_every=100,
                     data__source="synthetic", seq_len=16, model__fused_projections=False)
  assert loop.train(run, tmp_path / "run").status == "completed"
  out = capsys.readouterr().out
  assert "config.recipe: bf16 -> bitnet" in out and "config.model.bitnet_norm_placement: 'every_projection' -> 'sub'" \
      in out and "config.model.mlp_activation: 'silu' -> 'relu2'" in out, out
  _, model_config, tuned, _ = runs.load_run(tmp_path / "run")
  assert model_config.bitnet_norm_placement == "sub" and model_config.mlp_activation == "relu2"
  # In lockstep with the import: at lr 1e-30 the checkpoint's weights quantize to the imported ones' codes and
  # scales exactly (only exact zeros moved, by ~1e-30), so its forward is the import's bit for bit; the import's
  # own forward against the folder's is test_import_gives_back_the_exported_models_forward.
  _, imported = hf_bitnet.load_pretrained(folder, dtype=jnp.float32)
  model_config = dataclasses.replace(model_config, dtype=jnp.float32)
  jax.tree.map(np.testing.assert_array_equal, inference.quantize_params(tuned, "ternary"),
               inference.quantize_params(imported, "ternary"))
  tokens = np.random.default_rng(2).integers(0, 259, (1, 12))
  tuned_logits = ternary_logits(model_config, tuned, tokens)
  np.testing.assert_array_equal(tuned_logits, ternary_logits(model_config, imported, tokens))
  assert rel_err(tuned_logits, ternary_logits(config, params, tokens)) < LOGITS_RTOL  # ties: see LOGITS_RTOL
