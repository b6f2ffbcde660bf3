"""``asyncrl demo`` as a person sees it: run in a pseudo-terminal (tmux renders the screen, so
the check reads what is shown, not the bytes of every live redraw)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CACHE, REPO, check_demo_sizing

pytestmark = pytest.mark.ray

#: what Ray or the libraries print on their own; none of it may reach the default output
INTERNALS = (
    "PlacementGroupCleaner",
    "TrainController",
    "core_worker",
    "raylet",
    "PYTHON worker processes",
    "RayDeprecationWarning",
    "DeprecationWarning",
    "Loading weights",
    "Writing model shards",
    "Checkpoint successfully created",
    "Reporting training result",
    "execution finished",
    "Started a local Ray instance",
    "NumPy array is not writable",
    "pid=",
)


def run_in_tmux(command: str, tmp_path: Path, *, timeout_s: float = 900) -> tuple[int, list[str]]:
    """Run ``command`` in a detached tmux pane of 160 x 50; return its exit status and the pane's
    rendered lines (history included) once it has finished."""
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed")
    socket = f"asyncrl-test-{os.getpid()}"
    conf = tmp_path / "tmux.conf"
    conf.write_text("set -g history-limit 50000\nset -g remain-on-exit on\n")
    status = tmp_path / "status"
    script = f"{command}; echo $? > {status}"
    base = [tmux, "-L", socket, "-f", str(conf)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("ASYNCRL_VERBOSE", None)
    subprocess.run(
        [*base, "new-session", "-d", "-x", "160", "-y", "50", "-s", "t", "bash", "-c", script],
        env=env,
        check=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not status.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"{command!r} did not finish within {timeout_s} s")
            time.sleep(1)
        time.sleep(0.5)  # the last redraw
        screen = subprocess.run(
            [*base, "capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", "t"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True)
    lines = [line.rstrip() for line in screen.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return int(status.read_text()), lines


#: a process's crash report (Ray prints it whoever crashed: a real error, shown by design)
CRASH = re.compile(r"\*\*\* SIG\w+ received|Fatal Python error|Check failed")
PREFIX = re.compile(r"^\((?:[^()]|\([^()]*\))* pid=(\d+)\)")
#: asyncrl's own lines: the demo's stages, pretraining notes, progress bars and lines
OWN = re.compile(r"^\[\d/4\]|^\[pretrain|^(sync|async)\s|\bstep \d+/\d+")


def crash_free(lines: list[str]) -> tuple[list[str], int]:
    """``lines`` less the crash reports of Ray processes, and how many crashed: a crashed process's
    lines and the unprefixed lines after them (its dump), up to the next line of asyncrl's own
    or of another process. A sporadic crash of a Ray worker is a real error the filter must show;
    it is not what this test judges."""
    crashed = {m.group(1) for line in lines if CRASH.search(line) and (m := PREFIX.match(line))}
    kept, in_crash = [], False
    for line in lines:
        m = PREFIX.match(line)
        if m:
            in_crash = m.group(1) in crashed
        elif OWN.search(line):
            in_crash = False
        if not in_crash:
            kept.append(line)
    return kept, len(crashed)


def test_demo_output_is_short_unique_and_free_of_ray_internals(tmp_path):
    """The demo on a task other than the default (`running_sum`, 33-token answers): its terminal, and
    the demo path's sizing of generation from the task (``check_demo_sizing``: CI's cell of
    test_builtin_workloads.py's demo test; the pair is pretrained there first, or here if missing)."""
    cmd = (
        f"cd {tmp_path} && {sys.executable} -m asyncrl.cli demo --task running_sum --preset tiny --steps 3 "
        f"--cache-dir {CACHE} --run-root {tmp_path / 'demo'} train.eval_every=2 train.eval_size=32"
    )
    code, lines = run_in_tmux(cmd, tmp_path)
    text = "\n".join(lines)
    assert code == 0, text
    judged, crashes = crash_free(lines)
    own = [line for line in judged if OWN.search(line)]
    assert len(own) == len(set(own)), text  # no step (or stage) line printed twice
    bars = [line for line in own if re.match(r"^(sync|async)\s", line)]
    assert len(bars) == 2 and all("3/3" in b for b in bars), text  # one finished bar per run
    assert "speedup (samples/s)" in text and "report:" in text
    shown = [line for line in judged if any(internal in line for internal in INTERNALS)]
    assert not shown, ("Ray internals reached the terminal:", shown, text)  # lines first: pytest cuts text
    assert len([line for line in judged if line.strip()]) <= 25, text
    check_demo_sizing(tmp_path / "demo", "running_sum", steps=3)
    if crashes:
        print(f"note: {crashes} Ray process(es) crashed during the demo and were reported:\n{text}")
