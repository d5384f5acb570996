"""Block-wise weight quantization ops (FP8 e4m3 / INT8, 128×128 tiles) that trace under torch.compile."""

from .fp8 import (
    BLOCK_QUANTIZE_OPS,
    fp8_block_dequantize,
    fp8_block_linear,
    fp8_block_quantize,
    int8_block_dequantize,
    int8_block_linear,
    int8_block_quantize,
    quantize_sharded,
)

__all__ = [
    "BLOCK_QUANTIZE_OPS",
    "fp8_block_dequantize",
    "fp8_block_linear",
    "fp8_block_quantize",
    "int8_block_dequantize",
    "int8_block_linear",
    "int8_block_quantize",
    "quantize_sharded",
]
