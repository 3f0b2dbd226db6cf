"""train.hf: Hugging Face Llama, Qwen2 and Mistral checkpoints in and out.

The checkpoints are tiny random models written by the test in Hugging Face's naming and layout
(``safetensors``); the reference is an independent float64 numpy forward of the Hugging Face
architecture (rotate-half RoPE with ``inv_freq``, Llama 3 scaling, GQA by repeating k/v heads).
Where ``transformers`` and ``torch`` are installed (the GPU runner), our export is also loaded by
``transformers`` and a ``transformers``-made model is imported, logits compared.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import fresh_key, needs_devices
from jax.sharding import NamedSharding, PartitionSpec as P
from train import hf
from train.io import hf_reader
from train.model import Transformer

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # logits against float64 references, also on a GPU

LOGITS_RTOL = 1e-4  # float32 model against the float64 reference (norm-wise)

BASE = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "max_position_embeddings": 256,
}  # fmt: skip
CASES = {
    "llama3": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
               "tie_word_embeddings": False,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1e6,
              "tie_word_embeddings": True},
    "mistral": {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "rope_theta": 1e4,
                "tie_word_embeddings": False, "sliding_window": 4096, "num_key_value_heads": 4},
}  # fmt: skip


def random_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of ``cfg`` (biases for Qwen2)."""
  d, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
  q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

  def w(*shape, std=0.08):
    return (rng.standard_normal(shape) * std).astype(np.float32)

  t = {"model.embed_tokens.weight": w(cfg["vocab_size"], d, std=1.0), "model.norm.weight": 1 + w(d, std=0.1)}
  if not cfg["tie_word_embeddings"]:
    t["lm_head.weight"] = w(cfg["vocab_size"], d)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t |= {p + "input_layernorm.weight": 1 + w(d, std=0.1), p + "post_attention_layernorm.weight": 1 + w(d, std=0.1),
          p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.k_proj.weight": w(kv, d),
          p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, q),
          p + "mlp.gate_proj.weight": w(ff, d), p + "mlp.up_proj.weight": w(ff, d), p + "mlp.down_proj.weight": w(d, ff)}
    if cfg["model_type"] == "qwen2":
      t |= {p + "self_attn.q_proj.bias": w(q), p + "self_attn.k_proj.bias": w(kv), p + "self_attn.v_proj.bias": w(kv)}
  return t


