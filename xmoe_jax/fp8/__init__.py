"""FP8 training: quantization with current scaling, FP8 grouped GEMMs and FP8 dense projections.

    from xmoe_jax.fp8 import Recipe, gmm_fp8, dot_fp8, quantize, dequantize

Files, one per concern:
  formats.py   which 8-bit float "e4m3"/"e5m2" means on this platform (OCP on NVIDIA, fnuz on MI300)
  quantize.py  quantize / dequantize in tiles with current scaling (saturation, zero and NaN tiles)
  recipe.py    the three recipes (tensorwise, rowwise, blockwise) and which GEMMs run in FP8
  operands.py  GEMM operands quantized, scales laid out as the kernels read them
  gmm.py       gmm_fp8: the FP8 grouped GEMM's custom_vjp (kernels: kernels/gmm/pallas_fp8.py)
  dense.py     dot_fp8: FP8 dense projections (attention, dense and shared MLPs)
  dispatch.py  fp8_exchange: pft's routed rows on the wire in FP8, dequantized on arrival
  context.py   the ambient policy (model.fp8) saying which GEMMs run in FP8 while the model is traced
Measured on one H100 (benchmarks/fp8.md): the Pallas FP8 grouped GEMM is 0.55x our bf16 gmm today.
"""

from xmoe_jax.fp8.dense import dot_fp8
from xmoe_jax.fp8.formats import fp8_dtype
from xmoe_jax.fp8.gmm import gmm_fp8
from xmoe_jax.fp8.quantize import dequantize, fake_quantize, quantize
from xmoe_jax.fp8.recipe import RECIPES, Recipe

__all__ = ["RECIPES", "Recipe", "dequantize", "dot_fp8", "fake_quantize", "fp8_dtype", "gmm_fp8", "quantize"]
