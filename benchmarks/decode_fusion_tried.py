"""Two decode fusions tried on one H200 (2026-11-29, eighth session) and dropped: kept here for the record; the
results are benchmarks/results/ternary_gemv_tail_norm_h200_a8ddd17.json and norm_prefetch_l2_h200_a8ddd17.json,
the reading in docs/inference.md ("Two fusions that lost").

1. tail: a ternary decode GEMV (M = 1, int8 codes in) whose last program to finish runs the next pre-norm
   (residual add + RMSNorm + int8 codes) on the whole output row, instead of a norm kernel after it. Each program
   writes its slice of y, a CTA barrier, one atomic add (acq_rel, gpu scope) on a counter carried through calls;
   the program that sees n - 1 reads the row back, norms it and resets the counter.
2. prefetch: the pre-norm kernel runs extra programs that read the NEXT GEMV's packed weight into L2 (evict_last)
   while its one program norms, so the GEMV reads L2, not HBM.

CPU (interpret mode, outputs equal to the shipped two-kernel chain): ``python -m benchmarks.decode_fusion_tried
check``; GPU: ``... bench``.
"""
import functools, json, os, sys, time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowbit.inference.weights import BITNET_TOKENS
from jaxlowbit_numerics.ternary import VALUES_PER_BYTE
from pallas_kernels import decode, ternary_gemv
from pallas_kernels.decode import Add
from pallas_kernels.quantize import RmsNorm
from pallas_kernels.vma import out_struct

SPEC = BITNET_TOKENS
NORM = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))


def _tail_kernel(x_ref, w_ref, sx_ref, sw_ref, res_ref, gamma_ref, _cnt_in, o_ref, codes_ref, scale_ref, sum_ref,
                 cnt_ref,
            *, config, k, n, programs, native, tensor_scale):
  ternary_gemv._kernel(x_ref, w_ref, sx_ref, sw_ref, o_ref, config=config, k=k, k_per_split=k // VALUES_PER_BYTE,
                       m=1, spec=None, native=native, tensor_scale=tensor_scale)
  if native:
    plt.debug_barrier()  # every thread's slice of y issued before the program's one release
  done = plt.atomic_add(cnt_ref, (jnp.int32(0),), jnp.int32(1))

  @pl.when(done == programs - 1)
  def _tail():
    cnt_ref[0] = jnp.int32(0)
    y_src = o_ref
    decode._norm_rows_kernel(res_ref, y_src, gamma_ref, codes_ref, scale_ref, sum_ref, source=Add(), n_inputs=2,
                             norm=NORM, width=n, chunk=n, write_source=True, quantize=SPEC, native=native, row=0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def tail_gemv(codes, sx, w_packed, sw, res, gamma, cnt, interpret=False):
  """codes [1, K] int8, sx [1, 1] f32, w_packed [N, K/4], sw [1] f32, res [1, N] bf16, gamma [N], cnt [1] int32 ->
  (y [1, N] bf16, codes' [1, N] int8, scale' [1, 1] f32, res + y [1, N] bf16, cnt)."""
  n, k_bytes = w_packed.shape
  k = codes.shape[1]
  config = ternary_gemv.config_for(n, k_bytes, m=1, codes=True)
  assert config.split_k == 1, config
  words = jax.lax.bitcast_convert_type(codes.reshape(1, -1, VALUES_PER_BYTE), jnp.int32).reshape(-1)
  sxv = sx.astype(jnp.float32).reshape(-1)
  swv = sw.astype(jnp.float32).reshape(-1)
  operands = (words, w_packed, sxv, swv, res, gamma, cnt)
  outs = (out_struct((1, n), jnp.bfloat16, *operands), out_struct((1, n), jnp.int8, *operands),
          out_struct((1, 1), jnp.float32, *operands), out_struct((1, n), jnp.bfloat16, *operands),
          out_struct((1,), jnp.int32, *operands))
  programs = n // config.block_n
  return pl.pallas_call(
      functools.partial(_tail_kernel, config=config, k=k, n=n, programs=programs, native=not interpret,
                        tensor_scale=swv.size == 1),
      out_shape=outs, grid=(programs, 1), input_output_aliases={6: 4},
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="jaxlowbit_ternary_gemv_tail")(*operands)


def two_kernels(codes, sx, w_packed, sw, res, gamma, interpret=False):
  y = ternary_gemv.a8w2_gemv_kernel(codes, sx, w_packed, sw, jnp.bfloat16, interpret=interpret)
  (c2, s2), total = decode.norm_rows_kernel((res, y), gamma, Add(), NORM, write_source=True, quantize=SPEC,
                                            interpret=interpret)
  return y, c2, s2, total


def make(n, layers, seed=0):
  key = jax.random.key(seed)
  from jaxlowbit_numerics.ternary import pack_2bit
  ws = []
  for i in range(layers):
    t = jax.random.randint(jax.random.fold_in(key, i), (n, n), -1, 2).astype(jnp.int8)
    ws.append((pack_2bit(t, axis=-1), jnp.full((1,), 0.02, jnp.float32)))
  gammas = [(1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 100 + i), (n,))).astype(jnp.bfloat16)
            for i in range(layers)]
  x = jax.random.normal(jax.random.fold_in(key, 999), (1, n), jnp.float32).astype(jnp.bfloat16)
  codes = jax.random.randint(jax.random.fold_in(key, 998), (1, n), -127, 128, jnp.int32).astype(jnp.int8)
  sx = jnp.full((1, 1), 0.01, jnp.float32)
  return ws, gammas, x, codes, sx


