"""What every subcommand shares: where results go, how they are written, the machine they ran on.

Every subcommand writes `<kind>.json` (its numbers, config and machine, with `"bench": kind` so
that `python -m bench plot FILE` knows how to draw it) and `<kind>.png` into one folder: `--out
DIR`, or by default `.bench/<kind>-<date>-<time>/` under the current directory (ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path(".bench")
REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DEV_DATA = SHARED / "data" / "tinycoder-dev.jsonl"
DRAFT_MODEL = SHARED / "models" / "tinycoder-draft-4m"


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse type): "1,16,64" -> [1, 16, 64]."""
    return [int(x) for x in text.split(",") if x.strip()]


def add_out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: .bench/<subcommand>-<date>-<time>/)")


def out_dir(args: argparse.Namespace, kind: str) -> Path:
    """The run's results folder (created): --out, else a fresh dated one under .bench/."""
    out = args.out or RESULTS_ROOT / f"{kind}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, kind: str, result: dict[str, Any],
               args: argparse.Namespace | None = None) -> Path:
    """Write `result` tagged with its subcommand (`"bench": kind`) and, given the parsed
    arguments, the command line that made it."""
    result.setdefault("bench", kind)
    if args is not None:
        result.setdefault("command", command_line(args))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def command_line(args: argparse.Namespace) -> str:
    """The command as typed (`python -m bench ...`), from the argv `bench.__main__` parsed."""
    return shlex.join(["python", "-m", "bench", *getattr(args, "argv", [])])


def default_model() -> Path:
    from mlxd import DEFAULT_MODEL_DIR

    return Path(DEFAULT_MODEL_DIR)


def machine_info() -> dict[str, Any]:
    """Platform, CPU model, memory, GPUs (nvidia-smi), package versions and the load average."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    info.update(_proc_info())
    for pkg in ("mlx", "mlx-lm", "mlx-metal", "mlx-cpu", "mlx-cuda", "vllm-mlx"):
        try:
            info[f"{pkg}_version"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    gpus = _gpus()
    if gpus:
        info["gpus"] = gpus
    info["loadavg_start"] = list(os.getloadavg())
    where = f", {len(gpus)}x {gpus[0]}" if gpus else ", no GPU"
    info["summary"] = (f"{platform.system()} {info['machine']}, {info['cpus']} cores"
                       f"{where}, load {info['loadavg_start'][0]:.1f} at start")
    return info


def _proc_info() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                out["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                out["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return out


def _gpus() -> list[str]:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return gpu.stdout.strip().splitlines() if gpu.returncode == 0 and gpu.stdout.strip() else []


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
