"""Run the fused trellis mat-vec on a few shapes for Nsight Compute (session 7 probe).

    ncu --section SpeedOfLight --section ComputeWorkloadAnalysis ... python3 probe_ncu.py

Large stacked n_out so that each launch streams from HBM; random codes (speed does not depend on
the values); the tuned layout of the real shape, as bench/trellis_speed.py launches it.
"""

import sys

import mlx.core as mx
import numpy as np

from kernels.trellis import matvec

for n_out, n_in, batch, copies in ((14336, 4096, 1, 8), (4096, 4096, 1, 24), (4096, 4096, 4, 24)):
    bits = 3
    rng = np.random.default_rng(0)
    rows = n_out * copies
    packed = mx.array(rng.integers(0, 2**32, size=(rows, n_in * bits // 32), dtype=np.uint32))
    scales = mx.array(rng.uniform(0.5, 2, rows).astype(np.float16))
    x = mx.random.normal((batch, n_in)).astype(mx.float32)
    cfg = matvec.default_config(n_out, n_in, batch, matvec.fused_backend(), bits)
    print(n_out, n_in, batch, cfg.key(), file=sys.stderr)
    for _ in range(3):
        y = matvec.trellis_matvec(x, packed, scales, bits=bits, L=16, block=256, config=cfg)
        mx.eval(y)
