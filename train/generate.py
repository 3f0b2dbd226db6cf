"""Text generation from a ``train.main`` run, with a KV cache and low-bit weights.

    python -m train.generate --checkpoint runs/tiny --scheme w8a16 --prompt "def main("

Schemes (``--scheme``):

- ``bf16``: the model as configured, weights cast to the compute dtype once (the baseline; a
  checkpoint trained with int8 or BitNet still quantizes on the fly, as in training).
- ``w8a16``, ``w8a8``, ``ternary``: the linears converted with
  :func:`jaxlowbit.inference.quantize_params` (embeddings and the LM head stay high precision)
  and run by :func:`jaxlowbit.inference.convert_for_inference`. ``ternary`` only makes sense
  for a BitNet-trained checkpoint (it then reproduces the training forward exactly); on
  another checkpoint it runs, with a warning, and produces noise.

Decoding: the prompt (``[BOS] + UTF-8 bytes``) fills the cache in one forward (prefill), then
one token per step inside a ``lax.scan`` (no host round trip per token), the cache donated and
updated in place. Greedy by default (``--temperature 0``); ``--temperature T --top_k K --seed S``
samples. ``--kv_cache_dtype int8`` keeps keys and values in int8 with one scale per token and kv
head (:mod:`train.kv_cache`; about half the bytes attention reads per token); ``auto`` (default)
keeps them in the compute dtype (bf16). Prints the text, then prefill time and decode tokens/s
(compilation excluded).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxlowbit import inference
from jaxlowbit.execution import ExecutionOptions
from train import checkpoint, cli, data, kv_cache
from train.model import ModelConfig, Transformer
from train.runs import load_run

SCHEMES = ("bf16", *inference.SCHEMES)
DEFAULT_NEW_TOKENS = 200


# ---------------------------------------------------------------------------------------------
# Model, parameters and cache for a scheme


def scheme_note(scheme: str, recipe_name: str) -> str | None:
  """A warning when ``scheme`` does not fit how the checkpoint was trained (None when it does)."""
  bitnet = recipe_name.startswith("bitnet")
  if scheme == "ternary" and not bitnet:
    return (f"warning: --scheme ternary on a checkpoint trained with recipe {recipe_name!r}: ternary weights only "
            "reproduce a BitNet-trained model; expect noise")
  if scheme in ("w8a16", "w8a8") and bitnet:
    return (f"note: this checkpoint was trained with BitNet; --scheme ternary reproduces its forward exactly, "
            f"{scheme} runs its master weights in int8 instead")
  return None


def cast_floating(tree: Any, dtype) -> Any:
  """Every floating leaf of ``tree`` cast to ``dtype`` (int8/packed leaves untouched)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def unstack_layers(params: Any, n_layers: int) -> Any:
  """Scanned parameters (``layers`` with a leading ``[n_layers]`` axis) as ``layers_0`` ... ``layers_{n-1}``."""
  if "layers" not in params:
    return params
  out = {name: value for name, value in params.items() if name != "layers"}
  for i in range(n_layers):
    out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
  return out


