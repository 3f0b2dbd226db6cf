"""A Llama-style decoder whose linears come from jaxlowbit.

Structure (pre-norm, no biases)::

    tokens [B, T] int32
      -> embed                                (high precision, float32 table)
      -> n_layers x Block:
           x = x + attn(attn_norm(x))          RoPE, grouped-query causal attention
           x = x + mlp(mlp_norm(x))            gated MLP: SwiGLU, or squared ReLU (mlp_activation)
      -> final_norm -> lm_head                 (high precision by default; or the tied embedding)
    logits [B, T, vocab] float32

Precision: parameters are float32 master weights (``param_dtype``); activations and
high-precision matmuls run in ``dtype`` (bfloat16 by default). Each projection
(``attn.qkv``, ``attn.out``, ``mlp.gate_up``, ``mlp.down``, ``lm_head``) is built with
``jaxlowbit.dense_for(recipe)`` where ``ModelConfig.recipe_for(path)`` chooses the recipe:
``quantize_attention`` / ``quantize_mlp`` / ``quantize_lm_head`` and ``filter_fqns`` (keep
a projection high precision when its path contains one of the strings, as in
``jaxlowbit.convert``) decide which ones are low-bit. A tied LM head (``tie_embeddings``) is
the embedding table and always high precision.

BitNet norms (``bitnet_norms``; a projection that runs with a :class:`jaxlowbit.BitNet` recipe),
placed by ``bitnet_norm_placement``, each named ``<projection>_norm``:

========================  =====================================================================
``"sub"``                 the published BitNet b1.58 (paper, Hugging Face ``BitNetForCausalLM``,
                          llama.cpp ``bitnet``): the pre-norms, plus ``attn.out_norm`` on the
                          attention output ``[n_heads head_dim]`` (HF ``attn_sub_norm``) and
                          ``mlp.down_norm`` on the hidden activation ``[d_ff]`` (``ffn_sub_norm``).
                          q/k/v and gate/up read the pre-norm, which quantizes for them.
``"every_projection"``    torchao's surgery: an RMSNorm before every BitNet projection
                          (``qkv_norm``, ``out_norm``, ``gate_up_norm``, ``down_norm``, and
                          ``lm_head_norm`` for a BitNet LM head), i.e. a second norm after each
                          pre-norm.
========================  =====================================================================

It is done here, where a reader sees it (:meth:`ModelConfig.norm_before`), not hidden in the layer.

A projection is composed of one small function per concern (see the section above
:func:`projection`): norm placement (:meth:`ModelConfig.norm_before`, :func:`own_norm`), quantizer
choice (what the op producing its input quantizes for: :meth:`ModelConfig.own_norm_recipe`,
:meth:`ModelConfig.fused_input_recipe`, :meth:`ModelConfig.gather_recipe`), parallel layout
(:class:`ProjectionLayout`) and the layer (:func:`dense`).

Layers are stacked with ``nn.scan`` (one compiled block for all layers: a 1B model compiles
in seconds) and optionally rematerialized with ``nn.remat`` under a named policy. Parameters
of the scanned stack carry a leading ``[n_layers]`` axis: ``params["layers"]["attn"]["qkv"]
["kernel"]`` is ``[n_layers, d_model, (n_heads + 2 n_kv_heads) head_dim]``.

Tensor parallelism (``jaxlowbit.fsdp.apply`` on a mesh with a ``tensor`` axis, rules from
:func:`tensor_parallel_rules`): the residual stream, the embedding, the norms and the LM head work
on this device's ``B T / n`` token rows; each group of column-parallel projections (q, k, v; gate,
up; or the fused qkv, gate_up) reads the whole sequence, gathered once (8-bit when the group's input
arrives quantized from the norm), and computes this device's heads or hidden units; attention runs
over the whole sequence with the local heads; the row-parallel projections (attention output, down)
reduce-scatter their output back to the token rows. A fused kernel is split by its groups
(``jaxlowbit.parallel.ColumnGroups``): device ``d`` computes ``[q_d | k_d | v_d]`` (whole heads) and
``[gate_d | up_d]`` (each gate unit next to its up unit), at the price of one all-gather of the
kernel over ``tensor`` per call (``fused_projections=False`` moves no weights over ``tensor``). The
parameters are the same on every mesh, so checkpoints move between meshes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxlowbit
import jaxlowbit.fused
from jaxlowbit.interception import LayerFilter
from jaxlowbit.operand import is_low_bit
from jaxlowbit.execution import ExecutionOptions, resolve
from jaxlowbit.parallel.tensor import COLUMN, FEATURES, ROW, ColumnGroups, TensorParallel, TensorSplit
from jaxlowbit_numerics.stats import Split
from pallas_kernels import policy
from pallas_kernels.quantize import GATE_ACTIVATIONS
from train import kv_cache

# Named rematerialization policies (``ModelConfig.remat_policy``). "none" does not wrap the
# block at all; the others are ``jax.checkpoint_policies`` that say what the backward may
# keep from the forward instead of recomputing it.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# cuDNN flash attention takes 16-bit inputs and head dims that are multiples of 8 up to 128
# (jax.nn.dot_product_attention / cuDNN frontend limits); "auto" uses XLA otherwise.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ATTENTION_INPUTS = ("qkv", "q", "k", "v")  # the projections that carry biases with attention_bias
CUDNN_MAX_HEAD_DIM = 128
CUDNN_HEAD_DIM_MULTIPLE = 8
# Where the BitNet norms sit (ModelConfig.bitnet_norm_placement). "sub": the published BitNet b1.58
# architecture (paper, Hugging Face BitNetForCausalLM, llama.cpp "bitnet"): the pre-norms, plus one
# norm on the attention output before its projection and one on the MLP's hidden activation before
# down. "every_projection": torchao's model surgery, an RMSNorm before every BitNet projection.
BITNET_NORM_PLACEMENTS = ("sub", "every_projection")
SUB_NORM_PROJECTIONS = ("out", "down")  # the projections that get a sub-norm under "sub"
MLP_ACTIVATIONS = GATE_ACTIVATIONS  # act of the gated MLP down(act(gate(x)) * up(x)): "silu", "relu2"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the decoder (hashable: it is a Linen module attribute).

  Attributes:
    vocab_size: rows of the embedding and columns of the LM head.
    d_model: residual width.
    n_layers: number of blocks.
    n_heads: query heads; ``head_dim = d_model // n_heads``.
    n_kv_heads: key/value heads (grouped-query attention); divides ``n_heads``.
    d_ff: hidden width of the gated MLP.
    mlp_activation: the MLP's ``act`` in ``down(act(gate(x)) * up(x))``: ``"silu"`` (SwiGLU) or
      ``"relu2"`` (squared ReLU ``max(x, 0)^2``, BitNet b1.58 2B4T); computed in float32.
    rope_theta: RoPE base frequency.
    rope_scaling: ``()`` (none) or Llama 3's frequency scaling ``(factor, low_freq_factor,
      high_freq_factor, original_max_position_embeddings)``.
    attention_bias: the q, k and v projections have biases (Qwen2); the output projection never.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: LM head is the transposed embedding (always high precision).
    dtype: compute dtype of activations and high-precision matmuls.
    param_dtype: dtype of the stored (master) parameters.
    init_std: std of the normal init of embeddings and projections; the two projections
      that write into the residual (``attn.out``, ``mlp.down``) use ``init_std /
      sqrt(2 n_layers)`` (GPT-2) so the residual's variance does not grow with depth.
    dropout_rate: residual dropout, active only when a ``"dropout"`` rng is passed.
    scan_layers: stack blocks with ``nn.scan`` (else a Python loop, ``layers_0``...).
    remat_policy: a key of :data:`REMAT_POLICIES`.
    attention_impl: ``"auto"`` (cuDNN on GPU where it applies, XLA elsewhere), ``"xla"``
      or ``"cudnn"``.
    fused_projections: one ``qkv`` and one ``gate_up`` matmul instead of ``q, k, v`` and
      ``gate, up`` (fewer, larger GEMMs and one activation quantization instead of three).
    recipe: a jaxlowbit recipe, or None for a high-precision model.
    quantize_attention, quantize_mlp, quantize_lm_head: which projections use ``recipe``.
    filter_fqns: projections whose path contains any of these strings stay high precision.
    bitnet_norms: add the BitNet norms (where: ``bitnet_norm_placement``); False: none.
    bitnet_norm_placement: ``"every_projection"``: an RMSNorm ``<projection>_norm`` before every
      BitNet projection (torchao's surgery); ``"sub"``: the published BitNet b1.58 sub-norms, only
      ``attn.out_norm`` (width ``n_heads head_dim``) and ``mlp.down_norm`` (width ``d_ff``).
    fused_quantizers: a quantized projection's input is quantized by the op that produces it
      (RMSNorm, SwiGLU: ``jaxlowbit.fused``) instead of after it; the same numbers, one pass
      fewer. Off for models whose linears were converted for inference.
  """

  vocab_size: int = 384
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int = 768
  mlp_activation: str = "silu"
  rope_theta: float = 10_000.0
  rope_scaling: tuple[float, ...] = ()
  attention_bias: bool = False
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02
  dropout_rate: float = 0.0
  scan_layers: bool = True
  remat_policy: str = "none"
  attention_impl: str = "auto"
  fused_projections: bool = True
  recipe: Any = None
  quantize_attention: bool = True
  quantize_mlp: bool = True
  quantize_lm_head: bool = False
  filter_fqns: tuple[str, ...] = ()
  bitnet_norms: bool = True
  bitnet_norm_placement: str = "every_projection"
  fused_quantizers: bool = True

  def __post_init__(self):
    jaxlowbit.recipes.check_recipe(self.recipe, "ModelConfig")
    if self.d_model % self.n_heads:
      raise ValueError(f"ModelConfig: d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")
    if len(self.rope_scaling) not in (0, 4):
      raise ValueError("ModelConfig: rope_scaling is () or (factor, low_freq_factor, high_freq_factor, "
                       f"original_max_position_embeddings), got {self.rope_scaling!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig: remat_policy={self.remat_policy!r}; choose one of {sorted(REMAT_POLICIES)}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig: attention_impl={self.attention_impl!r}; choose one of {ATTENTION_IMPLS}")
    if self.bitnet_norm_placement not in BITNET_NORM_PLACEMENTS:
      raise ValueError(f"ModelConfig: bitnet_norm_placement={self.bitnet_norm_placement!r}; choose one of "
                       f"{BITNET_NORM_PLACEMENTS}")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"ModelConfig: mlp_activation={self.mlp_activation!r}; choose one of {MLP_ACTIVATIONS}")
    if self.tie_embeddings and self.quantize_lm_head and self.recipe is not None:
      raise ValueError("ModelConfig: a tied LM head is the embedding table and stays high precision; "
                       "set quantize_lm_head=False or tie_embeddings=False")
    LayerFilter(self.filter_fqns)  # TypeError / ValueError for a string or an empty entry

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def recipe_for(self, path: str):
    """The recipe of the projection at ``path`` (e.g. ``"layers.mlp.down"``), or None."""
    if self.recipe is None or LayerFilter(self.filter_fqns).keeps(path):
      return None
    kind = path.split(".")[-2] if "." in path else path
    wanted = {"attn": self.quantize_attention, "mlp": self.quantize_mlp, "lm_head": self.quantize_lm_head}
    if kind not in wanted:
      raise ValueError(f"recipe_for: unknown projection path {path!r}")
    return self.recipe if wanted[kind] else None

  def fused_input_recipe(self, *paths: str):
    """The recipe the op feeding the projections at ``paths`` quantizes its output for, or None.

    None unless fusion is on and every one of them runs the same recipe, that recipe takes a
    pre-quantized input, and no BitNet norm sits in between (that norm is fused instead).
    """
    recipes = {self.recipe_for(path) for path in paths}
    if not self.fused_quantizers or len(recipes) != 1 or any(self.norm_before(path) for path in paths):
      return None
    recipe = recipes.pop()
    return recipe if recipe is not None and recipe.input_quantization() is not None else None

  def linears_read(self, paths, execution: ExecutionOptions | None = None) -> bool:
    """Whether the projections at ``paths`` read their input as given: no norm of their own before them and no
    tensor-parallel gather (``jaxlowbit.fused.rms_norm_for``'s ``linears``: a decode norm may then hand them codes)."""
    return _tensor_parallel(execution) is None and not any(self.norm_before(path) for path in paths)

  def own_norm_recipe(self, path: str):
    """What the projection's own norm (:meth:`norm_before`) quantizes its output for: the projection's
    recipe when the model fuses quantizers, else None (the norm writes ``dtype``, the Dense quantizes)."""
    return self.recipe_for(path) if self.fused_quantizers else None

  def gather_recipe(self, *paths: str):
    """How a column-parallel group's shared input travels in its tensor-parallel gather: the recipe
    ``paths`` have in common (8-bit where it arrives quantized for it), else None (``dtype``)."""
    recipes = {self.recipe_for(path) for path in paths}
    return recipes.pop() if len(recipes) == 1 else None

  def gate_up_measured(self, execution: ExecutionOptions | None) -> bool:
    """Whether the fused gate_up projection returns a :class:`jaxlowbit.operand.MeasuredOutput` to the down
    projection's own norm (BitNet's ``ffn_sub_norm``), whose fused backward measures ``d gate_up``'s amaxes as it
    writes it (``pallas_kernels.policy.MEASURED_GRADIENTS``; not under tensor parallelism, whose sub-norm runs
    unfused)."""
    down, gate_up = "layers.mlp.down", "layers.mlp.gate_up"
    return (policy.MEASURED_GRADIENTS and self.fused_projections and self.norm_before(down)
            and self.recipe_for(gate_up) is not None and _tensor_parallel(execution) is None
            and jaxlowbit.fused.fused_quantization(self.own_norm_recipe(down), execution) is not None)

  def norm_before(self, path: str) -> bool:
    """Whether the projection at ``path`` gets its own RMSNorm ``<name>_norm`` (the BitNet norms).

    Only BitNet projections do; under ``bitnet_norm_placement="sub"`` only ``attn.out`` and ``mlp.down``.
    """
    recipe = self.recipe_for(path)
    if not self.bitnet_norms or recipe is None or not recipe.norm_before_linear:
      return False
    return self.bitnet_norm_placement == "every_projection" or path.split(".")[-1] in SUB_NORM_PROJECTIONS


