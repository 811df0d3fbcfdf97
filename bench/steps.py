"""`steps`: where a run's engine steps spent their time, from `mlxd serve --trace-steps FILE`.

    python -m bench agent ... --mlxd-args "--trace-steps $PWD/steps.jsonl"   # record a run
    python -m bench steps steps.jsonl                                        # summarise it
    python -m bench steps plain.jsonl ngram.jsonl                            # or compare runs

Steps fall into kinds by what they ran: `decode` (the running rows only, one token each),
`verify` (the running rows only, a speculative round), `prefill` (a prompt's chunk, no rows
decoding), `prefill+decode` (a chunk beside decoding rows) and `group` (several prompts
prefilled together), each with `+join` when prompts joined the batch that step. Per kind: how
many, their total seconds, and the median and mean seconds of each phase the trace has
(engine/steptrace.py names them), with the median prefill columns, decoding rows and cached
tokens. Written to steps.json and steps.png (mean phase seconds per kind, stacked). Given
several traces (e.g. one run's plain and speculative engines, `bench spec --trace-steps`), each
is summarised (the JSON's `runs`, the PNG of the first), and a table sets their kinds side by
side: steps and seconds of each kind per trace, which shows where one run's time went that the
other's did not.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench import common

# top-level phases of a step, in order (prefill_wait and store are inside prefill; a verify
# step runs propose .. observe instead of launch and collect)
PHASES = ["schedule", "prefill", "launch", "collect", "propose", "verify_build", "verify_wait",
          "verdict", "commit", "observe", "update", "emit"]
INNER = ["prefill_wait", "store"]


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("steps", help="summarise an engine step trace (mlxd serve --trace-steps)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, nargs="+",
                   help="the JSON-lines file --trace-steps wrote (several: compared)")
    common.add_out_arg(p)
    p.set_defaults(func=cmd_steps)


def kind(step: dict[str, Any]) -> str:
    rows, joined = step.get("prefill_rows", 0), step.get("joined", 0)
    if rows > 1:
        name = "group"
    elif not rows:
        name = "verify" if step.get("width", 1) > 1 else "decode"
    elif step.get("decode_rows", 0) > joined:  # rows other than the joining ones decoded
        name = "prefill+decode"
    else:
        name = "prefill"
    return name + ("+join" if joined else "")


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for s in steps:
        kinds.setdefault(kind(s), []).append(s)
    out = []
    for name, group in sorted(kinds.items(), key=lambda kv: -sum(s["seconds"] for s in kv[1])):
        row: dict[str, Any] = {
            "kind": name, "steps": len(group),
            "seconds_total": sum(s["seconds"] for s in group),
            "seconds_median": statistics.median(s["seconds"] for s in group),
        }
        for phase in PHASES + INNER:
            values = [s.get(phase, 0.0) for s in group]
            row[f"{phase}_median"] = statistics.median(values)
            row[f"{phase}_mean"] = statistics.fmean(values)
        for count in ("prefill_cols", "decode_rows", "prefill_cached"):
            row[f"{count}_median"] = statistics.median(s.get(count, 0) for s in group)
        out.append(row)
    span = steps[-1]["t"] + steps[-1]["seconds"] - steps[0]["t"] if steps else 0.0
    seen = [p for p in PHASES + INNER if any(p in s for s in steps)]  # the table's columns
    return {"steps": len(steps), "span_s": span,
            "in_steps_s": sum(s["seconds"] for s in steps), "phases": seen, "kinds": out}


def table(result: dict[str, Any]) -> str:
    phases = result["phases"]
    cols = ["steps", "seconds_total", "seconds_median", *(f"{p}_median" for p in phases),
            "prefill_cols_median", "decode_rows_median"]
    head = ["kind", "steps", "total s", "median ms",
            *(f"{p} ms" for p in phases), "prefill cols", "decode rows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["kinds"]:
        cells = [row["kind"]]
        for c in cols:
            v = row[c]
            if c == "steps" or c.startswith(("prefill_cols", "decode_rows")):
                cells.append(f"{v:.0f}")
            elif c == "seconds_total":
                cells.append(f"{v:.2f}")
            else:
                cells.append(f"{v * 1e3:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: Any) -> Any:
    plt = common.pyplot()
    kinds = result["kinds"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [k["kind"] for k in kinds]
    bottom = [0.0] * len(kinds)
    for phase in (p for p in PHASES if p in result["phases"]):
        heights = [k[f"{phase}_mean"] * 1e3 for k in kinds]
        ax.bar(names, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("mean ms per step")
    ax.set_title(f"engine steps by kind ({result['steps']} steps)")
    ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def compare(results: list[dict[str, Any]], names: list[str]) -> str:
    """Each kind's steps and seconds per trace, side by side (kinds in order of the first
    trace's seconds), with each trace's total."""
    kinds: list[str] = []
    for r in results:
        kinds += [k["kind"] for k in r["kinds"] if k["kind"] not in kinds]
    head = ["kind", *(f"{n}: steps / s" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in [*kinds, "all"]:
        cells = [name]
        for r in results:
            rows = r["kinds"] if name == "all" else [k for k in r["kinds"] if k["kind"] == name]
            n, sec = sum(k["steps"] for k in rows), sum(k["seconds_total"] for k in rows)
            cells.append(f"{n} / {sec:.2f}" if rows else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_steps(args: argparse.Namespace) -> int:
    results = []
    for trace in args.trace:
        steps = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
        if not steps:
            raise SystemExit(f"{trace}: no steps")
        result = summarise(steps)
        result["trace"] = str(trace)
        results.append(result)
    out = common.out_dir(args, "steps")
    body = results[0] if len(results) == 1 else {"runs": results}
    path = common.write_json(out / "steps.json", "steps", body, args)
    plot(results[0], path.with_suffix(".png"))
    for r in results:
        print(f"{r['trace']}:\n{table(r)}\n")
    if len(results) > 1:
        print(compare(results, [Path(r["trace"]).stem for r in results]))
    print(f"\nwrote {path}, {path.with_suffix('.png')}")
    return 0
