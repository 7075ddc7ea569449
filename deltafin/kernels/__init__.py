"""Weight codecs (bf16, int8, int4, int6, MXFP4): quantize, dequantize, dequant-matmul.

The torch reference runs everywhere; Triton kernels (triton_kernels.py) are imported only when
``qlinear`` first meets a CUDA input.
"""
from .linear import CODECS, QWeight, dequantize, qlinear, quantize
from .mxfp4 import mxfp4_dequantize, mxfp4_linear, mxfp4_quantize

__all__ = ["CODECS", "QWeight", "dequantize", "qlinear", "quantize",
           "mxfp4_dequantize", "mxfp4_linear", "mxfp4_quantize"]