# How tensor parallelism splits each projection (by name; jaxlowbit.fsdp.tensor): column-parallel
# projections compute this device's heads / hidden units of the whole sequence (the fused qkv and
# gate_up: of each of their groups), row-parallel ones read them and reduce-scatter. The LM head
# and the norms are not split.
TENSOR_PARALLEL = {"q": COLUMN, "k": COLUMN, "v": COLUMN, "out": ROW, "gate": COLUMN, "up": COLUMN, "down": ROW,
                   "qkv": COLUMN, "gate_up": COLUMN}


def output_groups(config: ModelConfig, name: str) -> tuple[int, ...]:
  """The output groups of a fused projection (``qkv``: q, k, v widths; ``gate_up``: gate, up), else ``()``."""
  q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
  return {"qkv": (q, kv, kv), "gate_up": (config.d_ff, config.d_ff)}.get(name, ())


def tensor_parallel_rules(config: ModelConfig) -> dict:
  """The ``jaxlowbit.fsdp.plan_for_model(tensor_parallel=...)`` rules of this model: every split
  projection, and the BitNet norms in front of row-parallel ones (over the features they split).
  A fused projection is column-parallel by its groups (:func:`output_groups`)."""
  rules = {}
  for path in projection_paths(config):
    kind, name = path.split(".")[-2:] if "." in path else ("", path)
    if name not in TENSOR_PARALLEL:
      continue
    groups = output_groups(config, name)
    rules[f"{kind}.{name}"] = ColumnGroups(groups) if groups else TENSOR_PARALLEL[name]
    if TENSOR_PARALLEL[name] is ROW and config.norm_before(path):
      rules[f"{kind}.{name}_norm"] = FEATURES
  return rules