def write_checkpoint(folder: pathlib.Path, cfg: dict, tensors: dict, shards: int = 1) -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(cfg))
  names = sorted(tensors)
  if shards == 1:
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
  weight_map = {}
  for i in range(shards):
    part = names[i::shards]
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    weight_map |= dict.fromkeys(part, file)
  (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  return folder


def reference_logits(cfg: dict, t: dict, tokens: np.ndarray) -> np.ndarray:
  """The Hugging Face decoder in float64 numpy, written from its modeling code's structure."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  hd, eps = cfg["hidden_size"] // heads, cfg["rms_norm_eps"]
  inv_freq = 1.0 / (cfg.get("rope_theta", 1e4) ** (np.arange(0, hd, 2) / hd))
  scaling = cfg.get("rope_scaling")
  if scaling:  # Llama 3: per-wavelength rule
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    inv_freq = np.where(medium, smoothed, scaled)
  b, seq = tokens.shape
  angles = np.arange(seq)[:, None] * inv_freq[None, :]
  cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

  def rotate_half(x):
    return np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)

  def linear(x, name):
    y = x @ t[name + ".weight"].T
    return y + t[name + ".bias"] if name + ".bias" in t else y

  x = t["model.embed_tokens.weight"][tokens]
  causal = np.triu(np.full((seq, seq), -np.inf), 1)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = norm(x, t[p + "input_layernorm.weight"])
    q = linear(h, p + "self_attn.q_proj").reshape(b, seq, heads, hd).transpose(0, 2, 1, 3)
    k = linear(h, p + "self_attn.k_proj").reshape(b, seq, kv_heads, hd).transpose(0, 2, 1, 3)
    v = linear(h, p + "self_attn.v_proj").reshape(b, seq, kv_heads, hd).transpose(0, 2, 1, 3)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + causal
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, seq, heads * hd)
    x = x + linear(attn, p + "self_attn.o_proj")
    h = norm(x, t[p + "post_attention_layernorm.weight"])
    gate = linear(h, p + "mlp.gate_proj")
    x = x + linear(gate / (1 + np.exp(-gate)) * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
  x = norm(x, t["model.norm.weight"])
  head = t["lm_head.weight"] if "lm_head.weight" in t else t["model.embed_tokens.weight"]
  return x @ head.T


def rel(a, b) -> float:
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("layout", [dict(scan_layers=True, fused_projections=True),
                                    dict(scan_layers=False, fused_projections=False)], ids=["scan_fused", "unrolled"])
def test_import_matches_the_reference_forward(name, layout, tmp_path):
  cfg = CASES[name]
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  tensors = random_tensors(cfg, rng)
  folder = write_checkpoint(tmp_path / name, cfg, tensors, shards=3 if name == "llama3" else 1)
  config, params = hf.load_pretrained(folder, dtype=jnp.float32, **layout)
  assert config.attention_bias == (name == "qwen2") and config.tie_embeddings == cfg["tie_word_embeddings"]
  assert bool(config.rope_scaling) == (name == "llama3")
  tokens = rng.integers(0, cfg["vocab_size"], (2, 40))  # longer than the original context: scaling matters
  logits = Transformer(config).apply({"params": params}, jnp.asarray(tokens))
  assert rel(logits, reference_logits(cfg, tensors, tokens)) < LOGITS_RTOL


def test_llama3_scaling_changes_the_logits(tmp_path):
  """The scaled RoPE must matter at these lengths, or the test above would not check it."""
  cfg = CASES["llama3"]
  tensors = random_tensors(cfg, np.random.default_rng(0))
  tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], (1, 40))
  plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}
  assert rel(reference_logits(plain, tensors, tokens), reference_logits(cfg, tensors, tokens)) > 100 * LOGITS_RTOL


@pytest.mark.parametrize("name", list(CASES))
def test_export_then_import_is_bit_exact(name, tmp_path):
  cfg = CASES[name]
  tensors = random_tensors(cfg, np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30))))
  config, params = hf.load_pretrained(write_checkpoint(tmp_path / "in", cfg, tensors))
  out = hf.save_pretrained(tmp_path / "out", config, params, architecture=cfg["architectures"][0], max_shard_bytes=40_000)
  assert (out / "model.safetensors.index.json").is_file(), "small shards force the index format"
  config2, params2 = hf.load_pretrained(out)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  exported = dict(hf.hf_tensors(config2, params2))
  assert exported.keys() == tensors.keys()
  for key, value in tensors.items():
    np.testing.assert_array_equal(exported[key], value)


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
def test_quantized_export_stores_the_inference_codes_and_reads_back(scheme, tmp_path):
  from jaxlowbit import inference

  cfg = CASES["qwen2"]
  tensors = random_tensors(cfg, np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30))))
  config, params = hf.load_pretrained(write_checkpoint(tmp_path / "in", cfg, tensors), dtype=jnp.float32)
  out = hf.save_pretrained(tmp_path / "q", config, params, architecture="Qwen2ForCausalLM", scheme=scheme)
  meta = json.loads((out / "config.json").read_text())["quantization_config"]
  assert meta["scheme"] == scheme and meta["quant_method"] == "jaxlowbit"
  from safetensors import safe_open

  with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
    q = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
    scale = f.get_tensor("model.layers.1.self_attn.k_proj.weight_scale")
    assert f.get_tensor("model.embed_tokens.weight").dtype == np.float32, "embeddings stay high precision"
  leaves = inference.quantize_weight(jnp.asarray(tensors["model.layers.1.self_attn.k_proj.weight"].T), scheme)
  np.testing.assert_array_equal(q, leaves["kernel_q"])  # the codes jaxlowbit.inference runs
  np.testing.assert_array_equal(scale, leaves["kernel_scale"])
  config2, params2 = hf.load_pretrained(out, dtype=jnp.float32)
  tokens = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 16))
  exact = reference_logits(cfg, tensors, tokens)
  assert 1e-6 < rel(Transformer(config2).apply({"params": params2}, jnp.asarray(tokens)), exact) < 2e-2


def test_transformers_5_rope_parameters_are_read(tmp_path):
  """transformers >= 5 saves RoPE's theta and scaling as one "rope_parameters" dict."""
  cfg = dict(CASES["llama3"])
  scaling, theta = cfg.pop("rope_scaling"), cfg.pop("rope_theta")
  cfg["rope_parameters"] = {**scaling, "rope_theta": theta}
  config = hf.model_config_from_hf(cfg)
  assert config.rope_theta == theta and config.rope_scaling == (8.0, 1.0, 4.0, 16.0)
  assert hf.model_config_from_hf({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_scaling == ()


def test_clear_errors(tmp_path):
  cfg = CASES["llama3"]
  tensors = random_tensors(cfg, np.random.default_rng(0))
  with pytest.raises(hf.UnsupportedCheckpointError, match="GPT2LMHeadModel.*not supported"):
    hf.load_pretrained(write_checkpoint(tmp_path / "gpt2", {**cfg, "architectures": ["GPT2LMHeadModel"]}, tensors))
  with pytest.raises(hf.UnsupportedCheckpointError, match="yarn"):
    hf.load_pretrained(write_checkpoint(tmp_path / "yarn", {**cfg, "rope_scaling": {"rope_type": "yarn"}}, tensors))
  with pytest.raises(hf.UnsupportedCheckpointError, match="config.json not found"):
    hf.load_pretrained(tmp_path / "nothing")
  folder = write_checkpoint(tmp_path / "nofile", cfg, tensors)
  (folder / "model.safetensors").unlink()
  with pytest.raises(hf.UnsupportedCheckpointError, match="neither model.safetensors"):
    hf.load_pretrained(folder)
  partial = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
  with pytest.raises(hf.UnsupportedCheckpointError, match="missing, e.g. 'model.layers.1.mlp.up_proj.weight'"):
    hf.load_pretrained(write_checkpoint(tmp_path / "partial", cfg, partial))
  wrong = {**tensors, "model.layers.0.mlp.down_proj.weight": np.zeros((3, 3), np.float32)}
  with pytest.raises(hf.UnsupportedCheckpointError, match="down_proj.weight' has shape"):
    hf.load_pretrained(write_checkpoint(tmp_path / "wrong", cfg, wrong))
  with pytest.raises(ValueError, match="shardings has no embed/embedding"):
    hf.load_pretrained(write_checkpoint(tmp_path / "ok", cfg, tensors), shardings={"final_norm": {}})
  sharded = write_checkpoint(tmp_path / "sharded", cfg, tensors, shards=2)
  (sharded / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(hf.UnsupportedCheckpointError, match="shard.*missing"):
    hf.load_pretrained(sharded)


def test_integer_nan_and_truncated_tensors_are_refused_naming_them(tmp_path):
  """Issue 31: an int32 or bool tensor was cast to float and trained, a NaN one ended as exit 3 after training
  started, a truncated file raised safetensors' own error without naming the file."""
  cfg = CASES["llama3"]
  tensors = random_tensors(cfg, np.random.default_rng(0))
  name = "model.layers.0.mlp.up_proj.weight"
  for dtype, shown in [(np.int32, "I32"), (np.bool_, "BOOL")]:
    stored = {**tensors, name: tensors[name].astype(dtype)}
    with pytest.raises(hf.UnsupportedCheckpointError, match=f"tensor '{name}' is stored as {shown}"):
      hf.load_pretrained(write_checkpoint(tmp_path / shown, cfg, stored))
  poisoned = {**tensors, name: tensors[name].copy()}
  poisoned[name][3, 5] = np.nan
  with pytest.raises(hf.UnsupportedCheckpointError, match=f"tensor '{name}' holds NaN or inf"):
    hf.load_pretrained(write_checkpoint(tmp_path / "nan", cfg, poisoned))
  folder = write_checkpoint(tmp_path / "cut", cfg, tensors)
  data = (folder / "model.safetensors").read_bytes()
  (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(hf.UnsupportedCheckpointError, match="model.safetensors: not a readable safetensors file"):
    hf.load_pretrained(folder)


# -------------------------------------------------------------------------------------------
# Loading onto shardings: each device's block read on its own.


def spread(shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> NamedSharding:
  """FSDP-like: the mesh's first axis splits the leaf's first axis it divides; a second mesh axis
  (tensor-parallel-like) the last remaining one it divides; the rest is replicated."""
  spec, free = [None] * len(shape), list(range(len(shape)))
  for name, order in zip(mesh.axis_names, (1, -1)):
    axis = next((a for a in free[::order] if shape[a] % mesh.shape[name] == 0), None)
    if axis is not None:
      spec[axis] = name
      free.remove(axis)
  return NamedSharding(mesh, P(*spec))


def record_reads(monkeypatch) -> list[list]:
  """From now on, every block the import builds and what it read for it: ``[leaf shape, block
  shape, [(HF name, shape read)...]]`` per call of ``train.io.hf_reader._read_block`` (one device's block,
  or a whole leaf), in order."""
  calls, read_block, read_slice = [], hf_reader._read_block, hf_reader._read_slice

  def block(tensors, pieces, shape, dtype, index):
    calls.append([shape, None, []])
    value = read_block(tensors, pieces, shape, dtype, index)
    calls[-1][1] = value.shape
    return value

  def sliced(file, name, index):
    value = read_slice(file, name, index)
    calls[-1][2].append((name, value.shape))
    return value

  monkeypatch.setattr(hf_reader, "_read_block", block)
  monkeypatch.setattr(hf_reader, "_read_slice", sliced)
  return calls


MESHES = {"fsdp8": ((8,), ("fsdp",)), "fsdp2_tensor4": ((2, 4), ("fsdp", "tensor"))}
SHARDED_LOADS = {  # checkpoint case, how it is written, the layout it is read into
    "llama3_3files_scan_fused": ("llama3", None, dict(scan_layers=True, fused_projections=True)),
    "qwen2_unrolled": ("qwen2", None, dict(scan_layers=False, fused_projections=False)),
    "qwen2_w8a16_scan_fused": ("qwen2", "w8a16", dict(scan_layers=True, fused_projections=True)),
}


@needs_devices(8)
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("load", list(SHARDED_LOADS))
def test_loading_onto_shardings_gives_the_host_load_bit_for_bit(load, mesh_name, tmp_path):
  """Every leaf comes back on exactly its sharding (rows split, columns split across the fused
  q/k/v and gate/up parts, the layer stack split), equal to the whole-host load bit for bit;
  shardings may name more leaves than the checkpoint has (the trainer's BitNet norms)."""
  name, scheme, layout = SHARDED_LOADS[load]
  cfg = CASES[name]
  tensors = random_tensors(cfg, np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30))))
  folder = write_checkpoint(tmp_path / "in", cfg, tensors, shards=3 if name == "llama3" else 1)
  if scheme:
    config, params = hf.load_pretrained(folder)
    folder = hf.save_pretrained(tmp_path / "q", config, params, architecture=cfg["architectures"][0], scheme=scheme)
  _, host = hf.load_pretrained(folder, **layout)
  mesh = jax.make_mesh(*MESHES[mesh_name], devices=jax.devices()[:8])
  shardings = jax.tree.map(lambda x: spread(x.shape, mesh), host)
  extra = {"extra_norm": {"scale": shardings["final_norm"]["scale"]}}  # a leaf the checkpoint lacks
  _, loaded = hf.load_pretrained(folder, shardings={**shardings, **extra}, **layout)
  split = 0
  for (path, a), (_, b), (_, want) in zip(*(jax.tree_util.tree_leaves_with_path(t) for t in (loaded, host, shardings)),
                                          strict=True):
    assert isinstance(a, jax.Array) and a.sharding == want and a.dtype == b.dtype, path
    np.testing.assert_array_equal(np.asarray(a), b)
    split += not want.is_fully_replicated
  assert split >= 5, "the test must split most leaves"
  target = {**jax.tree.map(jnp.zeros_like, host), "extra_norm": {"scale": jnp.ones(cfg["hidden_size"])}}
  assert hf.merge_into(target, loaded) == ["extra_norm"]


@needs_devices(8)
def test_a_sharded_load_reads_only_each_devices_block(tmp_path, monkeypatch):
  """Each device's block is built from exactly its own elements of the HF tensors (as many as the
  block holds, nothing of the other devices' rows or columns), and no read is a whole split leaf."""
  cfg = CASES["llama3"]
  tensors = random_tensors(cfg, np.random.default_rng(0))
  folder = write_checkpoint(tmp_path / "in", cfg, tensors)
  layout = dict(scan_layers=True, fused_projections=True)
  _, host = hf.load_pretrained(folder, **layout)
  mesh = jax.make_mesh(*MESHES["fsdp2_tensor4"], devices=jax.devices()[:8])
  calls = record_reads(monkeypatch)
  _, loaded = hf.load_pretrained(folder, shardings=jax.tree.map(lambda x: spread(x.shape, mesh), host), **layout)
  blocks = [{str(shard.index) for shard in x.addressable_shards} for x in jax.tree.leaves(loaded)]
  assert len(calls) == sum(map(len, blocks)) < 8 * len(blocks)  # each distinct block read once, not per device
  for leaf, block, reads in calls:
    assert np.prod(block) < np.prod(leaf), f"every leaf of this model is split: {leaf} read whole"
    assert sum(np.prod(shape) for _, shape in reads) == np.prod(block), (leaf, block, reads)
  read = {name for _, _, reads in calls for name, _ in reads}
  assert read == set(tensors), "every tensor is read, in parts"


# -------------------------------------------------------------------------------------------
# transformers itself, where installed (the GPU runner).


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_loads_our_export_and_we_load_theirs(name, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = CASES[name]
  tensors = random_tensors(cfg, np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30))))
  config, params = hf.load_pretrained(write_checkpoint(tmp_path / "in", cfg, tensors), dtype=jnp.float32)
  out = hf.save_pretrained(tmp_path / "out", config, params, architecture=cfg["architectures"][0])
  model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32, attn_implementation="eager")
  tokens = np.random.default_rng(0).integers(0, cfg["vocab_size"], (2, 40))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.double().numpy()
  ours = Transformer(config).apply({"params": params}, jnp.asarray(tokens))
  assert rel(ours, theirs) < LOGITS_RTOL

  model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                        torch_dtype=torch.float32, attn_implementation="eager")
  model.save_pretrained(tmp_path / "theirs", safe_serialization=True)
  config, params = hf.load_pretrained(tmp_path / "theirs", dtype=jnp.float32)
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.double().numpy()
  assert rel(Transformer(config).apply({"params": params}, jnp.asarray(tokens)), theirs) < LOGITS_RTOL


