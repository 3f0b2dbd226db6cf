"""benchmarks/kernel_sass.py: the Triton IR capture and the hot-loop count, on the CPU (no triton package needed)."""

import sys

import pytest

from benchmarks import kernel_sass
from pallas_kernels import w8a16

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
        /*0020*/                   LDGSTS.E.BYPASS.128 [R13+0x6000], desc[UR10][R4.64], !P1 ;  /* 0x0 */
        /*0030*/                   HMMA.16816.F32.BF16 R28, R16, R28, RZ ;  /* 0x0 */
        /*0040*/                   LOP3.LUT R29, R18, 0xff7fff7f, RZ, 0xc0, !PT ;  /* 0x0 */
        /*0050*/               @P0 LOP3.LUT R28, R16, 0xff7fff7f, RZ, 0xc0, !PT ;  /* 0x0 */
        /*0060*/                   HMMA.16816.F32.BF16 R24, R24, R32, R28 ;  /* 0x0 */
        /*0070*/               @P0 BRA 0x30 ;                              /* 0x0 */
        /*0080*/                   IADD3 R2, R2, 0x1, RZ ;                 /* 0x0 */
        /*0090*/              @!P2 BRA 0x80 ;                              /* 0x0 */
        /*00a0*/                   EXIT ;                                  /* 0x0 */
        /*00b0*/                   BRA 0xb0;                               /* 0x0 */
"""


def test_hot_loop_counts_the_longest_backward_branch_span_by_opcode():
  count, ops = kernel_sass.hot_loop(SASS)
  assert count == 5  # 0x30 .. 0x70; the one-instruction loop at 0x80 and the self-branch after EXIT are shorter
  assert ops == {"HMMA": 2, "LOP3": 2, "BRA": 1}  # the guarded LOP3 counts as LOP3


def test_hot_loop_of_code_without_a_loop_is_empty():
  assert kernel_sass.hot_loop("\n".join(SASS.splitlines()[:5])) == (0, {})


def test_hot_loop_takes_unguarded_and_modified_branches_within_each_function():
  second = """
        Function : second
        /*0000*/                   S2R R0, SR_TID.X ;                      /* 0x0 */
        /*0010*/                   IMAD R2, R0, R0, RZ ;                   /* 0x0 */
        /*0020*/                   IMAD R3, R2, R2, RZ ;                   /* 0x0 */
        /*0030*/                   IMAD R4, R3, R3, RZ ;                   /* 0x0 */
        /*0040*/                   IMAD R5, R4, R4, RZ ;                   /* 0x0 */
        /*0050*/                   IMAD R6, R5, R5, RZ ;                   /* 0x0 */
        /*0060*/                   BRA.U 0x10 ;                            /* 0x0 */
"""
  # the second function's loop (0x10 .. 0x60, unguarded BRA.U) is the longer one; its addresses restart at 0, so
  # it must not be read against the first function's instructions
  count, ops = kernel_sass.hot_loop("        Function : first\n" + SASS + second)
  assert (count, ops) == (6, {"IMAD": 5, "BRA": 1})


def test_the_w8a16_kernels_triton_ir_is_captured_with_its_launch_parameters():
  import jax
  import jax.numpy as jnp

  k, n = 2048, 16384
  config = w8a16.config_for(1, n, k)
  args = (jax.ShapeDtypeStruct((1, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int8),
          jax.ShapeDtypeStruct((n,), jnp.float32))
  from jax._src.pallas.triton import pallas_call_registration as registration

  original = registration.lowering.lower_jaxpr_to_triton_module
  [module] = kernel_sass.triton_modules(lambda x, w, s: w8a16.w8a16_matmul_kernel(x, w, s, config=config), *args)
  assert module.name == "jaxlowbit_w8a16_matmul"
  assert (module.num_warps, module.num_stages) == (config.num_warps, config.num_stages)
  assert "tt.dot" in module.ir and "tt.func public @jaxlowbit_w8a16_matmul" in module.ir
  assert registration.lowering.lower_jaxpr_to_triton_module is original  # the capture is undone


def test_two_kernels_each_get_their_own_launch_parameters():
  import jax
  import jax.numpy as jnp

  from pallas_kernels import dp4a_gemv

  k, n_w8a16, n_ternary = 2048, 16384, 2048
  w_config = w8a16.config_for(1, n_w8a16, k)  # tensor cores, 4 stages
  t_config = dp4a_gemv.config_for(n_ternary, k // 4, m=1, codes=True)  # 3 stages
  assert (w_config.num_warps, w_config.num_stages) != (t_config.num_warps, t_config.num_stages)
  f = jax.ShapeDtypeStruct

  def both(x, wq, s, xq, sx, wp, sw):
    return w8a16.w8a16_matmul_kernel(x, wq, s), dp4a_gemv.a8w2_gemv_kernel(xq, sx, wp, sw)

  modules = kernel_sass.triton_modules(both, f((1, k), jnp.bfloat16), f((n_w8a16, k), jnp.int8),
                                       f((n_w8a16,), jnp.float32), f((1, k), jnp.int8), f((1, 1), jnp.float32),
                                       f((n_ternary, k // 4), jnp.int8), f((1,), jnp.float32))
  launches = {m.name: (m.num_warps, m.num_stages) for m in modules}
  assert launches == {"jaxlowbit_w8a16_matmul": (w_config.num_warps, w_config.num_stages),
                      "jaxlowbit_ternary_gemv": (t_config.num_warps, t_config.num_stages)}


def test_kernels_of_one_name_with_different_launch_parameters_are_refused():
  import dataclasses

  import jax
  import jax.numpy as jnp

  k, n = 2048, 2048
  config = w8a16.config_for(1, n, k)
  other = dataclasses.replace(config, num_warps=config.num_warps * 2)
  f = jax.ShapeDtypeStruct

  def twice(x, wq, s):
    return (w8a16.w8a16_matmul_kernel(x, wq, s, config=config), w8a16.w8a16_matmul_kernel(x, wq, s, config=other))

  with pytest.raises(RuntimeError, match="lower one such kernel at a time"):
    kernel_sass.triton_modules(twice, f((1, k), jnp.bfloat16), f((n, k), jnp.int8), f((n,), jnp.float32))


def test_without_triton_compile_sass_names_the_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "triton", None)
  module = kernel_sass.TritonModule("k", "module {}", 4, 3)
  with pytest.raises(ImportError, match="pip install triton"):
    kernel_sass.compile_sass(module)


def test_a_tiling_the_kernel_cannot_take_is_one_error_line(capsys):
  assert kernel_sass.main(["--k", "8192", "--n", "2048", "--tiling", "32,96,2,4"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: the W8A16 kernel does not tile [N=2048, K=8192]")


@pytest.mark.parametrize("bad", ["32,128,2", "32,128,0,4", "a,b,c,d"])
def test_a_malformed_tiling_is_refused(bad):
  with pytest.raises(SystemExit):
    kernel_sass.main(["--tiling", bad])
