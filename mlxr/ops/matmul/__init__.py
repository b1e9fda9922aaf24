"""Triton quantized matmul kernels over MLX weights, by shape regime: decode GEMV of one row on
CUDA cores (`decode_gemv_q4`, 4-bit) and on tensor cores (`decode_gemv_tc`, 1-16 rows, every
format through its load-time copy), decode GEMV of up to 16 rows on the file's words
(`decode_gemv`), prefill GEMM (`prefill_gemm`, fused) and prefill dequantization for cuBLAS
(`prefill_dequant`), the generic GEMV/GEMM of every format (`generic_qmm`), and what they share
(`codes`: code decoding, `weight_tiles`: dequantized tiles)."""