# -------------------------------------------------------------------------------------------
# The trainer: init_from, a tokenizer.json, generate and export.


@pytest.mark.parametrize("fsdp", [1, pytest.param(2, marks=needs_devices(2))], ids=["one_device", "fsdp2"])
def test_finetune_from_a_hf_folder_then_generate_and_export(fsdp, tmp_path, capsys):
  pytest.importorskip("tokenizers")
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  from test_train_loop import micro_config

  from train import generate, loop

  corpus = tmp_path / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "import", "for", "in", "if", "x", "y", "(", ")", ":", "=", "+", "1"]
  for i in range(30):
    (corpus / f"m{i}.py").write_text(" ".join(rng.choice(words, size=400)))
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "</s>"], initial_alphabet=[])
  tokenizer.train([str(p) for p in corpus.iterdir()], trainer)

  cfg = CASES["llama3"]
  tensors = random_tensors(cfg, rng)
  folder = write_checkpoint(tmp_path / "llama", cfg, tensors)
  tokenizer.save(str(folder / "tokenizer.json"))

  config = micro_config(str(corpus), init_from=str(folder), steps=2, lr=1e-30, checkpoint_every=2, eval_every=100,
                        mesh__fsdp=fsdp)
  result = loop.train(config, tmp_path / "run")
  out = capsys.readouterr().out
  assert result.status == "completed" and "init_from" in out and "config.model.d_model: 32 -> 64" in out, out
  assert "tokenizer.json tokens" in out, "the corpus is tokenized with the checkpoint's tokenizer"

  assert generate.main(["--checkpoint", str(tmp_path / "run"), "--scheme", "bf16", "--prompt", "def x",
                        "--max_new_tokens", "4"]) == 0
  assert "def x" in capsys.readouterr().out

  assert hf.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
  assert (tmp_path / "hf" / "tokenizer.json").is_file()
  _, exported = hf.load_pretrained(tmp_path / "hf")
  _, original = hf.load_pretrained(folder)
  jax.tree.map(np.testing.assert_array_equal, exported, original)  # lr 1e-30: two steps change no float32 weight


