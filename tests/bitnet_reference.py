"""The BitNet b1.58 forward (sub-norm placement) in float64 numpy: the graph both exports are checked against.

Transformers' ``BitNetForCausalLM`` and llama.cpp's ``bitnet`` graph compute the same model: per layer a
pre-norm, q/k/v, rotate-half RoPE, causal grouped-query attention, ``attn_sub_norm`` before the output
projection, a pre-norm, a gated MLP (SiLU or squared ReLU) with ``ffn_sub_norm`` before the down
projection; a final norm and the head. What differs between the two files is only where the tensors are
and how a linear reads its ternary weight, so a test passes its file's names and its own ``linear``
(tests/test_hf_bitnet.py: the HF folder; tests/test_gguf.py: the GGUF file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

ACTIVATIONS = {"silu": lambda g: g / (1 + np.exp(-g)), "relu2": lambda g: np.maximum(g, 0) ** 2}
# A layer's tensors, by role: the four norms' weights and the seven linears (the file's names, formatted with
# the layer's index).
ROLES = ("attn_norm", "q", "k", "v", "attn_sub_norm", "o", "ffn_norm", "gate", "up", "ffn_sub_norm", "down")


@dataclasses.dataclass(frozen=True)
class Shape:
  """Attention sizes and constants: ``heads`` query heads of ``head_dim``, ``kv_heads`` key/value heads."""

  heads: int
  kv_heads: int
  head_dim: int
  eps: float  # the RMSNorms'
  theta: float  # RoPE's base
  activation: str  # a key of ACTIVATIONS


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
  """``x [..., D]`` float64 normalized by its root mean square, times ``weight [D]``."""
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def _attention(q, k, v, shape: Shape) -> np.ndarray:
  """Causal grouped-query attention with rotate-half RoPE: ``q [B, T, H hd]``, ``k, v [B, T, KV hd]``
  -> ``[B, T, H hd]`` float64."""
  b, seq, _ = q.shape
  heads, kv, hd = shape.heads, shape.kv_heads, shape.head_dim
  inv_freq = shape.theta ** (-np.arange(0, hd, 2) / hd)
  angles = np.concatenate([np.arange(seq)[:, None] * inv_freq[None]] * 2, -1)

  def rope(x):
    return x * np.cos(angles) + np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * np.sin(angles)

  q = rope(q.reshape(b, seq, heads, hd).transpose(0, 2, 1, 3))
  k = np.repeat(rope(k.reshape(b, seq, kv, hd).transpose(0, 2, 1, 3)), heads // kv, axis=1)
  v = np.repeat(v.reshape(b, seq, kv, hd).transpose(0, 2, 1, 3), heads // kv, axis=1)
  scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + np.triu(np.full((seq, seq), -np.inf), 1)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  return (probs / probs.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(b, seq, heads * hd)


def bitnet_logits(tokens: np.ndarray, *, embedding: np.ndarray, head: np.ndarray, final_norm: np.ndarray,
                  n_layers: int, names: Mapping[str, str], norm_weight: Callable[[str], np.ndarray],
                  linear: Callable[[np.ndarray, str], np.ndarray], shape: Shape) -> np.ndarray:
  """Logits ``[B, T, V]`` float64 of ``tokens [B, T]`` int.

  Args:
    embedding: ``[V, D]`` float64; head: ``[V, D]`` (the embedding itself when tied); final_norm: ``[D]``.
    names: every role of :data:`ROLES` -> the tensor's name with ``{i}`` for the layer index.
    norm_weight: a norm's weight ``[D]`` float64 by name.
    linear: ``linear(x [..., K], name) -> [..., N]``: the file's ternary linear (activation quantization included).
  """
  act = ACTIVATIONS[shape.activation]
  x = embedding[tokens]
  for i in range(n_layers):
    name = {role: names[role].format(i=i) for role in ROLES}
    h = rms_norm(x, norm_weight(name["attn_norm"]), shape.eps)
    attn = _attention(*(linear(h, name[z]) for z in "qkv"), shape)
    x = x + linear(rms_norm(attn, norm_weight(name["attn_sub_norm"]), shape.eps), name["o"])
    h = rms_norm(x, norm_weight(name["ffn_norm"]), shape.eps)
    hidden = act(linear(h, name["gate"])) * linear(h, name["up"])
    x = x + linear(rms_norm(hidden, norm_weight(name["ffn_sub_norm"]), shape.eps), name["down"])
  return rms_norm(x, final_norm, shape.eps) @ head.T