def chain_two(ws, gammas, res, codes, sx, interpret=False):
  outs = []
  for (w, sw), g in zip(ws, gammas):
    y, codes, sx, res = two_kernels(codes, sx, w, sw, res, g, interpret)
    outs.append((y, codes, sx, res))
  return outs


def chain_tail(ws, gammas, res, codes, sx, cnt, interpret=False):
  outs = []
  for (w, sw), g in zip(ws, gammas):
    y, codes, sx, res, cnt = tail_gemv(codes, sx, w, sw, res, g, cnt, interpret=interpret)
    outs.append((y, codes, sx, res))
  return outs, cnt


def identical(a, b):
  """Layers whose four outputs differ between two chains' results."""
  return sum(int(not all(np.array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32)) for u, v in zip(la, lb)))
             for la, lb in zip(a, b))


def drift(a, b):
  """Against the two-kernel chain (its norm sums in another order): max code step and max relative y difference."""
  code = max(int(np.max(np.abs(np.asarray(la[1], np.int32) - np.asarray(lb[1], np.int32)))) for la, lb in zip(a, b))
  rel = max(float(np.max(np.abs(np.asarray(la[0], np.float32) - np.asarray(lb[0], np.float32)))
                  / (np.max(np.abs(np.asarray(lb[0], np.float32))) + 1e-30)) for la, lb in zip(a, b))
  return code, rel


def check_tail():
  ws, gammas, x, codes, sx = make(256, 3)
  cnt = jnp.zeros((1,), jnp.int32)
  a = chain_two(ws, gammas, x, codes, sx, interpret=True)
  b, cnt = chain_tail(ws, gammas, x, codes, sx, cnt, interpret=True)
  print("layers differing:", identical(a, b), "counter after:", int(cnt[0]))


def bench_tail():
  from benchmarks import inference as bi
  out_dir = os.environ.get("OUT", "/tmp")
  res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": os.environ.get("JAXLOWBIT_COMMIT"),
         "date": time.strftime("%Y-%m-%d"), "what": __doc__, "rows": []}
  smoke = bool(os.environ.get("SMOKE"))
  L = 2 if smoke else 16
  for n in ((256,) if smoke else (2048, 4096)):
    ws, gammas, x, codes, sx = make(n, L)
    two = jax.jit(lambda ws, gs, r, c, s: chain_two(ws, gs, r, c, s, smoke))
    tail = jax.jit(lambda ws, gs, r, c, s, cnt: chain_tail(ws, gs, r, c, s, cnt, smoke), donate_argnums=(5,))
    a = two(ws, gammas, x, codes, sx)
    cnt = jnp.zeros((1,), jnp.int32)
    first, cnt = tail(ws, gammas, x, codes, sx, cnt)
    bad_total = 0
    for rep in range(3 if smoke else 50):  # a race would show as a call whose layers differ from the first call's
      b, cnt = tail(ws, gammas, x, codes, sx, cnt)
      bad_total += identical(first, b)
    code_step, y_rel = drift(first, a)
    row = {"n": n, "layers": L, "layers_differing_from_first_call_in_50": bad_total, "counter_after": int(cnt[0]),
           "layer0_y_and_sum_exact": bool(identical(first[:1], a[:1]) == 0 or
                                          all(np.array_equal(np.asarray(first[0][i], np.float32),
                                                             np.asarray(a[0][i], np.float32)) for i in (0, 3))),
           "max_code_step_vs_two_kernels": code_step, "max_rel_y_vs_two_kernels": y_rel}
    if smoke:
      print(row)
      continue
    c2 = two.lower(ws, gammas, x, codes, sx).compile()
    row["two_kernels"] = bi.gpu_times(c2, ws, gammas, x, codes, sx, calls=5, per_call=L)
    row["two_kernels"].pop("samples_us", None)
    ct = jax.jit(lambda ws, gs, r, c, s, cnt: chain_tail(ws, gs, r, c, s, cnt)).lower(
        ws, gammas, x, codes, sx, cnt).compile()
    row["tail"] = bi.gpu_times(ct, ws, gammas, x, codes, sx, cnt, calls=5, per_call=L)
    row["tail"].pop("samples_us", None)
    # the GEMV alone and the norm alone, for the breakdown
    res["rows"].append(row)
    print(f"N=K={n}: two kernels {row['two_kernels']['us']:.2f} us/step "
          f"({row['two_kernels'].get('kernels_per_call')} kernels), one with the tail {row['tail']['us']:.2f} "
          f"({row['tail'].get('kernels_per_call')}); nondeterministic layers {bad_total}/{50 * L}, counter "
          f"{row['counter_after']}, vs two kernels: code step {code_step}, y rel {y_rel:.2e}, layer 0 exact "
          f"{row['layer0_y_and_sum_exact']}",
          flush=True)
    json.dump(res, open(f"{out_dir}/ternary_gemv_tail_norm.json", "w"), indent=1)


