"""scripts/install.sh without installing anything: it parses (`sh -n`), says what it is installing
phase by phase, gives apt-get a bounded wait for the apt/dpkg lock, and still finishes when apt
cannot be used (no root, a lock that is never freed, macOS).

How: the script is copied into an empty temporary "checkout" (it `cd`s to its own parent, so the
real one is never touched) and run with PATH set to a directory of stub commands only: `uname`
(Linux or Darwin), `id` (root or not), `sudo`, `apt-get`, `ls` (whether OpenBLAS is there) and the
interpreter, passed in `PYTHON`, the script's existing knob for which Python makes the venv. The
stub interpreter's `-m venv .venv` writes a stub `.venv/bin/python`; every stub appends its
arguments to a log the test reads. No new switch in the script exists for the test. The real pip
install is what CI's `.ci/run` does (`sh scripts/install.sh test`).
"""

from __future__ import annotations

import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install.sh"
LOCK_OPT = "DPkg::Lock::Timeout=120"


@dataclass(slots=True)
class Run:
    rc: int
    out: str
    log: list[str]

    def calls(self, prog: str) -> list[str]:
        return [line.split(" ", 1)[1] for line in self.log if line.split(" ", 1)[0] == prog]


def _stub(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, *args: str, system: str = "Linux", uid: int = 0, sudo: bool = False,
         apt: bool = True, apt_install_rc: int = 0, openblas: bool = False,
         pip_rc: int = 0) -> Run:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "install.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("dirname", "env", "date", "mkdir", "cp", "true"):  # real tools the script or stubs use
        real = shutil.which(tool)
        assert real is not None
        (bindir / tool).symlink_to(real)
    rec = f'echo "$(basename "$0") $*" >> {log}'
    _stub(bindir, "basename", 'p=$1; echo "${p##*/}"')
    _stub(bindir, "uname", f"echo {system}")
    _stub(bindir, "id", f"echo {uid}")
    _stub(bindir, "ls", "exit 0" if openblas else "exit 2")
    if sudo:
        _stub(bindir, "sudo", f'{rec}\n[ "$1" = -n ] && shift\nexec "$@"')
    else:
        _stub(bindir, "sudo", f"{rec}\necho 'sudo: a password is required' >&2\nexit 1")
    if apt:
        _stub(bindir, "apt-get", f'echo "apt-get DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> {log}\n'
                                 f'case "$*" in *" install "*) exit {apt_install_rc};; esac')
    # the stub interpreter's venv gets a python that records its calls; pip's install exits pip_rc
    _stub(bindir, "venv-python", f'echo "venv-python $*" >> {log}\n'
                                 f'case "$*" in *" -e "*) exit {pip_rc};; esac')
    _stub(bindir, "python3", f'{rec}\n[ "$1 $2" = "-m venv" ] || exit 1\nmkdir -p "$3/bin"\n'
                             f'cp {bindir / "venv-python"} "$3/bin/python"')
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "PYTHON": str(bindir / "python3")}
    proc = subprocess.run(["/bin/sh", str(repo / "scripts" / "install.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)
    lines = log.read_text().splitlines() if log.exists() else []
    return Run(proc.returncode, proc.stdout + proc.stderr, lines)


def _in_order(out: str, *needles: str) -> None:
    at = 0
    for needle in needles:
        found = out.find(needle, at)
        assert found >= 0, f"{needle!r} missing (after position {at}) in:\n{out}"
        at = found + len(needle)


def test_script_parses():
    subprocess.run(["sh", "-n", str(SCRIPT)], check=True)


def test_root_installs_with_a_lock_timeout_and_says_each_phase(tmp_path):
    run = _run(tmp_path, "test")
    assert run.rc == 0, run.out
    apt = run.calls("apt-get")
    assert [c.split()[-1] for c in apt] == ["update", "libopenblas0-pthread", "chromium-driver"]
    for call in apt:  # every apt-get call waits for the lock, none asks a question
        assert LOCK_OPT in call and call.startswith("DEBIAN_FRONTEND=noninteractive"), call
    _in_order(run.out, "installing OpenBLAS", "installed OpenBLAS", "installing chromium",
              "creating the virtual environment", "upgrading pip", "installing the Python packages",
              "installed the Python packages in", "done")
    assert "-m pip install -q -e .[test]" in run.calls("venv-python")
    assert run.calls("sudo") == []


def test_plain_install_skips_chromium(tmp_path):
    run = _run(tmp_path)
    assert run.rc == 0, run.out
    assert [c.split()[-1] for c in run.calls("apt-get")] == ["update", "libopenblas0-pthread"]
    assert "chromium" not in run.out
    assert "-m pip install -q -e ." in run.calls("venv-python")


def test_passwordless_sudo_runs_apt_through_sudo(tmp_path):
    run = _run(tmp_path, uid=1000, sudo=True)
    assert run.rc == 0, run.out
    sudo = run.calls("sudo")
    assert any(LOCK_OPT in c and "install -y libopenblas0-pthread" in c for c in sudo), sudo
    assert len(run.calls("apt-get")) == 2


def test_without_root_it_says_what_to_run_and_installs_the_rest(tmp_path):
    run = _run(tmp_path, "test", uid=1000, sudo=False)
    assert run.rc == 0, run.out
    assert run.calls("apt-get") == []
    assert "sudo apt-get install libopenblas0-pthread" in run.out
    _in_order(run.out, "installing the Python packages", "done")


def test_a_lock_that_is_never_freed_is_a_warning_not_a_failure(tmp_path):
    run = _run(tmp_path, apt_install_rc=100)
    assert run.rc == 0, run.out
    assert "warning: could not install libopenblas0-pthread" in run.out
    _in_order(run.out, "installing the Python packages", "done")


def test_openblas_already_there_is_left_alone(tmp_path):
    run = _run(tmp_path, openblas=True)
    assert run.rc == 0, run.out
    assert run.calls("apt-get") == [] and "OpenBLAS" not in run.out


def test_macos_has_no_apt_step(tmp_path):
    run = _run(tmp_path, "test", system="Darwin", apt=False)
    assert run.rc == 0, run.out
    assert run.calls("apt-get") == [] and "OpenBLAS" not in run.out and "chromium" not in run.out
    _in_order(run.out, "creating the virtual environment", "installing the Python packages", "done")


def test_a_failed_pip_install_fails_the_script(tmp_path):
    run = _run(tmp_path, pip_rc=1)
    assert run.rc != 0
    assert "installing the Python packages" in run.out and "done:" not in run.out