def prepare(model_config: ModelConfig, params: Any, scheme: str, filter_fqns=inference.params.DEFAULT_FILTER_FQNS,
            scan_layers: bool = False, execution: ExecutionOptions | None = None, kv_cache_dtype: str = "auto"):
  """``(decode-mode model, inference params)`` for ``scheme``; the input params may be donated.

  ``execution`` is how the model and its converted linears run (the run's ``spec.execution``; None:
  the library's defaults, the backend from ``$JAXLOWBIT_BACKEND``). ``kv_cache_dtype``: ``"auto"`` (keys
  and values in the compute dtype) or ``"int8"`` (:mod:`train.kv_cache`).

  The converted linears' int8/packed leaves replace their kernels; every floating leaf left
  (embedding, norms, LM head) is cast to the compute dtype once, as the bf16 baseline's are.
  With ``scan_layers=False`` (the default) the layers are unrolled: each one's weights are
  their own buffers, where a scan would slice them out of the stacked arrays every step (XLA
  copies such a slice before a library or Pallas GEMM: a second pass over every weight).
  """
  if scheme not in SCHEMES:
    raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
  kv_cache.check_kv_cache_dtype(kv_cache_dtype, "prepare")
  if scheme != "bf16":
    params = inference.quantize_params(params, scheme, filter_fqns=filter_fqns)
  if model_config.scan_layers and not scan_layers:
    params = unstack_layers(params, model_config.n_layers)
    model_config = dataclasses.replace(model_config, scan_layers=False)
  model = Transformer(model_config, decode=True, execution=execution, kv_cache_dtype=kv_cache_dtype)
  if scheme != "bf16":
    model = inference.convert_for_inference(model, scheme, execution=execution)
  keep_f32 = {inference.weights.KERNEL_SCALE, inference.weights.SMOOTH}
  flat = traverse_util.flatten_dict(params)
  flat = {p: v if p[-1] in keep_f32 else cast_floating(v, model_config.dtype) for p, v in flat.items()}
  return model, traverse_util.unflatten_dict(flat)