def projection_paths(config: ModelConfig) -> dict[str, tuple[int, int]]:
  """Every projection's path -> ``(in_features, out_features)`` (one layer's; LM head included)."""
  d, hd = config.d_model, config.head_dim
  q, kv = config.n_heads * hd, config.n_kv_heads * hd
  if config.fused_projections:
    attn = {"layers.attn.qkv": (d, q + 2 * kv)}
    mlp = {"layers.mlp.gate_up": (d, 2 * config.d_ff)}
  else:
    attn = {"layers.attn.q": (d, q), "layers.attn.k": (d, kv), "layers.attn.v": (d, kv)}
    mlp = {"layers.mlp.gate": (d, config.d_ff), "layers.mlp.up": (d, config.d_ff)}
  paths = {**attn, "layers.attn.out": (q, d), **mlp, "layers.mlp.down": (config.d_ff, d)}
  if not config.tie_embeddings:
    paths["lm_head"] = (d, config.vocab_size)
  return paths


def param_count(config: ModelConfig) -> dict[str, int]:
  """Parameter counts from the config alone (tested against the real tree).

  Returns:
    ``{"total", "embedding", "matmul"}``: ``matmul`` counts the weights that take part in a
    matmul per token (every projection, and the embedding table when it is the tied LM head);
    it is the ``N`` of the ``6 N`` training-FLOPs rule.
  """

  def bitnet_norm(path: str) -> bool:
    return config.norm_before(path)

  layer_linear = layer_norms = head_linear = head_norm = 0
  for path, (k, n) in projection_paths(config).items():
    if path == "lm_head":
      head_linear, head_norm = k * n, k if bitnet_norm(path) else 0
    else:
      layer_linear += k * n
      layer_norms += k if bitnet_norm(path) else 0
  layer_norms += 2 * config.d_model  # attn_norm, mlp_norm
  embedding = config.vocab_size * config.d_model
  final_norm = config.d_model
  total = embedding + config.n_layers * (layer_linear + layer_norms) + final_norm + head_linear + head_norm
  matmul = config.n_layers * layer_linear + (embedding if config.tie_embeddings else head_linear)
  return {"total": total, "embedding": embedding, "matmul": matmul}