def _prefetch_kernel(res_ref, y_ref, gamma_ref, w_ref, codes_ref, scale_ref, sum_ref, dummy_ref, *, n, rows_per,
                     native):
  pid = pl.program_id(0)

  @pl.when(pid == 0)
  def _norm():
    decode._norm_rows_kernel(res_ref, y_ref, gamma_ref, codes_ref, scale_ref, sum_ref, source=Add(), n_inputs=2,
                             norm=NORM, width=n, chunk=n, write_source=True, quantize=SPEC, native=native, row=0)

  @pl.when(pid > 0)
  def _prefetch():
    p = pid - 1
    view = w_ref.at[pl.ds(p * rows_per, rows_per), :]
    block = plt.load(view, eviction_policy="evict_last") if native else view[...]
    dummy_ref[p] = jnp.max(block.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("programs", "interpret"))
def norm_prefetch(res, y, gamma, w_next, programs=128, interpret=False):
  n = res.shape[1]
  rows = w_next.shape[0]
  programs = min(programs, rows // 8)
  operands = (res, y, gamma, w_next)
  outs = (out_struct((1, n), jnp.int8, *operands), out_struct((1, 1), jnp.float32, *operands),
          out_struct((1, n), jnp.bfloat16, *operands), out_struct((programs,), jnp.int32, *operands))
  codes, scale, total, _ = pl.pallas_call(
      functools.partial(_prefetch_kernel, n=n, rows_per=rows // programs, native=not interpret),
      out_shape=outs, grid=(1 + programs,),
      compiler_params=plt.CompilerParams(num_warps=decode.norm_warps(n), num_stages=1),
      interpret=interpret, name="jaxlowbit_norm_rows_prefetch")(*operands)
  return codes, scale, total


def chain_prefetch(ws, gammas, res, codes, sx, prefetch, interpret=False, programs=128):
  outs = []
  for i, ((w, sw), g) in enumerate(zip(ws, gammas)):
    y = ternary_gemv.a8w2_gemv_kernel(codes, sx, w, sw, jnp.bfloat16, interpret=interpret)
    if prefetch:
      w_next = ws[(i + 1) % len(ws)][0]
      codes, sx, res = norm_prefetch(res, y, g, w_next, programs=programs, interpret=interpret)
    else:
      (codes, sx), res = decode.norm_rows_kernel((res, y), g, Add(), NORM, write_source=True, quantize=SPEC,
                                                 interpret=interpret)
    outs.append((y, codes, sx, res))
  return outs


def check_prefetch():
  ws, gammas, x, codes, sx = make(256, 3)
  a = chain_prefetch(ws, gammas, x, codes, sx, False, interpret=True)
  b = chain_prefetch(ws, gammas, x, codes, sx, True, interpret=True)
  print("layers differing:", identical(a, b))


def bench_prefetch():
  from benchmarks import inference as bi
  out_dir = os.environ.get("OUT", "/tmp")
  res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": os.environ.get("JAXLOWBIT_COMMIT"),
         "date": time.strftime("%Y-%m-%d"), "what": __doc__, "rows": []}
  L = 16
  for n in (2048, 4096):
    ws, gammas, x, codes, sx = make(n, L)
    cases = [("shipped", ws, False, 128), ("prefetch_128", ws, True, 128), ("prefetch_64", ws, True, 64),
             ("one_weight_l2", [ws[0]] * L, False, 128)]
    ref = None
    for name, wl, pf, programs in cases:
      fn = jax.jit(functools.partial(chain_prefetch, prefetch=pf, programs=programs))
      out = fn(wl, gammas, x, codes, sx)
      row = {"n": n, "case": name, "layers": L}
      if name != "one_weight_l2":
        ref = ref or out
        row["layers_differing_from_shipped"] = identical(ref, out)
      c = fn.lower(wl, gammas, x, codes, sx).compile()
      row.update(bi.gpu_times(c, wl, gammas, x, codes, sx, calls=5, per_call=L))
      row.pop("samples_us", None)
      res["rows"].append(row)
      print(f"N=K={n} {name}: {row['us']:.2f} us/step (min {row['us_min']:.2f} max {row['us_max']:.2f}, "
            f"{row.get('kernels_per_call')} kernels) differing layers {row.get('layers_differing_from_shipped')}",
            flush=True)
      json.dump(res, open(f"{out_dir}/norm_prefetch_l2.json", "w"), indent=1)


def check():
  check_tail()
  check_prefetch()


def bench():
  bench_tail()
  bench_prefetch()


if __name__ == "__main__":
  {"check": check, "bench": bench}[sys.argv[1]]()
