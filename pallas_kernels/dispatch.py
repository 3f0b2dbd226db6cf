"""The single dispatch point for jaxlowbit's low-bit kernels.

``jaxlowbit.quantized_matmul`` sends every quantization and every low-bit matmul of every
recipe (forward, grad_input, grad_weight) through the three functions here; which
implementation runs is decided here and nowhere else:

- :func:`quantize_rows`   ``[R, C]`` -> int8/fp8 ``[R, C]`` + one scale per row
- :func:`quantize_cols_t` ``[R, C]`` -> int8/fp8 ``[C, R]`` + one scale per column (transposed)
- :func:`fused_quantize`  both, of the output of an RMSNorm or SwiGLU that is never written
- :func:`swiglu_norm_grad` the backward of an RMSNorm of SwiGLU's output (BitNet's ffn_sub_norm) in one pass
- :func:`scaled_matmul`   ``[M, K] x [N, K]`` -> ``[M, N]`` with the scales applied
- :func:`norm_rows`       a decode-sized RMSNorm (of a residual sum or a gated activation) in one launch
- :func:`decode_attention` a decode step's RoPE, KV cache write and attention in one launch

and ``jaxlowbit.optim`` sends the Adam step of every block-wise quantized tensor through

- :func:`adam_update`     gradient + low-bit ``m``, ``v`` -> update + new ``m``, ``v``
- :func:`adam_step`       the same, written into the parameter -> new parameter, ``m``, ``v``

Backends:
- ``"xla"``: :mod:`pallas_kernels.reference` (XLA fusions).
- ``"pallas"``: the Pallas GPU kernels (Hopper wgmma GEMM, Triton-backend quantizers and
  fused optimizer update).

Every function takes a :class:`DispatchOptions`: the backend (``auto`` / ``xla`` / ``pallas``) that
:mod:`pallas_kernels.policy` decides under, and the operand split. They are plain arguments, read
when the function is traced; nothing here is global. A caller that passes none gets
``DispatchOptions.from_environment()`` (``$JAXLOWBIT_BACKEND``, read in ``policy.requested_backend``
and nowhere else); ``jaxlowbit`` always passes its own (``jaxlowbit.ExecutionOptions``). Which kernel
configuration runs a shape is :mod:`pallas_kernels.tuning`'s.

Split operands (tensor parallelism, inside ``jax.shard_map``): with ``options.split`` set, every
quantization treats its 2-D input as one tile of a matrix split over mesh axes
(:class:`~jaxlowbit_numerics.stats.Split`) and reduces its amaxes over the tiles, so each device
quantizes with the scale of the whole matrix. Tensor-parallel linears pass it for the parts of
their recipe whose operands are split (a recipe's code does not change); producers that quantize
on a device's share of an activation pass it for their quantization.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.adam import AdamCoefficients
from jaxlowbit_numerics.blockwise import BlockFormat, BlockQuantized
from jaxlowbit_numerics.stats import NO_SPLIT, Split
from pallas_kernels import adam as adam_kernels
from pallas_kernels import decode as decode_kernels
from pallas_kernels import policy
from pallas_kernels import quantize as quantize_kernels
from pallas_kernels import tuning
from pallas_kernels.policy import select_backend
from pallas_kernels.quantize import Identity, Prologue
from pallas_kernels.reference import check_operands, scaled_matmul_reference

__all__ = ["DispatchOptions", "adam_step", "adam_update", "decode_attention", "decode_attention_on_kernel",
           "fused_quantize", "norm_rows", "norm_rows_on_kernel",
           "prologue_values", "quantize_cols_t",
           "quantize_rows", "quantize_rows_and_cols_t", "scaled_matmul", "select_backend", "swiglu_norm_grad"]


@dataclasses.dataclass(frozen=True)
class DispatchOptions:
  """How a quantization or low-bit GEMM runs (frozen, hashable: a static argument under ``jit``).

  Attributes:
    backend: ``"auto"``, ``"xla"`` or ``"pallas"`` (:data:`pallas_kernels.policy.BACKENDS`).
    split: how the operand being quantized is split over mesh axes (module docstring);
      ``NO_SPLIT``: the quantization is local.
  """

  backend: str = "auto"
  split: Split = NO_SPLIT

  def __post_init__(self):
    policy.check_backend(self.backend)
    if not isinstance(self.split, Split):
      raise TypeError(f"DispatchOptions.split must be a jaxlowbit_numerics.stats.Split, got {self.split!r}")

  @classmethod
  def from_environment(cls) -> DispatchOptions:
    """The options of a caller that chose none: the backend ``$JAXLOWBIT_BACKEND`` names, no split."""
    return cls(backend=policy.requested_backend())

  def splitting(self, split: Split | None) -> DispatchOptions:
    """These options with the operand split as ``split`` says (None: local)."""
    return dataclasses.replace(self, split=split or NO_SPLIT)


def _resolve(options: DispatchOptions | None) -> DispatchOptions:
  """``options``, or the environment's where a caller passed none (the module's one edge)."""
  return DispatchOptions.from_environment() if options is None else options


# Every quantization and low-bit GEMM runs inside one of these scopes, so profiles
# (benchmarks/profile_step.py) and HLO dumps can attribute kernels and fusions to them.
QUANTIZE_SCOPE = "jaxlowbit_quantize"
GEMM_SCOPE = "jaxlowbit_gemm"
ADAM_SCOPE = "jaxlowbit_adam"


def fused_quantize(
    inputs: tuple[jax.Array, ...],
    prologue: Prologue,
    rows_spec: QuantSpec | None,
    cols_spec: QuantSpec | None = None,
    rows_t: bool = False,
    options: DispatchOptions | None = None,
    maxima: tuple[jax.Array, jax.Array] | None = None,
):
  """``prologue(*inputs)`` quantized per row and/or per column (transposed), without writing it.

  Args:
    inputs: the prologue's inputs: ``x [R, C]`` (``Identity``); ``x [R, C], gamma [C]``
      (``RmsNorm``); ``gate_up [R, 2H]`` (``SwiGLU``).
    prologue: a :mod:`pallas_kernels.quantize` prologue.
    rows_spec: per-row quantization ``(q [R, C'], float32 scale [R, 1] or [1, 1])``, or None.
    cols_spec: per-column quantization written transposed ``(q^T [C', R], scale [C', 1] or [1, 1])``.
    rows_t: the rows' int8 codes written transposed instead (``(q^T [C', R], scale [1, R])``).
    options: backend and operand split (:class:`DispatchOptions`).
    maxima: the values' ``(row amaxes [R], column amaxes [C])`` as their producer measured them
      (:func:`pallas_kernels.quantize.amaxes`): the kernel then skips its statistics pass where it has
      one (:func:`pallas_kernels.quantize.fused_quantize_kernel`); XLA measures anyway.

  Returns:
    ``(rows or None, transposed or None, stat or None)`` (``stat``: the prologue's float32 row
    statistic ``[R]``, RmsNorm's ``rstd``). The kernel on a GPU where it takes the shape (under
    ``auto`` from ``policy.QUANTIZE_KERNEL_MIN_ROWS`` rows: decode's few rows go to XLA), the XLA
    reference elsewhere; the same numbers up to rounding ties. With ``options.split``, amaxes
    span the whole split matrix: the kernel reduces them between its passes (rows split: per-column
    amaxes; columns split: per-row ones, the rows then written by its tiled pass).
  """
  options = _resolve(options)
  spec = rows_spec or cols_spec
  r, c = inputs[0].shape[0], prologue.width(inputs)
  split = options.split
  with jax.named_scope(QUANTIZE_SCOPE):
    if (not policy.quantize_on_kernel(options.backend) or inputs[0].ndim != 2
        or policy.quantize_rows_to_xla(r, options.backend) or (split.cols and prologue.stats)
        or (spec.ternary and not policy.ternary_weights_on_kernel(options.backend))):
      # (A row statistic over split columns needs the whole row: the reference raises a clear error for it,
      # and jaxlowbit.fused computes such a norm across the devices before quantizing.)
      return quantize_kernels.fused_quantize_reference(inputs, prologue, rows_spec, cols_spec, rows_t, split)
    stat = None
    if not isinstance(prologue, Identity) and not policy.fuse_prologue(type(prologue).__name__):
      # The op in XLA, its output written once, then the plain quantizers on it.
      stat = prologue.reference_stat(inputs) if prologue.stats else None
      inputs, prologue = (prologue.reference(inputs),), Identity()
    transposing = cols_spec is not None or rows_t
    if quantize_kernels.supported(spec, r, c, transposed=transposing, prologue=prologue, split=split):
      rows, transposed, own_stat = _kernel(inputs, prologue=prologue, rows_spec=rows_spec, cols_spec=cols_spec,
                                           rows_t=rows_t, split=split, maxima=maxima)
    elif (transposing and rows_spec is not None and not rows_spec.per_tensor
          and quantize_kernels.supported(rows_spec, r, c, transposed=False, prologue=prologue, split=split)):
      _refuse_forced_fallback(cols_spec or rows_spec, r, c, True, prologue, options.backend)
      # A shape the transposing kernel does not take but the rows kernel does: the rows come from
      # the rows kernel, exactly as a rows-only request gets them (a layer's codes then do not
      # depend on whether its backward needs a transposed copy: training and an inference
      # conversion quantize alike), the transposed copy from XLA.
      rows, _, own_stat = _kernel(inputs, prologue=prologue, rows_spec=rows_spec, cols_spec=None, rows_t=False,
                                  split=split, maxima=None)
      if rows_t:
        transposed = quantize_kernels.transposed_rows(rows)
      else:
        transposed = quantize_kernels.fused_quantize_reference(inputs, prologue, None, cols_spec, split=split)[1]
    else:
      _refuse_forced_fallback(spec, r, c, transposing, prologue, options.backend)
      rows, transposed, own_stat = quantize_kernels.fused_quantize_reference(inputs, prologue, rows_spec, cols_spec,
                                                                             rows_t, split)
    return rows, transposed, own_stat if stat is None else stat


def _refuse_forced_fallback(spec: QuantSpec, r: int, c: int, transposed: bool, prologue: Prologue,
                            backend: str) -> None:
  """Under the ``pallas`` backend, ValueError where a quantize kernel exists for ``spec`` but
  cannot take this ``[R, C]`` shape: forcing the kernels must not run XLA in their place unseen.
  (A bare per-tensor row copy has no kernel on purpose: XLA is its path. A ternary weight whose shape the tile kernel
  does not divide, or a split one, is quantized by XLA too: FSDP and tensor parallelism quantize split weights with
  their own global scale.)"""
  bare_per_tensor = spec.per_tensor and not transposed and isinstance(prologue, Identity)
  if backend != "pallas" or spec.ternary or bare_per_tensor:
    return
  raise ValueError(
      f"backend pallas: the {spec.dtype} quantize kernel cannot take a [{r}, {c}] operand"
      f"{' with its transposed copy' if transposed else ''} (columns must be a multiple of 16 and rows and "
      f"columns divide its tiles); pad the operand, or use auto (unset {policy.BACKEND_ENV}) so XLA takes "
      "this shape"
  )


@functools.partial(jax.jit, static_argnames=("prologue", "rows_spec", "cols_spec", "rows_t", "split"))
def _kernel(inputs, prologue, rows_spec, cols_spec, rows_t, split, maxima):
  """:func:`pallas_kernels.quantize.fused_quantize_kernel` called through ``jax.jit``: as a bare
  ``pallas_call`` inside ``nn.scan``'s loop-invariant check (partial evaluation, jax 0.11) it makes
  flax raise "broadcasted variable has a data dependency on the scan body"."""
  return quantize_kernels.fused_quantize_kernel(inputs, prologue, rows_spec, cols_spec, rows_t, split=split,
                                                maxima=maxima)


def prologue_values(inputs: tuple[jax.Array, ...], prologue: Prologue,
                    options: DispatchOptions | None = None) -> jax.Array:
  """``prologue(*inputs)`` written in its dtype: ``[..., C]`` for inputs ``[..., C_i]``.

  The values kernel (:func:`pallas_kernels.quantize.prologue_kernel`, one read, one write) on a GPU
  where it takes the ``[R, C]`` shape, ``prologue.reference`` (XLA) elsewhere; equal up to float
  rounding. ``SwiGLUGrad``: inputs ``dh [..., H], gate_up [..., 2H]`` -> ``d gate_up [..., 2H]``.
  """
  flat = tuple(a.reshape(-1, a.shape[-1]) for a in inputs)
  r, c = flat[0].shape[0], prologue.width(flat)
  if policy.quantize_on_kernel(_resolve(options).backend) and quantize_kernels.prologue_supported(r, c, prologue):
    return _values(flat, prologue).reshape(*inputs[0].shape[:-1], c)
  return prologue.reference(inputs)


@functools.partial(jax.jit, static_argnames=("prologue",))
def _values(inputs, prologue):
  """:func:`pallas_kernels.quantize.prologue_kernel` through ``jax.jit`` (as :func:`_kernel`)."""
  return quantize_kernels.prologue_kernel(inputs, prologue)


def norm_rows_on_kernel(rows: int, options: DispatchOptions | None = None) -> bool:
  """Whether :func:`norm_rows` runs its one-launch kernel for ``rows`` rows (a decode step's batch on a GPU)."""
  return (policy.DECODE_NORM_KERNEL and rows <= decode_kernels.NORM_ROWS_MAX
          and policy.quantize_on_kernel(_resolve(options).backend))


def norm_rows(inputs: tuple[jax.Array, ...], gamma: jax.Array, source: Prologue, norm: quantize_kernels.RmsNorm,
              write_source: bool = False, options: DispatchOptions | None = None, quantize: QuantSpec | None = None,
              keep_values: bool = False):
  """RMSNorm ``norm`` of ``source``'s values (``pallas_kernels.decode.norm_rows_kernel``'s arguments): ``y [R, C]``
  (``quantize``: its per-row codes and scales ``(int8 [R, C], float32 [R, 1])``, and y after them with
  ``keep_values``), and the values ``[R, C]`` with ``write_source``.

  One kernel where :func:`norm_rows_on_kernel` says so, XLA elsewhere; equal up to the order of the mean square's
  sum. Differentiable without ``quantize``: the backward is the XLA path's (decode never takes it; a training
  forward has more rows). The codes have no gradient (decode hands them to a converted linear).
  """
  on_kernel = norm_rows_on_kernel(inputs[0].shape[0], options)
  if quantize is not None:
    run = _norm_rows_kernel if on_kernel else decode_kernels.norm_rows_reference
    return run(inputs, gamma, source, norm, write_source, quantize, keep_values=keep_values)
  if on_kernel:
    return _norm_rows(inputs, gamma, source, norm, write_source)
  return decode_kernels.norm_rows_reference(inputs, gamma, source, norm, write_source)


# Through jax.jit, as :func:`_kernel` (a bare pallas_call inside nn.scan's loop-invariant check).
_norm_rows_kernel = jax.jit(decode_kernels.norm_rows_kernel, static_argnames=("source", "norm", "write_source",
                                                                              "quantize", "keep_values"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _norm_rows(inputs, gamma, source, norm, write_source):
  return _norm_rows_kernel(inputs, gamma, source, norm, write_source)


def _norm_rows_fwd(inputs, gamma, source, norm, write_source):
  return _norm_rows(inputs, gamma, source, norm, write_source), (inputs, gamma)


def _norm_rows_bwd(source, norm, write_source, residuals, ct):
  _, pullback = jax.vjp(lambda *a: decode_kernels.norm_rows_reference(a[:-1], a[-1], source, norm, write_source),
                        *residuals[0], residuals[1])
  grads = pullback(ct)
  return tuple(grads[:-1]), grads[-1]


_norm_rows.defvjp(_norm_rows_fwd, _norm_rows_bwd)


def decode_attention_on_kernel(n_heads: int, n_kv_heads: int, head_dim: int,
                               options: DispatchOptions | None = None) -> bool:
  """Whether :func:`decode_attention` runs for these heads (a GPU from sm80; head_dim / 2 a power of two >= 16;
  ``policy.DECODE_ATTENTION_KERNEL``), for a cache of any length (a long one is split over programs). The caller
  checks the rest: one new token, a cache that exists, the fused qkv projection."""
  return (policy.DECODE_ATTENTION_KERNEL and decode_kernels.decode_attention_supported(n_heads, n_kv_heads, head_dim)
          and policy.quantize_on_kernel(_resolve(options).backend))


# Through jax.jit, as :func:`_kernel`; the caches are donated by the decode loop, which aliases them through.
decode_attention = jax.jit(decode_kernels.decode_attention_kernel,
                           static_argnames=("n_heads", "block", "interpret", "splits"))
decode_attention.__doc__ = ("A decode step's attention in one launch: "
                            ":func:`pallas_kernels.decode.decode_attention_kernel` (its arguments and results).")


def swiglu_norm_grad(dy: jax.Array, h: jax.Array, gate_up: jax.Array, gamma: jax.Array, rstd: jax.Array,
                     row_mean: jax.Array, activation: str = "silu", options: DispatchOptions | None = None,
                     maxima: bool = False):
  """The backward of ``RMSNorm(act(gate) * up)``: ``(d gate_up [R, 2H] in gate_up's dtype, d gamma [H] float32)``.

  ``dy [R, H]`` (the norm's output gradient), ``h [R, H]`` (the gated activation as the forward wrote it),
  ``gate_up [R, 2H]``, ``gamma [H]``, ``rstd [R]`` and ``row_mean [R]`` (float32; see
  :class:`pallas_kernels.quantize.SwiGLUNormGrad`). One values kernel on a GPU where it takes the shape (its
  per-tile partials then reduced here), XLA elsewhere; equal up to float rounding. With ``maxima``, a third
  element: ``d gate_up``'s ``(row amaxes [R], column amaxes [2H])`` float32
  (:func:`pallas_kernels.quantize.amaxes`), measured as it is written.
  """
  prologue = quantize_kernels.SwiGLUNormGrad(activation, maxima)
  inputs = (dy, h, gate_up, gamma, rstd, row_mean)
  r, c = gate_up.shape
  if policy.quantize_on_kernel(_resolve(options).backend) and quantize_kernels.prologue_supported(r, c, prologue):
    d_gate_up, dgamma, *partials = _values(inputs, prologue)
  else:
    d_gate_up, dgamma, *partials = prologue.reference(inputs)
  if not maxima:
    return d_gate_up, jnp.sum(dgamma, axis=0)
  return d_gate_up, jnp.sum(dgamma, axis=0), tuple(jnp.max(p, axis=0) for p in partials)


def quantize_rows(x: jax.Array, spec: QuantSpec, options: DispatchOptions | None = None) -> tuple[jax.Array, jax.Array]:
  """``x [R, C]`` -> (``q [R, C]`` of ``spec.dtype``, float32 dequant scale ``[R, 1]`` or ``[1, 1]``)."""
  return fused_quantize((x,), Identity(), spec, options=options)[0]


def quantize_cols_t(x: jax.Array, spec: QuantSpec,
                    options: DispatchOptions | None = None) -> tuple[jax.Array, jax.Array]:
  """``x [R, C]`` -> (``q [C, R]``: per-column quantization written transposed, scale ``[C, 1]`` or ``[1, 1]``)."""
  return fused_quantize((x,), Identity(), None, spec, options=options)[1]


def quantize_ternary_weight(w: jax.Array, spec: QuantSpec, options: DispatchOptions | None = None):
  """BitNet's weight ``W [K, N]`` -> ``(rows or None, transposed)``: ``Wq^T [N, K]`` (int8, scale ``[1, 1]``) for the
  forward GEMM and, where the tile kernel quantizes ternary weights (``policy.ternary_weights_on_kernel``), ``Wq
  [K, N]`` for grad_input from the same pass. Elsewhere rows is None and the backward transposes the forward's codes,
  as before (the 1B step's H200 profile shows no transpose kernel of its own for them: XLA writes both layouts in
  its quantizing fusion, as far as the profile tells)."""
  options = _resolve(options)
  if policy.ternary_weights_on_kernel(options.backend):
    rows, transposed, _ = fused_quantize((w,), Identity(), spec, spec, options=options)
    return rows, transposed
  return None, quantize_cols_t(w, spec, options)


def quantize_rows_and_cols_t(x: jax.Array, spec: QuantSpec, options: DispatchOptions | None = None,
                             maxima: tuple[jax.Array, jax.Array] | None = None):
  """Both :func:`quantize_rows` and :func:`quantize_cols_t` of ``x``, sharing one read where a kernel can
  (``maxima``: x's amaxes as its producer measured them, :func:`fused_quantize`)."""
  rows, transposed, _ = fused_quantize((x,), Identity(), spec, spec, options=options, maxima=maxima)
  return rows, transposed


def scaled_matmul(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, out_dtype=jnp.bfloat16,
    options: DispatchOptions | None = None,
) -> jax.Array:
  """``(a @ b.T) * a_scale[:, None] * b_scale[None, :]`` on the selected backend.

  Args:
    a: ``[M, K]`` int8 or fp8. b: ``[N, K]`` (K-major, as tensor cores want it).
    a_scale, b_scale: float32 dequantization scales, one per row or one in all.
    out_dtype: dtype of the ``[M, N]`` result.
    options: the backend (:class:`DispatchOptions`; its split does not apply to a GEMM).
  """
  check_operands(a, a_scale, b, b_scale)
  m, k = a.shape
  per_tensor = a_scale.size == 1 and b_scale.size == 1
  backend = _resolve(options).backend
  with jax.named_scope(GEMM_SCOPE):
    if select_backend(a.dtype, m, b.shape[0], k, per_tensor=per_tensor, backend=backend) == "pallas":
      from pallas_kernels import tuning  # imports Mosaic GPU lazily
      from pallas_kernels.hopper_gemm import scaled_matmul_hopper

      config = tuning.config_for(m, b.shape[0], k, a.dtype)
      return scaled_matmul_hopper(a, a_scale, b, b_scale, out_dtype, config=config)
    return scaled_matmul_reference(a, a_scale, b, b_scale, out_dtype)


def adam_update(
    g: jax.Array,
    m: BlockQuantized,
    v: BlockQuantized,
    coefficients: AdamCoefficients,
    m_format: BlockFormat,
    v_format: BlockFormat,
    nesterov: bool = False,
    options: DispatchOptions | None = None,
) -> tuple[jax.Array, BlockQuantized, BlockQuantized]:
  """One Adam step of a block-wise quantized tensor on the selected backend.

  Args:
    g: gradient ``[*lead, N]``; m, v: its moments (codes and float32 block scales) stored in
      ``m_format`` / ``v_format``; coefficients: the step's scalars
      (:func:`jaxlowbit_numerics.adam.adam_coefficients`); nesterov: as in optax; options: the backend.

  Returns:
    ``(u, m_new, v_new)``: the float32 update ``[*lead, N]`` and the new moments. The fused
    kernel (:mod:`pallas_kernels.adam`) where the policy and the shape allow, else its XLA
    reference; the same codes up to ties of the nearest-code search.
  """
  with jax.named_scope(ADAM_SCOPE):
    if _adam_on_kernel(g, m, v, m_format, v_format, _resolve(options).backend):
      config = tuning.adam_config(m_format, v_format)
      return adam_kernels.adam_update_kernel(g, m, v, coefficients, m_format, v_format, nesterov, config)
    return adam_kernels.adam_update_reference(g, m, v, coefficients, m_format, v_format, nesterov)


def _adam_on_kernel(g, m, v, m_format, v_format, backend: str) -> bool:
  """The one choice of :func:`adam_update` and :func:`adam_step`: the policy, then the tensor."""
  explicit = any(axis is not None for axis in jax.typeof(g).sharding.spec)  # sharding in types: XLA's update
  if explicit or not policy.adam_on_kernel((m_format.kind, v_format.kind), backend):
    return False
  if adam_kernels.supported(g, m, v, m_format, v_format):
    return True
  if backend == "pallas":  # forced: the kernel runs here, so not taking the shape is an error
    raise ValueError(
        f"backend pallas: the fused Adam kernel cannot take a {g.dtype} tensor of shape {g.shape} "
        f"with {m_format.kind}/{v_format.kind} moments of block {m_format.block} (it needs a last axis that is a "
        f"multiple of the block and a power-of-two block; see pallas_kernels.adam.supported); use auto "
        f"(unset {policy.BACKEND_ENV}) so XLA's update takes it"
    )
  return False


def adam_step(
    p: jax.Array,
    g: jax.Array,
    m: BlockQuantized,
    v: BlockQuantized,
    coefficients: AdamCoefficients,
    neg_lr: jax.Array,
    weight_decay: jax.Array,
    seed: jax.Array | None,
    m_format: BlockFormat,
    v_format: BlockFormat,
    nesterov: bool = False,
    options: DispatchOptions | None = None,
) -> tuple[jax.Array, BlockQuantized, BlockQuantized]:
  """One AdamW step of a block-wise quantized tensor, written into its parameter ``p``.

  Args:
    p: parameter ``[*lead, N]`` (float32 or bfloat16); g, m, v, coefficients, m_format,
      v_format, nesterov: as in :func:`adam_update`.
    neg_lr: ``-learning_rate``; weight_decay: this parameter's decay (float32 scalars).
    seed: uint32 scalar for bf16 stochastic rounding, or None (round to nearest).

  Returns:
    ``(p_new, m_new, v_new)``: one kernel that reads ``p`` and writes ``p_new``
    (:func:`pallas_kernels.adam.adam_step_kernel`) where :func:`adam_update` would take the
    kernel, else its XLA reference (:func:`pallas_kernels.adam.adam_step_reference`).
  """
  with jax.named_scope(ADAM_SCOPE):
    backend = _resolve(options).backend
    if jnp.dtype(p.dtype) in adam_kernels.PARAM_DTYPES and _adam_on_kernel(g, m, v, m_format, v_format, backend):
      config = tuning.adam_config(m_format, v_format)
      return adam_kernels.adam_step_kernel(p, g, m, v, coefficients, neg_lr, weight_decay, seed, m_format, v_format,
                                           nesterov, config)
    return adam_kernels.adam_step_reference(p, g, m, v, coefficients, neg_lr, weight_decay, seed, m_format, v_format,
                                            nesterov)
