"""`plot`: redraw the PNG of a result JSON; and the sweep's own plot (matplotlib, Agg backend).

    python -m bench plot .bench/sweep-20261201-101500/sweep.json    # writes sweep.png beside it

Every result JSON names the subcommand that wrote it (`"bench"`); the PNG is drawn by that
subcommand's plot function and written next to the JSON with the same stem.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from bench.common import pyplot

# "bench" tag of a result JSON -> "module:function(result, png_path)" that draws it
PLOTTERS = {
    "sweep": "bench.plot:plot_sweep",
    "agent": "bench.agent:plot_agent",
    "prefill": "bench.agent:plot_prefill",
    "coldstart": "bench.coldstart:plot",
    "embed": "bench.embed:plot",
    "spec": "bench.spec:plot",
    "kv-memory": "bench.kv_memory:plot",
    "kv-quality": "bench.kv_quality:plot",
    "constrained": "bench.constrained:plot",
    "trellis-speed": "bench.trellis_speed:plot",
    "trellis-quality": "bench.trellis_quality:plot",
    "trellis-sweep": "bench.trellis_sweep:plot",
    "qmm": "bench.qmm:plot",
    "attention": "bench.attention:plot",
    "switch": "bench.switch:plot",
    "steps": "bench.steps:plot",
}

COLORS = ["#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b"]


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("plot", help="redraw the PNG of a result JSON", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a JSON written by any subcommand")
    p.add_argument("--png", type=Path, default=None, help="where (default: beside the JSON)")
    p.set_defaults(func=cmd_plot)


def kind_of(result: dict[str, Any]) -> str:
    """The subcommand that wrote `result` (sweep results written before the tag: "levels")."""
    kind = result.get("bench") or ("sweep" if "levels" in result else "")
    if kind not in PLOTTERS:
        raise SystemExit(f"not a result this harness can plot (bench={kind!r}); "
                         f"known: {', '.join(PLOTTERS)}")
    return str(kind)


def draw(result: dict[str, Any], png: Path) -> Path:
    module, func = PLOTTERS[kind_of(result)].split(":")
    getattr(importlib.import_module(module), func)(result, png)
    return png


def cmd_plot(args: argparse.Namespace) -> int:
    result = json.loads(args.result.read_text())
    png = draw(result, args.png or args.result.with_suffix(".png"))
    if kind_of(result) == "sweep":
        from bench.sweep import table

        print(table(result))
    print(f"wrote {png}")
    return 0


def _series(result: dict[str, Any], server: str, key: str,
            sub: str | None = None) -> tuple[list[int], list[float]]:
    xs: list[int] = []
    ys: list[float] = []
    for lvl in result["levels"]:
        s = lvl["results"].get(server)
        if not s or not s.get("num_completed"):
            continue
        v = s[key] if sub is None else s[key].get(sub)
        if v is None:
            continue
        xs.append(lvl["concurrency"])
        ys.append(v)
    return xs, ys


def plot_sweep(result: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    servers = list(result["servers"])
    mine = result.get("baseline", servers[0])
    fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))
    ax_tp, ax_ttft, ax_itl, ax_cpu, ax_fail, ax_blank = axes.flat
    ax_blank.axis("off")
    levels = [lvl["concurrency"] for lvl in result["levels"]]

    for i, name in enumerate(servers):
        color = COLORS[i % len(COLORS)]
        label = result["servers"][name].get("label", name)
        xs, ys = _series(result, name, "output_tok_s")
        ax_tp.plot(xs, ys, "o-", color=color, label=label)
        xs, ys = _series(result, name, "output_tok_per_cpu_s")
        ax_cpu.plot(xs, ys, "o-", color=color, label=label)
        for q, style in (("p50", "--"), ("p99", "-")):
            xs, ys = _series(result, name, "ttft_s", q)
            ax_ttft.plot(xs, ys, "o" + style, color=color, label=f"{label} {q}")
            xs, ys = _series(result, name, "itl_s", q)
            ax_itl.plot(xs, [y * 1000 for y in ys], "o" + style, color=color, label=f"{label} {q}")

    # ratio annotations: mlxd / peer throughput at each level
    for lvl in result["levels"]:
        s = lvl["results"].get(mine)
        if not s:
            continue
        lines = []
        for peer, rat in lvl.get("ratios", {}).items():
            if rat.get("output_tok_s") is not None:
                lines.append(f"{rat['output_tok_s']:.1f}x {result['servers'][peer]['label']}")
        if lines:
            ax_tp.annotate("\n".join(lines), (lvl["concurrency"], s["output_tok_s"]),
                           textcoords="offset points", xytext=(6, 6), fontsize=7)
        lines = []
        for rat in lvl.get("ratios", {}).values():
            if rat.get("ttft_p99") is not None:
                lines.append(f"{rat['ttft_p99']:.2f}x")
        if lines and s["ttft_s"]["p99"] is not None:
            ax_ttft.annotate("/".join(lines), (lvl["concurrency"], s["ttft_s"]["p99"]),
                             textcoords="offset points", xytext=(6, -12), fontsize=7)

    width = 0.8 / max(1, len(servers))
    for i, name in enumerate(servers):
        fails = [lvl["results"].get(name, {}).get("num_failed", 0) for lvl in result["levels"]]
        ax_fail.bar([j + i * width for j in range(len(levels))], fails, width,
                    color=COLORS[i % len(COLORS)], label=result["servers"][name].get("label", name))
    ax_fail.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(levels))])
    ax_fail.set_xticklabels([str(c) for c in levels])

    for ax in (ax_tp, ax_ttft, ax_itl, ax_cpu):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("concurrency")
    ax_tp.margins(x=0.15, y=0.2)
    ax_tp.set_ylabel("aggregate output tok/s")
    ax_tp.set_title("throughput (annotated: mlxd / peer)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.set_title("time to first token, p50 dashed, p99 solid (annotated: p99 ratio)")
    ax_itl.set_yscale("log")
    ax_itl.set_ylabel("inter-token latency (ms)")
    ax_itl.set_title("inter-token latency, p50 dashed, p99 solid")
    ax_cpu.set_ylabel("output tokens per server CPU-second")
    ax_cpu.set_title("CPU efficiency (steadier than wall clock on a shared machine)")
    ax_fail.set_ylim(bottom=0, top=max(1.0, ax_fail.get_ylim()[1]))
    ax_fail.set_xlabel("concurrency")
    ax_fail.set_ylabel("failed requests")
    ax_fail.set_title("failed requests")
    for ax in (ax_tp, ax_ttft, ax_itl, ax_cpu, ax_fail):
        ax.legend(fontsize=7)
    notes = [f"{result['servers'][n].get('label', n)}: {result['servers'][n].get('note', '')}"
             for n in servers]
    ax_blank.text(0, 1, "\n\n".join(notes), va="top", fontsize=8, wrap=True)
    cfg = result.get("config", {})
    mach = result.get("machine", {})
    fig.suptitle(
        f"{result.get('name', '')}: {cfg.get('model_name', '')}, {cfg.get('prompt_tokens')}-token "
        f"prompts, {cfg.get('output_tokens')} output tokens, streaming — {mach.get('summary', '')}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
