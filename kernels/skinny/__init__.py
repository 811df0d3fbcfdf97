"""Fused few-row matmul ("skinny GEMM") y = x @ w.T for 2..16 rows of x on CUDA (docs/kernels.md).

MLX-CUDA takes its gemv kernel only for one row of x and cuBLASLt from two rows on, which costs
2-3x the gemv per call for decode-sized problems; this kernel reads w once for all rows.
"""

from .kernel import MAX_ROWS, layout, skinny_matmul, skinny_matmul_cpu_harness, supported

__all__ = ["MAX_ROWS", "layout", "skinny_matmul", "skinny_matmul_cpu_harness", "supported"]