@needs_devices(8)
def test_init_from_places_each_pretrained_leaf_on_the_inits_fsdp_sharding(tmp_path, monkeypatch):
  """Under FSDP (8 devices) every loaded leaf lands on exactly the init's sharding, each device
  receiving only its shard, read from the files on its own: every projection weight is read as
  eight blocks of an eighth (its input features), never whole, on the host or on one device."""
  from test_train_loop import micro_config

  from train import steps
  from train import config as train_config
  from train.spec import resolve

  cfg = CASES["qwen2"]
  tensors = random_tensors(cfg, np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**30))))
  folder = write_checkpoint(tmp_path / "qwen2", cfg, tensors)
  config = micro_config(str(tmp_path), init_from=str(folder), mesh__fsdp=8, batch_size=8)
  train_config.adjust(config)  # the checkpoint's shape, as the trainer does
  spec = resolve(config)
  functions = steps.step_functions(spec)
  state = functions.init()
  calls = record_reads(monkeypatch)
  loaded = functions.with_pretrained(state, spec)
  monkeypatch.undo()

  _, expected = hf.load_pretrained(folder, scan_layers=True, fused_projections=True)
  new, old, want = (jax.tree_util.tree_leaves_with_path(t) for t in (loaded.params, state.params, expected))
  sharded = set()
  for (path, a), (_, b), (_, c) in zip(new, old, want, strict=True):
    assert a.sharding == b.sharding, path
    np.testing.assert_array_equal(a, c)
    if not a.sharding.is_fully_replicated:
      sharded.add(jax.tree_util.keystr(path[1:-1], simple=True, separator="/"))
      assert {s.data.size * 8 for s in a.addressable_shards} == {a.size}, path  # an eighth on each device
  assert sharded == {"attn/qkv", "attn/out", "mlp/gate_up", "mlp/down"}, sharded
  reads = [read for _, _, block_reads in calls for read in block_reads]
  for name, tensor in tensors.items():
    shapes = [shape for read, shape in reads if read == name]
    if name.endswith("_proj.weight"):
      assert shapes == [(tensor.shape[0], tensor.shape[1] // 8)] * 8, (name, shapes)
    else:
      assert shapes == [tensor.shape], (name, shapes)  # replicated: read once, whole