# Causal attention does QK^T and PV over half of the T x T score matrix: per token and layer
# 2 matmuls x 2 FLOPs x T/2 keys x n_heads x head_dim in the forward, x3 for fwd + bwd.
CAUSAL_ATTENTION_FRACTION = 0.5


def train_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Model FLOPs of one training token (forward + backward, no rematerialization).

  ``6 N`` for the matmul weights (``param_count(...)["matmul"]``: 2 FLOPs per weight in the
  forward, 4 in the backward) plus attention's score and value matmuls, ``6 * 2 * n_layers *
  n_heads * head_dim * seq_len * 0.5`` (PaLM appendix B, halved for the causal mask, which
  cuDNN skips). Recomputation under remat is not counted: this is *model* FLOPs, so MFU stays
  comparable between remat policies.
  """
  matmul = 6 * param_count(config)["matmul"]
  attention = 6 * 2 * config.n_layers * config.n_heads * config.head_dim * seq_len * CAUSAL_ATTENTION_FRACTION
  return float(matmul + attention)


def rope_frequencies(head_dim: int, theta: float, scaling: tuple[float, ...] = ()) -> jax.Array:
  """float32 ``[head_dim / 2]`` angular frequencies ``theta^(-2i / head_dim)``.

  ``scaling = (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)``
  applies Llama 3's long-context rule: wavelengths longer than ``original / low_freq_factor``
  are stretched by ``factor``, those shorter than ``original / high_freq_factor`` kept, and the
  band in between interpolated linearly in ``original / wavelength``.
  """
  half = head_dim // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if not scaling:
    return freqs
  factor, low, high, original = scaling
  wavelength = 2 * math.pi / freqs
  blend = jnp.clip((original / wavelength - low) / (high - low), 0.0, 1.0)  # 0: stretch, 1: keep
  return (1 - blend) * freqs / factor + blend * freqs


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: tuple[float, ...] = ()) -> jax.Array:
  """Rotary position embedding (rotate-half form, as Hugging Face Llama checkpoints expect).

  Args:
    x: ``[B, T, heads, head_dim]`` queries or keys (head_dim even).
    positions: ``[T]`` int32 token positions.
    theta: base frequency.
    scaling: Llama 3 frequency scaling (:func:`rope_frequencies`), or ``()``.

  Returns:
    ``x`` rotated, same shape and dtype (angles computed in float32):
    ``[x1 cos - x2 sin, x2 cos + x1 sin]`` for the halves ``x1, x2`` of ``head_dim``. Computed on
    ``x`` viewed as ``[..., 2, head_dim / 2]`` with the halves swapped by a reverse, so XLA fuses
    it into one elementwise pass with no concatenate (forward or backward).
  """
  half = x.shape[-1] // 2
  freqs = rope_frequencies(x.shape[-1], theta, tuple(scaling))
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [T, half]
  cos = jnp.cos(angles)[None, :, None, None, :]  # [1, T, 1, 1, half]
  sin = jnp.sin(angles)
  signed_sin = jnp.stack([-sin, sin], axis=-2)[None, :, None]  # [1, T, 1, 2, half]: -sin for x1's half
  halves = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, half)
  rotated = halves * cos + halves[..., ::-1, :] * signed_sin
  return rotated.reshape(x.shape).astype(x.dtype)


def attention_impl(config: ModelConfig) -> str:
  """The ``implementation=`` passed to ``jax.nn.dot_product_attention`` for this config.

  ``"auto"`` picks cuDNN flash attention on GPU when dtype and head_dim allow it and XLA
  everywhere else (``implementation=None`` in jax 0.10 means XLA, so it is never passed).
  """
  if config.attention_impl != "auto":
    return config.attention_impl
  on_gpu = jax.default_backend() == "gpu"
  head_ok = config.head_dim <= CUDNN_MAX_HEAD_DIM and config.head_dim % CUDNN_HEAD_DIM_MULTIPLE == 0
  return "cudnn" if on_gpu and jnp.dtype(config.dtype) in CUDNN_DTYPES and head_ok else "xla"


class RMSNorm(nn.Module):
  """``flax.linen.RMSNorm``'s parameter (``scale [C]``, ones) and numerics; optionally quantizing its
  output for the linear that reads it (``jaxlowbit.fused.rms_norm_for``)."""

  epsilon: float
  dtype: Any
  param_dtype: Any
  execution: ExecutionOptions | None = None

  @nn.compact
  def __call__(self, x: jax.Array, quantize_for=None, split=None, gated: str | None = None,
               residual: jax.Array | None = None, linears: bool = False):
    """``x [..., C]`` -> ``[..., C]`` of ``dtype``, or a ``[M, C]`` low-bit operand for ``quantize_for``.

    ``split``: how this device's x is split under tensor parallelism (``jaxlowbit.fused``); with
    its features split (the input of a row-parallel projection), x and the scale hold ``C / n``.
    ``gated``: x is a gated MLP's ``gate_up [..., 2C]`` and the norm reads ``act(gate) * up`` with
    this activation (``jaxlowbit.fused.swiglu_rms_norm_for``: BitNet's ``ffn_sub_norm``, whose backward
    then runs as one pass with the activation's).
    ``residual``: a pre-norm of the residual sum ``x + residual``; returns ``(normed, x + residual)``
    (``jaxlowbit.fused.add_rms_norm_for``: one launch at decode).
    ``linears``: projections read the output directly (``jaxlowbit.fused.rms_norm_for``): a decode step of a
    model converted for W8A8 hands them int8 codes.
    """
    width = x.shape[-1] // 2 if gated else x.shape[-1]
    if split is not None and split.cols:  # the stored scale is this device's share: no init shape to check
      scale = self.get_variable("params", "scale")
    else:
      scale = self.param("scale", nn.initializers.ones, (width,), self.param_dtype)
    if gated:
      return jaxlowbit.fused.swiglu_rms_norm_for(x, scale, self.epsilon, quantize_for, self.dtype, split, gated,
                                                 options=self.execution)
    if residual is not None:
      return jaxlowbit.fused.add_rms_norm_for(x, residual, scale, self.epsilon, quantize_for, self.dtype, split,
                                              options=self.execution, linears=linears)
    return jaxlowbit.fused.rms_norm_for(x, scale, self.epsilon, quantize_for, self.dtype, split,
                                        options=self.execution, linears=linears)


def rms_norm(config: ModelConfig, name: str, execution: ExecutionOptions | None = None) -> RMSNorm:
  return RMSNorm(epsilon=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype, execution=execution,
                 name=name)


# ---------------------------------------------------------------------------------------------
# A projection, one concern per function (projection() and group_projections() compose them):
#
#   norm placement    ModelConfig.norm_before      which RMSNorm, if any, sits right before it
#                     own_norm                     applies it
#   quantizer choice  ModelConfig.own_norm_recipe  what its own norm quantizes for
#                     ModelConfig.fused_input_recipe  what a shared producer (pre-norm, activation) does
#                     ModelConfig.gather_recipe    how a column-parallel group's input travels
#   parallel layout   ProjectionLayout             its split role, the gather, how its producer is split
#   layer             dense                        the jaxlowbit Dense of its recipe


def _tensor_parallel(execution: ExecutionOptions | None) -> TensorParallel | None:
  """The tensor-parallel context the model runs under, or None: the model's one read of it. It comes in
  the model's ``execution`` field, which ``jaxlowbit.parallel.apply`` sets (``jaxlowbit.ExecutionOptions``)."""
  return None if execution is None else execution.tensor_parallel


@dataclasses.dataclass(frozen=True)
class ProjectionLayout:
  """How one projection's input is laid out over the tensor axis (all no-ops when ``tp`` is None).

  Attributes:
    tp: the tensor-parallel context, or None.
    role: ``COLUMN`` (reads the whole sequence, computes this device's heads or hidden units), ``ROW``
      (reads this device's features ``[M, K / n]``, reduce-scatters to its token rows) or None (not
      split, e.g. the LM head).
    gathered: the caller gathered the input already (a column-parallel group shares one gather).
  """

  tp: TensorParallel | None
  role: TensorSplit | None
  gathered: bool = False

  @classmethod
  def of(cls, path: str, execution: ExecutionOptions | None, gathered: bool = False) -> ProjectionLayout:
    tp = _tensor_parallel(execution)
    return cls(tp, TENSOR_PARALLEL.get(path.split(".")[-1]) if tp is not None else None, gathered)

  @property
  def input_split(self) -> Split | None:
    """How the op producing the input holds its rows (its quantizer reduces over the split): this
    device's features before a row-parallel projection, its tokens before a gather, else None."""
    if self.role is ROW:
      return self.tp.feature_split
    return self.tp.token_split if self.role is COLUMN and not self.gathered else None

  def gather(self, x, recipe):
    """A column-parallel projection's input gathered to the whole sequence (8-bit where ``recipe``
    reads it so) unless the caller did; anything else unchanged."""
    return self.tp.gather(x, recipe) if self.role is COLUMN and not self.gathered else x


def own_norm(config: ModelConfig, x, path: str, layout: ProjectionLayout, execution: ExecutionOptions | None = None):
  """``x`` through the projection's own RMSNorm ``<name>_norm`` where :meth:`ModelConfig.norm_before`
  places one (quantized for the projection per :meth:`ModelConfig.own_norm_recipe`), else ``x``."""
  if not config.norm_before(path):
    return x
  norm = rms_norm(config, f"{path.split('.')[-1]}_norm", execution)
  return norm(x, quantize_for=config.own_norm_recipe(path), split=layout.input_split)


def dense(config: ModelConfig, path: str, features: int, std: float,
          execution: ExecutionOptions | None = None, measured: bool = False, gated: str | None = None) -> nn.Module:
  """The jaxlowbit Dense of the projection at ``path`` (its recipe's, or high precision), named by its last part
  (``measured``: :attr:`jaxlowbit.LowBitDense.measured`; ``gated``: :attr:`jaxlowbit.LowBitDense.gated`)."""
  name = path.split(".")[-1]
  return jaxlowbit.dense_for(
      config.recipe_for(path),
      features=features,
      use_bias=config.attention_bias and name in ATTENTION_INPUTS,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
      kernel_init=nn.initializers.normal(std),
      name=name,
      execution=execution,
      gated=gated,
      **({"measured": True} if measured else {}),
  )


def projection(config: ModelConfig, x, path: str, features: int, std: float, gathered: bool = False,
               execution: ExecutionOptions | None = None, normed: bool = False, measured: bool = False,
               gated: str | None = None) -> jax.Array:
  """One linear ``x [..., K] -> [..., features]`` named by the last part of ``path``: its own norm (BitNet),
  the tensor-parallel gather, the Dense.

  ``x`` may be a ``[M, K]`` low-bit operand from a fused producer (the output is then ``[M,
  features]``). ``normed``: the caller applied the projection's own norm already (the MLP's
  ``down_norm`` with the gated activation). ``measured``: return the Dense's
  :class:`jaxlowbit.operand.MeasuredOutput` (:meth:`ModelConfig.gate_up_measured`). ``gated``: the gated MLP's
  ``act(gate) * up`` of the output instead (:attr:`jaxlowbit.LowBitDense.gated`, ``[..., features / 2]``). Must be
  called inside a compact method (the layers attach to that module).

  Tensor parallelism: a column-parallel projection reads the whole sequence; unless the caller
  ``gathered`` x for its group, it gathers it here (after its own norm) and returns this device's
  ``features / n`` for all tokens. A row-parallel one reads ``[M, K / n]`` (its norm over the split
  features) and returns this device's ``[M / n, features]`` token rows.
  """
  layout = ProjectionLayout.of(path, execution, gathered)
  if not normed:
    x = own_norm(config, x, path, layout, execution)
  x = layout.gather(x, config.recipe_for(path))
  return dense(config, path, features, std, execution, measured, gated)(x)


def group_projections(config: ModelConfig, x, paths: dict[str, int], std: float,
                      execution: ExecutionOptions | None = None) -> list[jax.Array]:
  """The projections ``{path: features}`` that read one input ``x`` (q, k, v; gate, up), in order.

  Under tensor parallelism x holds this device's token rows and the group is column-parallel: x
  is gathered to the whole sequence once for the projections without a norm of their own
  (:meth:`ModelConfig.gather_recipe`); those with one normalize their own input and gather it each.
  """
  tp = _tensor_parallel(execution)
  shared = [p for p in paths if not config.norm_before(p)] if tp is not None else []
  if shared:
    x_whole = tp.gather(x, config.gather_recipe(*shared))
  return [projection(config, x_whole if path in shared else x, path, n, std, gathered=path in shared,
                     execution=execution) for path, n in paths.items()]


class Attention(nn.Module):
  """Grouped-query causal self-attention with RoPE (``decode``: keys and values from a KV cache)."""

  config: ModelConfig
  decode: bool = False
  execution: ExecutionOptions | None = None
  kv_cache_dtype: str = "auto"  # decode: train.kv_cache.KV_CACHE_DTYPES

  @nn.compact
  def __call__(self, x, positions: jax.Array) -> jax.Array:
    """``x [B, T, d_model]`` (dtype; or its ``[B T, d_model]`` low-bit operand), ``positions [T]`` ->
    ``[B T, d_model]`` (dtype). Tensor-parallel: x and the result are this device's ``[B T / n,
    d_model]`` token rows; attention runs over the whole sequences with this device's heads."""
    c, e = self.config, self.execution
    t, hd, q_dim, kv_dim = positions.shape[0], c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def output(out):  # [B, T, heads, head_dim] -> the output projection
      return projection(c, out.reshape(-1, out.shape[2] * hd), "layers.attn.out", c.d_model, _residual_std(c),
                        execution=e)

    if c.fused_projections:
      qkv = projection(c, x, "layers.attn.qkv", q_dim + 2 * kv_dim, c.init_std, execution=e)
      if self.decode and kv_cache.fused_step_runs(self, t, c.n_heads, c.n_kv_heads, hd,
                                                  resolve(e).dispatch()):  # RoPE, cache write, attention: one kernel
        return output(kv_cache.attend_step(self, qkv.reshape(-1, c.n_heads + 2 * c.n_kv_heads, hd), positions,
                                           c.n_heads, rope_frequencies(hd, c.rope_theta, tuple(c.rope_scaling))))
      n = 1 if _tensor_parallel(e) is None else _tensor_parallel(e).size  # tensor-parallel: [q_d | k_d | v_d]
      q, k, v = jnp.split(qkv, [q_dim // n, (q_dim + kv_dim) // n], axis=-1)
    else:
      q, k, v = group_projections(c, x, {"layers.attn.q": q_dim, "layers.attn.k": kv_dim, "layers.attn.v": kv_dim},
                                  c.init_std, e)
    # [B, T, heads, head_dim]; under tensor parallelism this device's heads (of the whole sequence)
    q = rope(q.reshape(-1, t, q.shape[-1] // hd, hd), positions, c.rope_theta, c.rope_scaling)
    k = rope(k.reshape(-1, t, k.shape[-1] // hd, hd), positions, c.rope_theta, c.rope_scaling)
    v = v.reshape(-1, t, v.shape[-1] // hd, hd)
    # decode: the whole cache after this call's write (None while initializing, which allocates it)
    cached = kv_cache.update(self, k, v, positions, self.kv_cache_dtype) if self.decode else None
    with jax.named_scope("attention_core"):
      if cached is None:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_impl(c))
      else:
        out = kv_cache.attend(q, cached)
    return output(out)


class Mlp(nn.Module):
  """Gated MLP ``down(act(gate(x)) * up(x))``: SwiGLU (act silu) or squared ReLU (``mlp_activation``);
  act and the product in float32.

  ``decode``: a decode step's MLP. Where its execution options say so (``ExecutionOptions.gated_outputs``: a model
  converted for ternary or W8A16), its fused gate_up projection returns ``act(gate) * up`` itself
  (:attr:`jaxlowbit.LowBitDense.gated`), which the converted GEMV forms in its epilogue: the kernel after it
  (BitNet's ``ffn_sub_norm``, else the down projection) reads ``d_ff`` values a token, not ``2 d_ff``, and computes
  no activation. The same numbers (W8A16: within its bf16 rounding).
  """

  config: ModelConfig
  execution: ExecutionOptions | None = None
  decode: bool = False

  def gated_up(self) -> bool:
    """Whether the gate_up projection returns the gated activation (:class:`Mlp`'s ``decode``): the options ask for
    it, a fused projection, no tensor parallelism, and the activation not quantized on the way to the down
    projection (its recipe's ``swiglu_for``) except by BitNet's own norm."""
    c, down = self.config, "layers.mlp.down"
    unquantized = (c.norm_before(down)
                   or jaxlowbit.fused.fused_quantization(c.fused_input_recipe(down), self.execution) is None)
    return (self.decode and resolve(self.execution).gated_outputs and c.fused_projections
            and _tensor_parallel(self.execution) is None and unquantized)

  @nn.compact
  def __call__(self, x) -> jax.Array:
    """``x [..., d_model]`` (or its ``[M, d_model]`` low-bit operand) -> ``[M, d_model]`` (``M``: the
    tokens; tensor-parallel: this device's token rows, the hidden units split over the devices)."""
    c, e = self.config, self.execution
    down = "layers.mlp.down"
    split = ProjectionLayout.of(down, e).input_split
    if self.gated_up():  # act(gate) * up from the projection itself, then the down projection's own norm if any
      h = projection(c, x, "layers.mlp.gate_up", 2 * c.d_ff, c.init_std, execution=e, gated=c.mlp_activation)
      if c.norm_before(down):
        h = rms_norm(c, "down_norm", e)(h, quantize_for=c.own_norm_recipe(down), split=split)
    else:
      if c.fused_projections:  # tensor-parallel: [gate_d | up_d], this device's hidden units
        gate_up = projection(c, x, "layers.mlp.gate_up", 2 * c.d_ff, c.init_std, execution=e,
                             measured=c.gate_up_measured(e))
      else:
        gate, up = group_projections(c, x, {"layers.mlp.gate": c.d_ff, "layers.mlp.up": c.d_ff}, c.init_std, e)
        gate_up = jnp.concatenate([gate, up], axis=-1)
      if c.norm_before(down):  # its own norm (BitNet's ffn_sub_norm) reads the gated activation: one producer
        h = rms_norm(c, "down_norm", e)(gate_up, quantize_for=c.own_norm_recipe(down), split=split,
                                        gated=c.mlp_activation)
      else:
        h = jaxlowbit.fused.swiglu_for(gate_up, c.fused_input_recipe(down), split=split,
                                       activation=c.mlp_activation, options=e)
    return projection(c, h if is_low_bit(h) else h.reshape(-1, h.shape[-1]), down, c.d_model, _residual_std(c),
                      execution=e, normed=c.norm_before(down))


def _residual_std(config: ModelConfig) -> float:
  return config.init_std / math.sqrt(2 * config.n_layers)


def pre_norm(norm: RMSNorm, x, **kwargs) -> tuple[Any, jax.Array]:
  """``(norm(residual stream), residual stream)`` of ``x``: the stream ``[..., C]``, or a deferred ``(x, delta)``
  pair (:class:`Block`'s ``defer_residual``) whose sum the norm forms as it normalizes."""
  if isinstance(x, tuple):
    return norm(x[0], residual=x[1], **kwargs)
  return norm(x, **kwargs), x


class Block(nn.Module):
  """Pre-norm decoder block; ``(x, positions) -> (x, None)`` so it can be scanned.

  ``defer_residual`` (decode with unrolled layers): the block returns ``((x, mlp_out), None)`` without the last
  residual add, and takes such a pair as its ``x``; the next pre-norm adds it as it normalizes (one launch at decode:
  ``jaxlowbit.fused.add_rms_norm_for``). The same numbers either way.
  """

  config: ModelConfig
  decode: bool = False
  execution: ExecutionOptions | None = None
  kv_cache_dtype: str = "auto"
  defer_residual: bool = False

  @nn.compact
  def __call__(self, x, positions: jax.Array) -> tuple[Any, None]:
    """``x [B, T, d_model]`` (tensor-parallel: this device's ``[B T / n, d_model]`` token rows; or a deferred
    ``(x, delta)`` pair), ``positions [T]``."""
    c = self.config
    dropout = nn.Dropout(c.dropout_rate, deterministic=c.dropout_rate == 0 or not self.has_rng("dropout"))
    attn_paths = ("layers.attn.qkv",) if c.fused_projections else ("layers.attn.q", "layers.attn.k", "layers.attn.v")
    mlp_paths = ("layers.mlp.gate_up",) if c.fused_projections else ("layers.mlp.gate", "layers.mlp.up")
    e = self.execution
    # The pre-norms produce (and may quantize) the input of a column-parallel group: this device's tokens.
    h, x = pre_norm(rms_norm(c, "attn_norm", e), x, quantize_for=c.fused_input_recipe(*attn_paths),
                    split=ProjectionLayout.of(attn_paths[0], e).input_split, linears=c.linears_read(attn_paths, e))
    attn = dropout(Attention(c, self.decode, e, self.kv_cache_dtype, name="attn")(h, positions).reshape(x.shape))
    h, x = rms_norm(c, "mlp_norm", e)(x, quantize_for=c.fused_input_recipe(*mlp_paths),
                                      split=ProjectionLayout.of(mlp_paths[0], e).input_split, residual=attn,
                                      linears=c.linears_read(mlp_paths, e))
    mlp = dropout(Mlp(c, e, self.decode, name="mlp")(h).reshape(x.shape))
    return ((x, mlp) if self.defer_residual else x + mlp), None


class Transformer(nn.Module):
  """The decoder: ``tokens [B, T] int32 -> logits [B, T, vocab_size] float32``.

  ``decode=True`` runs incrementally from a KV cache (the ``"cache"`` collection, see
  :mod:`train.kv_cache`): initializing with ``[B, max_len]`` tokens sizes the cache, and each
  apply with ``mutable=["cache"]`` appends its tokens at the positions after those already seen.
  ``kv_cache_dtype``: ``"auto"`` keeps keys and values in the compute dtype, ``"int8"`` in int8 with
  one scale per token and kv head (about half the bytes, dequantized inside attention).

  ``execution`` (:class:`jaxlowbit.ExecutionOptions`, None: the defaults) is how the model runs: the
  kernels' backend, its producers' fused quantizers, and its tensor-parallel context. It is handed to
  every block, layer and producer; ``jaxlowbit.parallel.apply`` sets its ``tensor_parallel`` and
  ``jaxlowbit.inference.convert_for_inference`` turns the fused quantizers off, each by ``clone``.
  """

  config: ModelConfig
  decode: bool = False
  execution: ExecutionOptions | None = None
  kv_cache_dtype: str = "auto"

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """``tokens [B, T]`` -> ``[B, T, vocab_size]`` float32; tensor-parallel (``jaxlowbit.fsdp.apply`` on a
    mesh with a tensor axis): the logits of this device's ``B T / n`` token rows, ``[B T / n, vocab_size]``."""
    c, e = self.config, self.execution
    tp = _tensor_parallel(e)
    if tp is not None and self.decode:
      raise ValueError("Transformer: decoding with a KV cache runs on one device, not tensor-parallel")
    kv_cache.check_kv_cache_dtype(self.kv_cache_dtype, "Transformer")
    embed = nn.Embed(
        c.vocab_size,
        c.d_model,
        embedding_init=nn.initializers.normal(c.init_std),
        dtype=c.dtype,
        param_dtype=c.param_dtype,
        name="embed",
    )
    x = embed(tokens if tp is None else tp.local_tokens(tokens))  # [B, T, D] or this device's [B T / n, D]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)  # the whole sequence's (attention sees all of it)
    if self.decode:
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      if not self.is_initializing():
        positions = positions + index.value
        index.value = index.value + tokens.shape[1]

    block = Block
    policy = REMAT_POLICIES[c.remat_policy]
    if c.remat_policy != "none":
      block = nn.remat(Block, policy=policy, prevent_cse=not c.scan_layers)
    if c.scan_layers:
      stack = nn.scan(
          block,
          variable_axes={"params": 0, "cache": 0, "intermediates": 0},  # cache: decode; intermediates: sow
          split_rngs={"params": True, "dropout": True},
          in_axes=nn.broadcast,
          length=c.n_layers,
      )
      x, _ = stack(c, self.decode, e, self.kv_cache_dtype, name="layers")(x, positions)
    else:
      for i in range(c.n_layers):  # decode: each block's last residual add is done by the next norm
        x, _ = block(c, self.decode, e, self.kv_cache_dtype, self.decode, name=f"layers_{i}")(x, positions)

    quantize_for = None if c.tie_embeddings else c.fused_input_recipe("lm_head")
    # No decode codes for a high-precision lm_head (linears=False): conversions leave it unconverted by default.
    h, x = pre_norm(rms_norm(c, "final_norm", e), x, quantize_for=quantize_for)
    if c.tie_embeddings:
      logits = embed.attend(h)
    else:
      logits = projection(c, h, "lm_head", c.vocab_size, c.init_std, execution=e).reshape(*x.shape[:-1],
                                                                                           c.vocab_size)
    return logits.astype(jnp.float32)


__all__ = [
    "ModelConfig",
    "Transformer",
    "param_count",
    "projection_paths",
    "rope",
    "rope_frequencies",
    "output_groups",
    "tensor_parallel_rules",
    "train_flops_per_token",
]
