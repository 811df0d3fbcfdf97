"""`mlxd` command line: `mlxd serve`, `mlxd quantize`, `mlxd bench`.

Argument parsing happens before anything imports `mlx`, so that `--blas` can choose the BLAS
library that MLX will bind to (see `mlxd.blas`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="start the HTTP server (default command)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="local model directory or Hugging Face repo id "
                   "(default: the bundled tinycoder-16m)")
    g.add_argument("--revision", default=None, help="Hugging Face revision (branch, tag, commit)")
    g.add_argument("--served-model-name", default=None, help="model name reported by the API")
    g.add_argument("--chat-template", default=None, help="a Jinja chat template (string or file) "
                   "that replaces the tokenizer's")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto = float32 on a CPU, the checkpoint's dtype elsewhere")
    g.add_argument("--blas", default=None, help="CPU BLAS: auto (default: an installed OpenBLAS), "
                   "a library path, or none (MLX's bundled reference BLAS)")
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins, e.g. '*'")
    g.add_argument("--api-key", default=os.environ.get("MLXD_API_KEY"),
                   help="require this key (Bearer or x-api-key); env MLXD_API_KEY")
    g.add_argument("--supervise", action="store_true",
                   help="run the server in a child process and start it again if a native crash "
                        "(SIGABRT, SIGSEGV, OOM kill) ends it; clean exits are not restarted "
                        "(mlxd/supervise.py)")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="with --supervise: restarts in a row before giving up (a server that ran "
                        "10 minutes resets the count)")
    g.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    g = p.add_argument_group("request defaults")
    g.add_argument("--max-tokens", type=int, default=512,
                   help="max_tokens for requests that do not set it")
    g.add_argument("--temp", type=float, default=None,
                   help="temperature for requests that do not set it (default 1.0, as OpenAI)")
    g.add_argument("--top-p", type=float, default=None,
                   help="top_p for requests that do not set it (default 1.0)")
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=128, help="rows decoding at once")
    g.add_argument("--prefill-chunk", type=int, default=512,
                   help="tokens per prefill forward for long prompts")
    g.add_argument("--prefill-budget", type=int, default=2048,
                   help="rows x tokens of prefill work per engine step")
    g.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests before new ones get 429")
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-bits", type=int, default=16, choices=[16, 8, 4],
                   help="KV precision: 16 = model dtype, 8 / 4 = MLX affine quantized")
    g.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64],
                   help="quantization group size for --kv-bits 8/4")
    g.add_argument("--max-kv-size", type=int, default=None,
                   help="cap full-attention layers to a ring of this many tokens (sinks kept)")
    g.add_argument("--prefix-cache-bytes", type=str, default="1GiB",
                   help="prefix cache budget (LRU), e.g. 512MiB; 0 disables it")
    g.add_argument("--memory-budget", type=str, default=None,
                   help="weights + KV + prefill budget for admission (default: 75%% of device "
                        "memory); requests that cannot fit are queued or refused (413/503)")
    g.add_argument("--mlx-cache-limit", type=str, default=None,
                   help="bytes of freed MLX buffers kept for reuse, e.g. 256MiB; 0 = none "
                        "(default: MLX's own limit, at most a tenth of --memory-budget); the "
                        "engine also empties this cache and trims malloc when it goes idle")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=None, choices=["none", "draft", "ngram"],
                   help="drafter: a draft model (--draft-model) or n-gram prompt lookup "
                        "(default: draft when --draft-model is given, else none)")
    g.add_argument("--draft-model", default=None,
                   help="draft model directory (same tokenizer as --model)")
    g.add_argument("--num-draft-tokens", type=int, default=4,
                   help="ceiling of the adaptive draft length per row")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mlxd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    _serve_parser(sub)
    q = sub.add_parser("quantize", help="trellis-quantize a model directory", add_help=False)
    q.add_argument("rest", nargs=argparse.REMAINDER)
    b = sub.add_parser("bench", help="benchmark mlxd against peer servers", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    if argv and argv[0] == "quantize":  # their own parsers (argparse's REMAINDER drops --help)
        from mlxd.quantize import main as quantize_main

        return quantize_main(argv[1:])
    if argv and argv[0] == "bench":
        from bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    if args.command == "quantize":
        from mlxd.quantize import main as quantize_main

        return quantize_main(args.rest)
    if args.command == "bench":
        from bench.__main__ import main as bench_main

        return bench_main(args.rest)
    if getattr(args, "supervise", False) and not os.environ.get("MLXD_SUPERVISED"):
        from mlxd.supervise import child_argv, supervise

        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return supervise(child_argv(argv), max_restarts=args.max_restarts)
    return serve(args)


def serve(args: argparse.Namespace) -> int:
    if args.blas:
        os.environ["MLXD_BLAS"] = args.blas
    from server.metrics import install_log_request_ids

    install_log_request_ids()  # every record gets request_id ("-" outside a request)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s",
    )
    log = logging.getLogger("mlxd")
    from engine.kv.batch import UnsupportedKV
    from mlxd.runtime import build_client

    try:
        client = build_client(args)
    except UnsupportedKV as exc:  # a configuration this device cannot run: say so, no traceback
        print(f"mlxd: error: {exc}", file=sys.stderr)
        return 2
    extra = client.model.extra
    log.info(
        "model %s (%s) on %s, dtype %s, BLAS: %s",
        client.model.model_id,
        client.model.path,
        extra.get("device"),
        extra.get("dtype"),
        extra.get("blas"),
    )
    import uvicorn

    from server.app import create_app
    from server.config import ServerConfig

    config = ServerConfig(
        host=args.host,
        port=args.port,
        model_alias=args.served_model_name,
        allowed_origins=list(args.allowed_origins or []),
        api_key=args.api_key,
        default_max_tokens=args.max_tokens,
        default_temperature=args.temp,
        default_top_p=args.top_p,
        log_level=args.log_level,
    )
    app = create_app(client, config)
    client.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        client.stop()
    _exit_without_teardown(0)
    return 0


def _exit_without_teardown(code: int) -> None:
    """End the process once the server and the engine have stopped, skipping interpreter
    teardown: there MLX's C++ static destructors race its own worker threads and the process
    could abort ("terminate called without an active exception", exit -6) after a clean
    shutdown — 3 of 4 SIGINTs under load did at 20ecf83."""
    import mlx.core as mx

    mx.synchronize()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
