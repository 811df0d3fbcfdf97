"""Where each engine step's time goes, for maintainers: `mlxd serve --trace-steps FILE`.

One JSON line per step of the engine loop (engine.core `Engine._step`), appended as it ends:

    {"t": perf_counter at its start, "seconds": the whole step,
     "schedule": ..., "prefill": ..., "prefill_wait": ..., "store": ..., "launch": ...,
     "collect": ..., "update": ..., "emit": ...,            # seconds of each phase it ran
     "propose": ..., "verify_build": ..., "verify_wait": ..., "verdict": ..., "commit": ...,
     "observe": ...,                                         # a speculative round's phases
     "decode_rows": rows in the running batch after joins, "width": 0 none, 1 plain, k + 1 verify,
     "prefill_rows": ..., "prefill_cols": columns this step prefilled,
     "prefill_cached": the group's restored tokens (its first chunk only), "joined": ...}

Phases: `schedule` (picking the rows, the prefix cache's restores built), `prefill` (the
chunk's forward built and launched or, for a group's last chunk, waited for, `prefill_wait`,
then `store`: its blocks into the prefix cache), `launch` (the decode step queued with
`mx.async_eval`: on MLX-CUDA this returns once the host has encoded it, and waits where the
device is still busy with the step before), `collect` (waiting for the previous decode step
and reading its tokens), `update` (the scheduler's bookkeeping), `emit` (events to the
requests' queues). A speculative round (`width` > 1) runs, instead of `launch` and `collect`:
`propose` (the drafts), `verify_build` (the verify forward's graph built and queued),
`verify_wait` (waiting for its tokens; under a grammar also the masks), `verdict` (accepting on
the host, greedy), `commit` (the KV of the accepted columns and the sampler's state queued),
`observe` (the drafter's and the controller's bookkeeping, the tokens read). What they leave
out of `seconds` is the loop's own code.

`python -m bench agent --mlxd-args "--trace-steps $PWD/steps.jsonl"` records a run's steps and
`python -m bench steps steps.jsonl` sums them up by kind of step (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from typing import IO, Any


class StepTrace:
    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
