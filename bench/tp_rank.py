"""One rank of `python -m bench tp`'s step timing, run under mlx.launch (every rank runs it).

    mlx.launch -n 2 --backend ring -- python -m bench.tp_rank MODEL_DIR OUT.json [--rows 1,16]

Loads MODEL_DIR tensor-sharded over the group (as `mlxd serve --tensor-parallel` does), then
times a decode step (one token per row, over a prompt's KV) at each row count: as served
(with its all-reduces) and with the all-reduces replaced by the identity (the same compute,
no communication; its tokens are meaningless). The communication share of a step is
1 - (time without) / (time with). Rank 0 writes OUT.json. With a group of one rank it times
the unsharded model (the single-process baseline).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import engine  # noqa: F401  (BLAS before mlx, which is imported below, in the functions)

PROMPT_TOKENS = 128


def _load(path: Path, group: Any) -> Any:
    from mlx_lm.utils import load_config

    from engine.distributed import shard_model
    from engine.loader import load_model

    config = load_config(path)
    prepare = None
    if group.size() > 1:
        def prepare(model: Any) -> None:
            shard_model(model, config, group, "tensor")
    return load_model(str(path), dtype="float32", prepare=prepare).model


def _step_seconds(model: Any, rows: int, steps: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.ones((rows, PROMPT_TOKENS), dtype=mx.int32)
    mx.eval(model(prompt, cache=cache))
    tokens = mx.ones((rows, 1), dtype=mx.int32)
    for _ in range(3):  # warm
        mx.eval(model(tokens, cache=cache))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(tokens, cache=cache)
        tokens = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
        mx.eval(tokens)
    return (time.perf_counter() - t0) / steps


class _NoComm:
    """mx.distributed.all_sum as the identity while in scope (the compute without its
    communication)."""

    def __enter__(self) -> None:
        import mlx.core as mx

        self._saved = mx.distributed.all_sum
        mx.distributed.all_sum = lambda x, *a, **k: x  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        import mlx.core as mx

        mx.distributed.all_sum = self._saved  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    path, out = Path(argv[0]), Path(argv[1])
    rows_list = [1, 16]
    steps = 20
    if "--rows" in argv:
        rows_list = [int(r) for r in argv[argv.index("--rows") + 1].split(",")]
    if "--steps" in argv:
        steps = int(argv[argv.index("--steps") + 1])
    import mlx.core as mx

    group = mx.distributed.init()
    model = _load(path, group)
    result: dict[str, Any] = {"ranks": group.size(), "steps": steps, "rows": {}}
    for rows in rows_list:
        with_comm = _step_seconds(model, rows, steps)
        entry = {"step_ms": round(with_comm * 1e3, 3), "tok_s": round(rows / with_comm, 1)}
        if group.size() > 1:
            with _NoComm():
                without = _step_seconds(model, rows, steps)
            entry["step_ms_no_comm"] = round(without * 1e3, 3)
            entry["comm_share"] = round(max(0.0, 1 - without / with_comm), 3)
        result["rows"][str(rows)] = entry
    if group.rank() == 0:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
