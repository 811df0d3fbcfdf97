"""`mlxd serve --supervise`: run the server in a child process and start it again when a native
crash kills it.

Why: some failures inside MLX end the process from C++ (`std::terminate`, SIGABRT; a segfault),
where no Python handler runs and no request can be failed cleanly. On the H200 MLX-CUDA 0.32.4
aborted with `cudaStreamEndCapture ... previous error during capture` while speculating. A
supervised server loses the requests in flight (their connections close) and serves again once
the model is loaded, instead of staying down.

Rules:
- The child is `python -m mlxd <the same arguments>` without `--supervise` (so it does not
  supervise itself), in its own process group: SIGINT, SIGTERM and SIGHUP sent to the
  supervisor are passed on once, and the supervisor then returns the child's exit code without
  restarting it.
- A child that *exits* (any exit code, e.g. 2 for a configuration the device cannot run) is not
  restarted: the supervisor exits with that code. Only a death by a signal the supervisor did
  not pass on (SIGABRT, SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGKILL from the OOM killer), or exit
  status 75 (`GROUP_FAILED`: a rank of a tensor- or pipeline-parallel group died or hung, see
  mlxd/distributed.py), restarts it (the whole group), after `backoff` seconds doubling up to
  30 s.
- At most `max_restarts` restarts in a row; a child that served for `stable_s` seconds resets
  the count. When the budget is spent the supervisor exits with 1.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("mlxd.supervise")

FLAG = "--supervise"
GROUP_FAILED = 75  # a distributed group lost a rank (mlxd.distributed.GROUP_FAILED): restart
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(slots=True)
class _State:
    proc: subprocess.Popen | None = None  # the child now running
    stopping: int | None = None  # the signal that asked the supervisor to stop


def child_argv(argv: Sequence[str]) -> list[str]:
    """The server's own command line: the same arguments without `--supervise` (nor an
    abbreviation of it that argparse accepted, such as `--superv`)."""
    rest = [a for a in argv if not (a.startswith("--su") and FLAG.startswith(a))]
    return [sys.executable, "-m", "mlxd", *rest]


def supervise(
    cmd: Sequence[str],
    max_restarts: int = 5,
    backoff: float = 1.0,
    stable_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> int:
    """Run `cmd` until it exits or a forwarded signal stops it; restart it after a crash."""
    child_env = dict(os.environ if env is None else env)
    state = _State()

    def forward(signum: int, _frame: object) -> None:
        state.stopping = signum
        proc = state.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    restarts, delay = 0, backoff
    try:
        while True:
            started = time.monotonic()
            proc = subprocess.Popen(list(cmd), env=child_env, process_group=0)
            state.proc = proc
            log.info("server process %d started", proc.pid)
            if state.stopping is not None:  # a signal came while it was starting
                forward(state.stopping, None)
            rc = _wait(proc)
            if state.stopping is not None:
                return rc if rc >= 0 else 0  # stopped on request: its own exit status
            if rc >= 0 and rc != GROUP_FAILED:
                return rc  # it exited by itself: not a crash
            name = _signal_name(-rc) if rc < 0 else "a failed rank (exit status 75)"
            if time.monotonic() - started >= stable_s:
                restarts, delay = 0, backoff  # it had served for a while: a fresh budget
            if restarts >= max_restarts:
                log.error("server process %d died with %s; %d restarts in a row, giving up",
                          proc.pid, name, restarts)
                return 1
            restarts += 1
            log.error("server process %d died with %s; restarting in %.1f s (%d of %d)",
                      proc.pid, name, delay, restarts, max_restarts)
            if _sleep_unless_stopped(delay, state):
                return 0
            delay = min(2 * delay, 30.0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except InterruptedError:  # a forwarded signal interrupted the wait: keep waiting
            continue


def _sleep_unless_stopped(seconds: float, state: _State) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if state.stopping is not None:
            return True
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))
    return state.stopping is not None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
