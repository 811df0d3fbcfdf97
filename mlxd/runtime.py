"""Build the engine client from CLI arguments (or keyword arguments, in tests and benchmarks),
and say in a line what to do when a model cannot be loaded (`describe_load_error`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

BLAS_KEYWORDS = ("", "auto", "none", "off", "0", "reference")


class StartupError(Exception):
    """A setting this machine cannot run with; the message names the flag and what to do."""


def build_client(args: argparse.Namespace | None = None, **overrides: Any):
    """Load the model and return an (unstarted) `engine.core.AsyncEngine`."""
    opts = dict(vars(args)) if args is not None else {}
    opts.update(overrides)
    # imported here, not at module level: the CLI reads BLAS_KEYWORDS before --blas is set
    from kernels import device

    info = device.load()  # before mlx is imported
    wanted = str(opts.get("blas") or "")
    if wanted.strip().lower() not in BLAS_KEYWORDS and info.path is None:
        raise StartupError(f"--blas {wanted}: {info.reason}; give a CBLAS library such as "
                           "libopenblas.so.0, or auto / none")
    trace = opts.get("trace_steps")
    if trace:  # the engine opens it after the load: a bad path is the flag's error, not the model's
        try:
            with open(trace, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise StartupError(f"--trace-steps {trace}: cannot write it: "
                               f"{exc.strerror or exc}") from None
    import mlx.core as mx

    from engine.core import AsyncEngine, Engine
    from engine.loader import load_model
    from engine.lora import AdapterError
    from mlxd import model_source

    adapters = list(opts.get("adapters") or [])
    config = _engine_config(opts)
    if opts.get("models"):
        client = _pool_client(opts, config, adapters)
    else:
        try:
            loaded = load_model(
                model_source(opts.get("model")),
                dtype=opts.get("dtype", "auto"),
                chat_template=opts.get("chat_template"),
                revision=opts.get("revision"),
                adapters=adapters,
                prepare=opts.get("shard"),  # mlxd.distributed: this rank's share of the weights
            )
        except AdapterError as exc:
            raise StartupError(f"--adapter: {exc}") from None
        make_engine = opts.get("make_engine")  # mlxd.distributed: this rank's engine
        # built on the thread that will run it (EngineThread.spawn): what the warm-up builds
        # stays where the steps look for it
        client = (make_engine(loaded, config) if make_engine
                  else AsyncEngine(Engine.spawn(loaded, config)))
        if opts.get("served_model_name"):
            client.model.model_id = opts["served_model_name"]
    clash = {name for name, _ in adapters} & {client.model.model_id, client.model.path,
                                               *(n for n, _ in opts.get("models") or ())}
    if clash:
        raise StartupError(f"--adapter {sorted(clash)[0]}: the name is the model's own; "
                           "give the adapter another name")
    client.model.extra.update(
        blas={"path": info.path, "status": info.reason},
        device=str(mx.default_device()),
        mlx_version=getattr(mx, "__version__", "unknown"),
    )
    return client


def _prefix_cache_bytes(value: Any) -> int | None:
    """`--prefix-cache-bytes`: "auto" (None: the engine sizes it from the memory budget), or
    bytes (0: off)."""
    from engine.kv.memory import parse_bytes

    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    return parse_bytes(value) or 0


def _engine_config(opts: dict[str, Any]) -> Any:
    """The engine flags → engine.core.EngineConfig."""
    from engine.core import EngineConfig
    from engine.kv.batch import KVConfig
    from engine.kv.memory import parse_bytes
    from engine.scheduler import SchedulerConfig

    sched = SchedulerConfig(
        max_num_seqs=opts.get("max_num_seqs", 128),
        prefill_chunk=opts.get("prefill_chunk", 512),
        prefill_budget=opts.get("prefill_budget"),  # None: auto
        max_queue=opts.get("max_queue", 1024),
    )
    kv = KVConfig(
        kv_bits=opts.get("kv_bits", 16),
        kv_group_size=opts.get("kv_group_size", 64),
        max_kv_size=opts.get("max_kv_size"),
    )
    return EngineConfig(
        scheduler=sched,
        kv=kv,
        prefix_cache_bytes=_prefix_cache_bytes(opts.get("prefix_cache_bytes", "auto")),
        memory_budget=parse_bytes(opts.get("memory_budget")),
        mlx_cache_limit=parse_bytes(opts.get("mlx_cache_limit")),
        spec=_spec_config(opts),
        warmup=opts.get("warmup", True),
        trace_steps=opts.get("trace_steps"),
    )


def _pool_client(opts: dict[str, Any], config: Any, adapters: list[tuple[str, str]]) -> Any:
    """Several models by name (engine.pool): the first loads now, the others on first use."""
    from engine.lora import AdapterError
    from engine.pool import EnginePool, ModelSpec, PoolConfig
    from engine.pool_client import AsyncPool
    from mlxd import model_source

    specs = [
        ModelSpec(name, model_source(source or None), revision=opts.get("revision"),
                  adapters=tuple(adapters) if i == 0 else (),
                  chat_template=opts.get("chat_template") if i == 0 else None)
        for i, (name, source) in enumerate(opts["models"])
    ]
    keep_alive = opts.get("keep_alive")
    pool_config = PoolConfig(config, dtype=opts.get("dtype", "auto"),
                             keep_alive=None if keep_alive is None or keep_alive < 0 else keep_alive)
    if opts.get("load_slice_bytes"):
        pool_config.load_slice_bytes = int(opts["load_slice_bytes"])
    try:
        return AsyncPool(EnginePool.spawn(specs, pool_config))
    except AdapterError as exc:
        raise StartupError(f"--adapter: {exc}") from None


def _spec_config(opts: dict[str, Any]) -> Any:
    """--spec / --draft-model / --num-draft-tokens -> engine.spec.SpecConfig (None: off); by
    default the requests' predicted outputs are drafted from (nothing else)."""
    method = opts.get("spec") or ("draft" if opts.get("draft_model") else "prediction")
    if method == "none":
        return None
    from engine.spec import SpecConfig

    return SpecConfig(
        method=method,
        draft_model=opts.get("draft_model"),
        num_draft_tokens=opts.get("num_draft_tokens"),
        draft_dtype=opts.get("dtype", "auto"),
    )


