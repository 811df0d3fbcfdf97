"""`mlxd` command line: `mlxd serve`, `mlxd quantize` (benchmarks: `python -m bench` in a checkout).

Argument parsing happens before anything imports `mlx`, so that `--blas` can choose the BLAS
library that MLX will bind to (see `kernels.device`). Every `serve` flag is checked here: a value out
of range ends the program with one line naming the flag and what it accepts (exit status 2), before
the model loads. A model that cannot be loaded ends it with one or two lines that say what to do
(the traceback only with `--log-level DEBUG`).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from mlxd import distributed

log = logging.getLogger("mlxd")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `mlxd serve: error: argument --port: ...` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.HelpFormatter):
    """Shows each option's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default in (None, False, argparse.SUPPRESS)
            or default == []
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


# -- value checks (argparse `type=` functions: the message names the allowed range) -----------


def _budget(text: str) -> int | None:
    """--prefill-budget: auto (None) or an integer >= 1."""
    return None if text.strip().lower() == "auto" else _int_in(1)(text)


# engine.api.MAX_DRAFT_TOKENS (tests/test_cli_serve.py checks they agree): the engine package is
# not imported before --blas has chosen the BLAS it loads
MAX_DRAFT_TOKENS = 32


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    allowed = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {value}")
        return value

    return check


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    allowed = f"a number from {lo:g} to {hi:g}"

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text}")
        return value

    return check


