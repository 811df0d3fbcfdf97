"""Build the engine client from CLI arguments (or keyword arguments, in tests and benchmarks)."""

from __future__ import annotations

import argparse
from typing import Any

from mlxd import blas


def build_client(args: argparse.Namespace | None = None, **overrides: Any):
    """Load the model and return an (unstarted) `engine.core.AsyncEngine`."""
    opts = dict(vars(args)) if args is not None else {}
    opts.update(overrides)
    info = blas.load()  # before mlx is imported
    import mlx.core as mx

    from engine.core import AsyncEngine, Engine, EngineConfig
    from engine.kv.batch import KVConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    loaded = load_model(
        opts.get("model"),
        dtype=opts.get("dtype", "auto"),
        chat_template=opts.get("chat_template"),
        revision=opts.get("revision"),
    )
    sched = SchedulerConfig(
        max_num_seqs=opts.get("max_num_seqs", 128),
        prefill_chunk=opts.get("prefill_chunk", 512),
        prefill_budget=opts.get("prefill_budget", 2048),
        max_queue=opts.get("max_queue", 1024),
    )
    kv = KVConfig(
        kv_bits=opts.get("kv_bits", 16),
        kv_group_size=opts.get("kv_group_size", 64),
        max_kv_size=opts.get("max_kv_size"),
    )
    from engine.kv.memory import parse_bytes

    config = EngineConfig(
        scheduler=sched,
        kv=kv,
        prefix_cache_bytes=parse_bytes(opts.get("prefix_cache_bytes", "1GiB")) or 0,
        memory_budget=parse_bytes(opts.get("memory_budget")),
        mlx_cache_limit=parse_bytes(opts.get("mlx_cache_limit")),
        spec=_spec_config(opts),
    )
    client = AsyncEngine(Engine(loaded, config))
    if opts.get("served_model_name"):
        client.model.model_id = opts["served_model_name"]
    client.model.extra.update(
        blas={"path": info.path, "status": info.reason},
        device=str(mx.default_device()),
        mlx_version=mx.__version__,
    )
    return client


def _spec_config(opts: dict[str, Any]) -> Any:
    """--spec / --draft-model / --num-draft-tokens -> engine.spec.SpecConfig (None: off)."""
    method = opts.get("spec") or ("draft" if opts.get("draft_model") else "none")
    if method == "none":
        return None
    from engine.spec import SpecConfig

    return SpecConfig(
        method=method,
        draft_model=opts.get("draft_model"),
        num_draft_tokens=opts.get("num_draft_tokens") or 4,
        draft_dtype=opts.get("dtype", "auto"),
    )
