"""Decode layer (no attention) A/B on the 1B ternary shapes: norms handing codes to the GEMVs (shipped) against the
norm + quantizer + GEMV (+ residual) fused into one launch per linear. Device time per layer (gpu_times, L layers)."""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import ternary_gemv as tg, decode
from pallas_kernels.quantize import Identity, SwiGLU, RmsNorm
from jaxlowbit.inference.weights import BITNET_TOKENS as SPEC
from jaxlowbit_numerics.ternary import pack_2bit

LOWER = "--lower" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
L = 8
D, F, QKV = 2048, 8192, 3072
norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
key = jax.random.key(0)
def W(i, n, k):
  w = jax.random.randint(jax.random.fold_in(key, i), (n, k), -1, 2).astype(jnp.int8)
  return (pack_2bit(w, axis=-1), jnp.float32(0.02))
def X(i, shape):
  return jax.random.normal(jax.random.fold_in(key, 1000 + i), shape).astype(jnp.bfloat16)
layers = [dict(qkv=W(4*i, QKV, D), o=W(4*i+1, D, D), gu=W(4*i+2, 2*F, D), dn=W(4*i+3, D, F),
               g=[(1 + 0.1 * X(10*i + j, (c,))).astype(jnp.bfloat16) for j, c in enumerate((D, D, D, F))])
          for i in range(L)]
acts = dict(x=X(1, (1, D)), d=X(2, (1, D)), a=X(3, (1, D)))
NK = dict(quantize=SPEC)
nr = lambda inputs, g, src, ws=False: decode.norm_rows_kernel(inputs, g, src, norm, ws, SPEC)
gemv = lambda c, w: tg.a8w2_gemv_kernel(c[0], c[1], w[0], w[1])

def shipped(acts, layers):
  x, d, a = acts["x"], acts["d"], acts["a"]
  outs = []
  for p in layers:
    c, x = nr((x, d), p["g"][0], decode.Add(), True)
    qkv = gemv(c, p["qkv"])
    o = gemv(nr((a,), p["g"][1], Identity()), p["o"])
    c, x = nr((x, o), p["g"][2], decode.Add(), True)
    gu = gemv(c, p["gu"])
    d = gemv(nr((gu,), p["g"][3], SwiGLU("silu")), p["dn"])
    outs.append(qkv)
  return outs, x, d

def fused(cfg=None, resident=None, sub_only=False):
  f = lambda inputs, g, src, w, res=None, cfg=cfg: tg.norm_a8w2_gemv_kernel(inputs, g, src, norm, w[0], w[1], SPEC, res, config=cfg, resident=resident)
  def run(acts, layers):
    x, d, a = acts["x"], acts["d"], acts["a"]
    outs = []
    for p in layers:
      if sub_only:
        c, x = nr((x, d), p["g"][0], decode.Add(), True)
        qkv = gemv(c, p["qkv"])
        o = f((a,), p["g"][1], Identity(), p["o"])
        c, x = nr((x, o), p["g"][2], decode.Add(), True)
        gu = gemv(c, p["gu"])
        d = f((gu,), p["g"][3], SwiGLU("silu"), p["dn"])
      else:
        x = x + d if d is not None else x  # only the first layer: the stream arrives summed after
        d = None
        qkv = f((x,), p["g"][0], Identity(), p["qkv"])
        x = f((a,), p["g"][1], Identity(), p["o"], x)
        gu = f((x,), p["g"][2], Identity(), p["gu"])
        x = f((gu,), p["g"][3], SwiGLU("silu"), p["dn"], x)
      outs.append(qkv)
    return outs, x, d
  return run

def cfgs(bn, bk=None, nw=4):
  return None if bn is None else "custom"

variants = [("shipped", shipped), ("fused", fused()), ("fused_sweep", fused(resident=False)),
            ("fused_sub_only", fused(sub_only=True))]
for bn in (16, 32):
  variants.append((f"fused_bn{bn}", fused(cfg=("bn", bn))))
res = {"device": jax.devices()[0].device_kind if not LOWER else "cpu-lower", "jax": jax.__version__,
       "commit": os.environ.get("JAXLOWBIT_COMMIT"), "date": time.strftime("%Y-%m-%d"), "layers": L, "rows": []}

# custom tilings: per-linear config_for with block_n replaced
_orig = tg.config_for
def patched(bn):
  def cf(n, kb, sms=None, m=1, codes=False):
    c = _orig(n, kb, sms, m, codes)
    return tg.dataclasses.replace(c, block_n=bn, split_k=1)
  return cf

compiled = {}
for name, fn in variants:
  bn = dict(fused_bn16=16, fused_bn32=32).get(name)
  tg.config_for = patched(bn) if bn else _orig
  real = fn
  if bn:
    real = fused(resident=None)
  jax.clear_caches()
  t0 = time.time()
  try:
    if LOWER:
      jax.jit(real).trace(acts, layers).lower(lowering_platforms=("cuda",))
      print(name, "lowered", round(time.time() - t0, 1), flush=True); continue
    c = jax.jit(real).lower(acts, layers).compile()
    out = jax.block_until_ready(c(acts, layers))
    compiled[name] = (c, out)
    print(name, "compiled", round(time.time() - t0, 1), flush=True)
  except Exception as e:
    print(name, "ERROR", repr(e)[:400], flush=True)
    res["rows"].append({"case": name, "error": repr(e)[:400]})
tg.config_for = _orig
if not LOWER:
  sys.argv.append("--keep_command_buffers")
  from benchmarks import inference as bi
  ref_qkv = np.asarray(compiled["shipped"][1][0][-1], np.float32)
  times = {n: [] for n in compiled}
  for rnd in range(3):
    for name, (c, out) in compiled.items():
      t = bi.gpu_times(c, acts, layers, calls=5, per_call=L)
      times[name].append(t)
  for name, (c, out) in compiled.items():
    ts = times[name]
    med = float(np.median([t["us"] for t in ts]))
    row = {"case": name, "us_per_layer": med, "rounds_us": [t["us"] for t in ts],
           "kernels_per_layer": ts[0]["kernels_per_call"] / L, "busy_us": float(np.median([t["busy_us"] for t in ts])),
           "qkv_max_abs_diff_vs_shipped": float(np.abs(np.asarray(out[0][-1], np.float32) - ref_qkv).max())}
    res["rows"].append(row)
  json.dump(res, open(f"{OUT}/decode_layer_fused_ab.json", "w"), indent=1)
  print("\ncase | us/layer (3 rounds) | kernels/layer | busy | qkv diff")
  for r in res["rows"]:
    if "error" in r: print(r["case"], "ERROR"); continue
    print(r["case"], "|", round(r["us_per_layer"], 2), [round(u, 2) for u in r["rounds_us"]], "|", r["kernels_per_layer"], "|", round(r["busy_us"], 2), "|", r["qkv_max_abs_diff_vs_shipped"])