def init_cache(model: Transformer, batch_size: int, max_len: int) -> Any:
  """A zero KV cache for ``batch_size`` sequences of up to ``max_len`` tokens (no parameters are built)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((batch_size, max_len), jnp.int32)))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


# ---------------------------------------------------------------------------------------------
# Sampling and the decode loop


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """Next tokens ``[B]`` int32 from ``logits [B, V]``: greedy when ``temperature == 0``, else top-k sampling."""
  if temperature <= 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Generator:
  """Jitted ``prefill(params, cache, prompt [B, P], key) -> (cache, first [B])`` and
  ``decode(params, cache, token [B], key) -> (cache, tokens [B, n])`` for one model and sampler."""

  prefill: Callable
  decode: Callable


def make_generator(model: Transformer, new_tokens: int, temperature: float = 0.0, top_k: int = 0) -> Generator:
  """Jitted prefill and a decode loop of ``new_tokens - 1`` steps (the first comes from the prefill)."""

  def forward(params, cache, tokens):
    logits, state = model.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
    return logits[:, -1], state["cache"]

  def prefill(params, cache, prompt, key):
    logits, cache = forward(params, cache, prompt)
    return cache, sample(logits, key, temperature, top_k)

  def decode(params, cache, token, key):
    def step(carry, step_key):
      cache, token = carry
      logits, cache = forward(params, cache, token[:, None])
      token = sample(logits, step_key, temperature, top_k)
      return (cache, token), token

    (cache, _), tokens = jax.lax.scan(step, (cache, token), jax.random.split(key, max(new_tokens - 1, 0)))
    return cache, tokens.T

  return Generator(jax.jit(prefill, donate_argnums=1), jax.jit(decode, donate_argnums=1))


@dataclasses.dataclass
class GenerationResult:
  tokens: np.ndarray  # [B, new_tokens] int32
  prefill_s: float
  decode_s: float
  compile_s: float

  @property
  def decode_tokens_per_s(self) -> float:
    b, n = self.tokens.shape
    return b * (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else float("nan")


def generate(model: Transformer, params: Any, prompt: np.ndarray, new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, max_len: int | None = None) -> GenerationResult:
  """Generate ``new_tokens`` after ``prompt [B, P]`` (int32); times prefill and decode after compiling both."""
  if new_tokens < 1:
    raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, prompt_len = prompt.shape
  max_len = max_len or prompt_len + new_tokens
  if max_len < prompt_len + new_tokens:
    raise ValueError(f"max_len={max_len} cannot hold {prompt_len} prompt + {new_tokens} new tokens")
  gen = make_generator(model, new_tokens, temperature, top_k)
  prefill_key, decode_key = jax.random.split(jax.random.key(seed))
  cache = init_cache(model, batch, max_len)

  start = time.perf_counter()
  prefill = gen.prefill.lower(params, cache, prompt, prefill_key).compile()
  first = jax.ShapeDtypeStruct((batch,), jnp.int32)
  decode = gen.decode.lower(params, cache, first, decode_key).compile()
  compile_s = time.perf_counter() - start

  start = time.perf_counter()
  cache, token = jax.block_until_ready(prefill(params, cache, prompt, prefill_key))
  prefill_s = time.perf_counter() - start
  start = time.perf_counter()
  cache, rest = jax.block_until_ready(decode(params, cache, token, decode_key))
  decode_s = time.perf_counter() - start
  tokens = np.concatenate([np.asarray(token)[:, None], np.asarray(rest)], axis=1)
  return GenerationResult(tokens, prefill_s, decode_s, compile_s)


def until_eos(tokens: np.ndarray, eos_id: int | None = data.EOS_ID) -> np.ndarray:
  """The tokens before the first ``eos_id`` (all of them when it is None)."""
  ends = np.flatnonzero(tokens == eos_id) if eos_id is not None else np.zeros(0, np.int64)
  return tokens[: ends[0]] if ends.size else tokens


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m train.generate", description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", required=True, help="a train.main --workdir (RUN_DIR)")
  parser.add_argument("--scheme", default="w8a16", choices=SCHEMES)
  parser.add_argument("--prompt", default="", help="text to continue (tokenized by the run's data.tokenizer: byte, [BOS] + UTF-8 bytes, or its tokenizer.json)")
  parser.add_argument("--max_new_tokens", type=int, default=DEFAULT_NEW_TOKENS)
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--batch_size", type=int, default=1, help="copies of the prompt decoded together")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--scan_layers", action="store_true",
                      help="keep nn.scan over the layers (default: unrolled, faster decode on GPU)")
  parser.add_argument("--kv_cache_dtype", default="auto", choices=kv_cache.KV_CACHE_DTYPES,
                      help="auto: keys and values in the compute dtype (bf16); int8: one scale per token and kv head")
  parser.add_argument("--filter_fqns", default="lm_head",
                      help="comma-separated layer paths kept high precision (default: lm_head)")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.max_new_tokens < 1 or args.batch_size < 1 or args.temperature < 0 or args.top_k < 0:
    print("error: --max_new_tokens and --batch_size must be >= 1, --temperature and --top_k >= 0", file=sys.stderr)
    return 2
  spec, model_config, params, step = load_run(args.checkpoint, args.step)
  note = scheme_note(args.scheme, spec.recipe)
  if note:
    print(note, file=sys.stderr)
  linear_bytes = inference.weight_bytes(params)
  filter_fqns = tuple(f.strip() for f in args.filter_fqns.split(",") if f.strip())
  model, params = prepare(model_config, params, args.scheme, filter_fqns, args.scan_layers, spec.execution,
                          args.kv_cache_dtype)
  tokenizer = data.tokenizer_for(spec.data.tokenizer)  # the run's own
  prompt = np.tile(tokenizer.encode_prompt(args.prompt), (args.batch_size, 1))
  result = generate(model, params, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
  print(args.prompt + tokenizer.decode(until_eos(result.tokens[0], tokenizer.eos_id)))
  print(
      f"\n[{args.scheme}] step {step}, recipe {spec.recipe}: parameters {inference.weight_bytes(params) / 2**20:.1f} "
      f"MiB (checkpoint float32 {linear_bytes / 2**20:.1f} MiB); prompt {prompt.shape[1]} tokens, prefill "
      f"{result.prefill_s * 1e3:.1f} ms; {result.tokens.shape[1]} new tokens x {args.batch_size}: decode "
      f"{result.decode_tokens_per_s:.1f} tokens/s, KV cache {args.kv_cache_dtype} (compile {result.compile_s:.1f} s, "
      f"{jax.devices()[0].device_kind})",
      flush=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),)))