def describe_load_error(exc: BaseException, model: str | None) -> str:
    """One or two lines for a model that failed to load: what went wrong and what to do."""
    name = model or "(the bundled model)"
    kinds = {c.__name__ for c in type(exc).__mro__}
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "GatedRepoError" in kinds:
        return (f"--model {name}: a gated repository; accept its terms on huggingface.co and set "
                "HF_TOKEN")
    if "RepositoryNotFoundError" in kinds:
        return (f"--model {name}: no such repository on the Hugging Face Hub (a private one "
                "needs HF_TOKEN); check the id, or give a local model directory")
    if "RevisionNotFoundError" in kinds:
        return f"--revision: no such revision of {name} on the Hugging Face Hub"
    if "LocalEntryNotFoundError" in kinds or "OfflineModeIsEnabled" in kinds:
        why = ("HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
               else "the Hub could not be reached")
        return (f"--model {name}: not in the local Hugging Face cache and {why}; download it "
                f"where there is a network (hf download {name}), or give a local model directory")
    if isinstance(exc, FileNotFoundError):
        missing = str(exc.filename or "")
        if missing.endswith("config.json"):
            return (f"--model {name}: not a model directory (no config.json in "
                    f"{os.path.dirname(missing)}); give the directory that holds config.json "
                    "and the weights")
        return (f"--model {name}: no such directory; give a local model directory or a Hugging "
                "Face repo id (owner/name)")
    return (f"could not load --model {name}: {type(exc).__name__}: {text[:300]}\n"
            "(run with --log-level DEBUG for the traceback)")