_UNITS = {
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "b": 1,
}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '64M', '2e9', '1000' -> bytes (ValueError otherwise)."""
    s = text.strip().lower().replace(" ", "").replace("_", "")
    mult = 1
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            s, mult = s[: -len(unit)], _UNITS[unit]
            break
    value = float(s) * mult
    if not math.isfinite(value):
        raise ValueError(text)
    return int(value)


def _size(lo: int) -> Callable[[str], int]:
    allowed = "a size such as 512MiB, 2GiB or 1000000 (bytes)"

    def check(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if value < lo:
            least = "more than 0" if lo == 1 else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"expected a size of {least} bytes, got {text!r}")
        return value

    return check


def _size_or_auto(lo: int) -> Callable[[str], int | str]:
    size = _size(lo)

    def check(text: str) -> int | str:
        return "auto" if text.strip().lower() == "auto" else size(text)

    return check


def _blas(text: str) -> str:
    from mlxd.runtime import BLAS_KEYWORDS  # mlxd.runtime imports no mlx at module level

    if text.strip().lower() in BLAS_KEYWORDS or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a file; give auto, none, or the path of a CBLAS library "
        "(e.g. /usr/lib/x86_64-linux-gnu/libopenblas.so.0)"
    )


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _api_key(text: str) -> str:
    if not text or text != text.strip():
        raise argparse.ArgumentTypeError(
            "must be a non-empty key without leading or trailing spaces"
        )
    return text


# -- parsers --------------------------------------------------------------------------------


def _adapter(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH (an adapter directory)")
    return name.strip(), path.strip()


def _model_arg(value: str) -> tuple[str | None, str]:
    """--model DIR (unnamed) or NAME=DIR; a name holds no '/' (so 'a/b=c' is a path)."""
    name, sep, path = value.partition("=")
    if sep and name.strip() and "/" not in name:
        if not path.strip():
            raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=DIR_OR_REPO")
        return name.strip(), path.strip()
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return None, value.strip()


def _models_dir(value: str) -> str:
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a directory")
    return value


def _keep_alive(value: str) -> float:
    from engine.api import keep_alive_seconds  # imports no mlx

    try:
        return keep_alive_seconds(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds or a duration such as 90s, 5m or 1h30m, got {value!r}") from None


def models_in(directory: str) -> list[tuple[str, str]]:
    """(folder name, path) of every subfolder of `directory` that holds a config.json, sorted."""
    found = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "config.json")):
            found.append((entry.name, entry.path))
    return found


def _split_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--model / --models-dir → `args.model` (one plain model: a DIR_OR_REPO, or None for the
    bundled one) and `args.models` ((name, source) pairs, the default first; [] for one plain
    model)."""
    given: list[tuple[str | None, str]] = list(args.model_args)
    several = (len(given) > 1 or any(n for n, _ in given) or args.models_dir is not None
               or args.keep_alive is not None)
    args.model = given[0][1] if given else None
    args.models = []
    if not several:
        return
    pairs = [(n or os.path.basename(os.path.normpath(src)), src) for n, src in given]
    if args.models_dir is not None:
        found = models_in(args.models_dir)
        if not found:
            parser.error(f"argument --models-dir: no subfolder of {args.models_dir} holds a "
                         "config.json")
        pairs += [p for p in found if p not in pairs]
    if not pairs:  # only --keep-alive: the bundled model, by its name
        from mlxd import DEFAULT_MODEL_NAME

        pairs = [(DEFAULT_MODEL_NAME, "")]
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        parser.error(f"argument --model: the name {twice[0]!r} is given to two models; name "
                     "them apart with NAME=DIR")
    if args.served_model_name:
        parser.error("argument --served-model-name: with several models each is served by its "
                     "NAME (--model NAME=DIR)")
    if args.draft_model:
        parser.error("argument --draft-model: a draft model serves one model; not with several "
                     "(--spec ngram works with any)")
    args.models = pairs
    args.model = pairs[0][1] or None


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="start the HTTP server", formatter_class=_Formatter,
                       description="Start the OpenAI- and Anthropic-compatible HTTP server.")
    g = p.add_argument_group("model")
    g.add_argument("--model", dest="model_args", action="append", type=_model_arg, default=[],
                   metavar="[NAME=]DIR_OR_REPO",
                   help="local model directory or Hugging Face repo id (default: the bundled "
                        "tinycoder-16m); repeat as NAME=DIR to serve several models by name, "
                        "loaded on first use (docs/models.md)")
    g.add_argument("--models-dir", type=_models_dir, default=None, metavar="DIR",
                   help="serve every subfolder of DIR that holds a config.json, named by the "
                        "folder, loaded on first use")
    g.add_argument("--keep-alive", type=_keep_alive, default=None, metavar="DURATION",
                   help="with several models: unload a model idle this long (seconds, or 90s, "
                        "5m, 1h; default: never, only to make room under --memory-budget); a "
                        "request may set its own keep_alive")
    g.add_argument("--revision", default=None, help="Hugging Face revision (branch, tag, commit)")
    g.add_argument("--served-model-name", type=_nonempty, default=None,
                   help="model name reported by the API (default: the model directory's name)")
    g.add_argument("--chat-template", default=None, help="a Jinja chat template (string or file) "
                   "that replaces the tokenizer's")
    g.add_argument("--adapter", dest="adapters", action="append", type=_adapter, default=[],
                   metavar="NAME=PATH",
                   help="a LoRA adapter (mlx-lm's adapter directory) served on the model (the "
                        "first one, with several) as model NAME; repeat for more "
                        "(docs/adapters.md)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto = float32 on a CPU, the checkpoint's dtype elsewhere")
    g.add_argument("--blas", type=_blas, default=None,
                   help="CPU BLAS: auto (default: an installed OpenBLAS), a library path, or none "
                        "(MLX's bundled reference BLAS, ~30x slower matmuls on a CPU)")
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=_int_in(0, 65535), default=8080,
                   help="TCP port; 0 = any free one (the log says which)")
    g.add_argument("--allowed-origins", nargs="*", default=[],
                   help="CORS origins, e.g. '*' (default: none, no CORS headers)")
    g.add_argument("--api-key", type=_api_key, default=None,
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every "
                        "route but /health and the chat page (default: env MLXD_API_KEY, else "
                        "no key)")
    g.add_argument("--supervise", action="store_true",
                   help="run the server in a child process and start it again if a native crash "
                        "(SIGABRT, SIGSEGV, OOM kill) ends it; clean exits are not restarted "
                        "(mlxd/supervise.py)")
    g.add_argument("--max-restarts", type=_int_in(0), default=5,
                   help="with --supervise: restarts in a row before giving up (a server that ran "
                        "10 minutes resets the count)")
    g.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="DEBUG also logs /health and /metrics requests and start-up tracebacks")
    g = p.add_argument_group("request defaults")
    g.add_argument("--max-tokens", type=_int_in(1), default=None,
                   help="max_tokens for requests that set none (default: the room left in the "
                        "context, bounded by memory admission)")
    g.add_argument("--temp", type=_float_in(0.0, 2.0), default=None,
                   help="temperature for requests that do not set it (default 1.0, as OpenAI)")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0), default=None,
                   help="top_p for requests that do not set it (default 1.0)")
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=_int_in(1), default=128, help="rows decoding at once")
    g.add_argument("--prefill-chunk", type=_int_in(1), default=512,
                   help="tokens per prefill forward for long prompts while rows decode (with "
                        "none decoding: what the device prefills in 200 ms, at least this)")
    g.add_argument("--prefill-budget", type=_budget, default=None,
                   help="rows x tokens of prefill work per engine step, or auto (default): "
                        "what the prefill rate measured at start-up does in 200 ms (one to 16 "
                        "chunks); four times that for short prompts when no rows are decoding")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip running the first requests' shapes at start-up (the first "
                        "requests then build their kernels; the auto budget is then 2048)")
    g.add_argument("--max-queue", type=_int_in(1), default=1024,
                   help="waiting requests before new ones get 429")
    g.add_argument("--trace-steps", metavar="FILE", default=None,
                   help="append one JSON line per engine step to FILE: the seconds of its "
                        "phases (schedule, prefill, store, decode launch, ...) and its rows; "
                        "for finding where time goes (docs/architecture.md)")
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-bits", type=int, default=16, choices=[16, 8, 4],
                   help="KV precision: 16 = model dtype, 8 / 4 = MLX affine quantized")
    g.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64],
                   help="quantization group size for --kv-bits 8/4")
    g.add_argument("--max-kv-size", type=_int_in(1), default=None,
                   help="cap full-attention layers to a ring of this many tokens, sinks kept "
                        "(default: no cap)")
    g.add_argument("--prefix-cache-bytes", type=_size_or_auto(0), default="auto",
                   help="prefix cache budget (LRU), e.g. 8GiB; 0 disables it (default auto: a "
                        "quarter of --memory-budget; it never holds what running requests need)")
    g.add_argument("--memory-budget", type=_size(1), default=None,
                   help="weights + KV + prefill budget for admission, shared by every loaded "
                        "model (default: 75%% of device memory); requests that cannot fit are "
                        "queued or refused (413/503)")
    g.add_argument("--mlx-cache-limit", type=_size(0), default=None,
                   help="bytes of freed MLX buffers kept for reuse, e.g. 256MiB; 0 = none "
                        "(default: MLX's own limit, at most a tenth of --memory-budget); the "
                        "engine also empties this cache and trims malloc when it goes idle")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=None, choices=["none", "prediction", "draft", "ngram"],
                   help="drafter: a draft model (--draft-model), n-gram prompt lookup, only the "
                        "requests' predicted outputs (`prediction`), or none at all (default: "
                        "draft when --draft-model is given, else prediction)")
    g.add_argument("--draft-model", default=None,
                   help="draft model directory (same tokenizer as --model)")
    g.add_argument("--num-draft-tokens", type=_int_in(1, MAX_DRAFT_TOKENS), default=None,
                   help=f"ceiling of the adaptive draft length per row, at most "
                        f"{MAX_DRAFT_TOKENS} (default: 16 for a draft model, 4 for n-gram)")
    distributed.add_arguments(p, _int_in, _float_in)
    return p


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the `mlxd` parser, its `serve` subparser)."""
    parser = _Parser(prog="mlxd", epilog="start a server: mlxd serve [--model DIR_OR_REPO_ID] "
                     "(mlxd serve --help lists its options)",
                     description="mlxd: an OpenAI- and Anthropic-compatible inference server on MLX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    serve_parser = _serve_parser(sub)
    sub.add_parser("quantize", help="trellis-quantize a model directory", add_help=False)
    return parser, serve_parser


def _check_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that involve two flags or the environment (after each flag's own check)."""
    _split_models(parser, args)
    if args.spec == "draft" and not args.draft_model:
        parser.error("argument --spec: draft needs --draft-model PATH")
    if args.draft_model and args.spec in ("none", "prediction", "ngram"):
        parser.error(f"argument --draft-model: not used with --spec {args.spec}")
    if args.api_key is None:
        env = os.environ.get("MLXD_API_KEY", "")
        if env and env != env.strip():
            parser.error("MLXD_API_KEY: the key has leading or trailing spaces")
        args.api_key = env or None
    distributed.check_arguments(parser, args)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`mlxd serve` arguments, every flag checked (exits 2 with one line on a bad value)."""
    parser, serve_parser = _parsers()
    args, unknown = parser.parse_known_args(["serve", *argv])
    if unknown:
        serve_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _check_combinations(serve_parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "quantize":  # their own parsers (argparse's REMAINDER drops --help)
        from mlxd.quantize import main as quantize_main

        return quantize_main(argv[1:])
    if argv and argv[0] == "bench":  # a development tool: it is not installed with the package
        print("mlxd: benchmarks run from a source checkout: python -m bench --help", file=sys.stderr)
        return 2
    parser, _ = _parsers()
    if not argv:  # as git does: no command, the help (a server starts with `mlxd serve`)
        parser.print_help(sys.stderr)
        return 2
    if argv[0] != "serve":
        if argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            parser.error(f"no command before {argv[0]}; to start a server: mlxd serve {' '.join(argv)}")
        parser.parse_args(argv)  # --help, or an unknown command: argparse says which
    args = parse_serve_args(argv[1:])
    if args.supervise:  # the child's command line has no --supervise
        from mlxd.supervise import child_argv, supervise

        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return supervise(child_argv(argv), max_restarts=args.max_restarts)
    if distributed.world_size(args) > 1:  # the ranks, through mlx.launch (mlxd/distributed.py)
        return distributed.main(args, argv[1:])
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
    from engine.kv.batch import UnsupportedKV
    from engine.models.registry import UnsupportedArchitecture
    from mlxd.runtime import StartupError, build_client, describe_load_error
    from server.serving import listen_socket

    try:
        sock = listen_socket(args.host, args.port)  # before the model loads: fail fast
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; choose "
                     "another --port (or --host)", 1)
    try:
        client = build_client(args)
    except (StartupError, UnsupportedKV, UnsupportedArchitecture) as exc:  # a configuration this machine cannot run
        return _fail(str(exc), 2)
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    except Exception as exc:  # a model that cannot be loaded: say what to do, not a traceback
        log.debug("loading the model failed", exc_info=True)
        return _fail(describe_load_error(exc, args.model), 1)
    _log_model(client)
    _run_server(client, args, sock)
    _exit_without_teardown(0)
    return 0


def _run_server(client: Any, args: argparse.Namespace, sock: Any,
                server_cls: type | None = None) -> None:
    from server.app import create_app
    from server.config import ServerConfig
    from server.serving import Server, uvicorn_config

    server_cls = server_cls or Server  # mlxd.distributed: rank 0's, which tells its signals apart

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
    server = server_cls(uvicorn_config(app, host=args.host, port=args.port,
                                       log_level=args.log_level))
    # what start-up built (the model, its tokenizer, the libraries they import: ~120k objects on
    # a CPU machine, ~440k where transformers imports torch) lives as long as the server. Frozen,
    # the cyclic collector no longer walks it in its full collections, which land on the engine
    # thread inside whatever step allocates: 210 ms each on an H100 host with torch, 27 ms here
    gc.collect()
    gc.freeze()
    client.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        pass
    finally:
        client.stop()


def _fail(message: str, code: int) -> int:
    print(f"mlxd: error: {message}", file=sys.stderr)
    return code


def _log_model(client: Any) -> None:
    extra = client.model.extra
    log.info(
        "model %s (%s) on %s, dtype %s, BLAS: %s",
        client.model.model_id,
        client.model.path,
        extra.get("device"),
        extra.get("dtype"),
        extra.get("blas"),
    )
    blas = extra.get("blas") or {}
    status = str(blas.get("status") or "")
    on_cpu = "cpu" in str(extra.get("device", "")).lower()
    if on_cpu and not blas.get("path") and not status.startswith("disabled"):
        log.warning("no optimised BLAS (%s): matmuls on the CPU use MLX's reference BLAS, about "
                    "30x slower; install OpenBLAS (libopenblas0-pthread) or pass --blas PATH",
                    status)


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
