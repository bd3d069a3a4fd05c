"""Number formats as pure functions with exact specifications, the same bits on every
backend (XLA:CPU, XLA:GPU), each checked against a reference (FBGEMM's C++ transcribed in
numpy, ml_dtypes, microxcaling's algorithm in float64):

  rowwise   FBGEMM row-wise 8-bit (float32 scale / bias) and N-bit (2, 4, 8; float16
            scale / bias, packed low bits first) for embedding tables (arXiv 2101.05615)
  floats    bfloat16 round-to-nearest-even and stochastic rounding (arXiv 1905.12322);
            OCP FP8 E4M3 / E5M2 with per-tensor or row-wise scaling
  mx        OCP Microscaling v1.0 (MXFP8 / MXFP6 / MXFP4 / MXINT8, E8M0 block scales) and
            the BDR MX9 / MX6 / MX4 of arXiv 2302.08007 (shared micro-exponents)
  groupwise group-wise int8 / int4 weights in ggml's Q8_0 / Q4_0 / Q4_1 layouts (float16
            scale, optional minimum per 32 columns) for weight-only quantized inference
  formats   the element grids (bf16, fp16, E4M3, E5M2, E3M2, E2M3, E2M1, MX ints) and exact
            round-to-nearest onto them, in integer arithmetic
  exact     float32 division, min / max and fused multiply-add that no backend rounds
            differently (why plain jnp does not: see its docstring)
  qsnr      QSNR of every format on Gaussian data (experiments.mx_qsnr; import it
            explicitly: `from core.quant import qsnr`)

`from core import quant` exposes the functions of every submodule.
"""

from core.quant import exact, formats
from core.quant.floats import (
    FP8_FORMATS, FP8_MIN_AMAX, Fp8Tensor, dequantize_fp8, fp8_amax, fp8_scales, quantize_fp8,
    quantize_fp8_reference,
    stochastic_round_bf16, stochastic_round_bf16_bits, stochastic_round_bf16_bits_reference,
    to_bf16, to_bf16_reference)
from core.quant.formats import (
    BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FORMATS, FP16, INT4, INT8, Format, get_format,
    round_to_format)
from core.quant.groupwise import (
    GroupQuantized, dequantize_groupwise, dequantize_groupwise_reference, from_ggml_blocks,
    groupwise_error_bound, quantize_groupwise)
from core.quant.mx import (
    BDR_FORMATS, MX_FORMATS, BDRArray, MXArray, bdr_round, bdr_round_reference,
    dequantize_bdr, dequantize_mx, mx_round, mx_round_reference, quantize_bdr, quantize_mx)
from core.quant.rowwise import (
    INT8_EPS, NBIT_RATES, RowwiseQuantized, dequantize_rowwise, dequantize_rowwise_int4,
    dequantize_rowwise_int4_reference, dequantize_rowwise_int8,
    dequantize_rowwise_int8_reference, dequantize_rowwise_nbit,
    dequantize_rowwise_nbit_reference, from_fused_bytes, pack_nbit, packed_width,
    quantize_rowwise, quantize_rowwise_int4, quantize_rowwise_int4_reference,
    quantize_rowwise_int8, quantize_rowwise_int8_reference, quantize_rowwise_nbit,
    quantize_rowwise_nbit_reference, rowwise_error_bound, to_fused_bytes, unpack_int4,
    unpack_nbit)
