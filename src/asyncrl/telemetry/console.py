"""What reaches the user's terminal: the verbosity switch and the filter on Ray's log forwarding.

A run's terminal should show asyncrl's own progress and every real problem, not Ray's
bookkeeping. By default (``-v`` / ``ASYNCRL_VERBOSE=1`` turns all of this off):

* every process of a run gets ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (``quiet_env``): no
  per-process "Loading weights" / "Writing model shards" tqdm bars;
* the driver's ``ray`` logger logs warnings and errors only (no "Started a local Ray instance");
* the lines Ray forwards from worker processes pass ``is_noise``: a line is dropped only when
  it matches one of ``NOISE`` (known-harmless messages, each with the reason it is harmless),
  or when it comes from one of Ray's own bookkeeping actors (``RAY_INTERNAL``) and does not
  look like a problem (``ALARM``). Anything else, in particular a traceback or a warning from
  asyncrl's actors and workers, is printed as Ray prints it;
* a real condition that Ray logs again every few seconds (``REPEATING``: the raylet's disk check)
  is told once per process, as one asyncrl warning saying what it means and what to do.

The filter is installed on Ray's driver-side log forwarding by ``asyncrl.ray_internals`` (patch
``log_filter``: a private Ray API, behind a check of the installed Ray version). It fails open: a
Ray it was not written for keeps Ray's own printing (one warning), and an exception inside the
filter prints the batch as Ray would. It may show noise; it never stops a run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

VERBOSE_ENV = "ASYNCRL_VERBOSE"


def set_verbose(verbose: bool) -> None:
    """Set the switch for this process and every process it starts (an environment variable)."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    else:
        os.environ.pop(VERBOSE_ENV, None)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_env() -> dict[str, str]:
    """Environment of every process of a run at the default verbosity: no hub/transformers tqdm
    bars (read when ``transformers`` is imported, so set before that)."""
    return {} if verbose() else {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def ray_logging_level() -> int:
    """Level of the driver's ``ray`` logger (``ray.init(logging_level=...)``)."""
    return logging.INFO if verbose() else logging.WARNING


@dataclass(frozen=True)
class Noise:
    """A known-harmless forwarded line: ``pattern`` (searched), from ``source`` if given, and why."""

    pattern: str
    why: str
    source: str | None = None

    def matches(self, line: str, source: str) -> bool:
        return (self.source is None or self.source in source) and re.search(self.pattern, line) is not None


NOISE: tuple[Noise, ...] = (
    Noise(
        r"has constructor arguments in the object store and max_restarts > 0",
        "logged at E level by every restartable actor Ray Data and Ray Train create; only matters "
        "if the object store loses the arguments, which then fails the restart loudly",
    ),
    Noise(
        r"PYTHON worker processes have been started",
        "raylet notice when many actors start at once (each stage's actors start together)",
    ),
    Noise(r"RayDeprecationWarning", "Ray Data warns about its own internal use of deprecated options"),
    Noise(r"^\s*self\.exclude_resources = exclude_resources", "the source line of that warning"),
    Noise(r"(Loading weights|Writing model shards|Loading checkpoint shards):", "per-process tqdm bars"),
    Noise(r"Checkpoint successfully created at", "Ray Train's note per checkpoint (asyncrl reports its own)"),
    Noise(r"Reporting training result \d+", "Ray Train's note per report"),
    Noise(r"Dataset \S+ execution finished in", "Ray Data's note when the stream ends"),
    Noise(r"Progress bars disabled\. To enable", "Ray Data's note (asyncrl disables them on purpose)"),
    Noise(r"Registered dataset logger|Starting execution of Dataset|Execution plan of Dataset", "Ray Data"),
    Noise(r"Setting up process group for: env://", "Ray Train's note per worker"),
    Noise(
        r"There are infinite retries remaining, so the task will be retried\. Error: The actor is dead "
        r"because it was killed by `ray\.kill`",
        "the stream's actors are killed when a run ends; a task queued on one is retried, never run",
    ),
)

#: Ray's own bookkeeping actors: their notes are hidden unless they look like a problem
RAY_INTERNAL = ("TrainController", "PlacementGroupCleaner", "DatasetManager", "SplitCoordinator", "raylet")
#: what a problem looks like (a traceback, a warning or error level, a failure, a dead process)
ALARM = re.compile(
    r"Traceback|Error|Exception|WARNING|Warning|\bFATAL\b|[Ff]ail|\] E |\bdied\b|[Kk]illed|[Cc]rash|"
    r"\bOOM\b|[Oo]ut of memory|[Uu]nexpected"
)
#: Ray Train's PlacementGroupCleaner polls the State API, which needs Ray's full dashboard (not
#: installed: ray[default]); it logs each failed poll, and a traceback when several Ray clusters
#: run on one machine. It only cleans up after a crashed controller; runs do not depend on it.
CLEANER = "PlacementGroupCleaner"


def source_of(data: dict[str, Any]) -> str:
    """Who printed a forwarded batch: actor or task name, else the pid (``raylet``, ``autoscaler``)."""
    return str(data.get("actor_name") or data.get("task_name") or data.get("pid") or "")


def is_noise(line: str, source: str) -> bool:
    """True for a known-harmless line (see the module docstring); never for an unknown problem."""
    if any(n.matches(line, source) for n in NOISE):
        return True
    if CLEANER in source:
        return True
    return any(name in source for name in RAY_INTERNAL) and ALARM.search(line) is None


@dataclass(frozen=True)
class Repeating:
    """A real condition that Ray logs again on a timer: ``pattern`` (searched; its named groups fill
    ``say``), told once per process as one asyncrl line that says what it means and what to do;
    its repeats are dropped. ``why``: why once is enough."""

    pattern: str
    say: str
    why: str

    def told(self, line: str) -> str | None:
        """asyncrl's line for a matching ``line``, else None."""
        m = re.search(self.pattern, line)
        return None if m is None else self.say.format(**m.groupdict())


REPEATING: tuple[Repeating, ...] = (
    Repeating(
        r"file_system_monitor\.cc:\d+: (?P<path>\S+) is over (?P<pct>\d+)% full, "
        r"available space: (?P<free>[\d.]+) GB; capacity: (?P<cap>[\d.]+) GB",
        "the disk of Ray's session directory {path} is over {pct}% full ({free} GB free of {cap} GB): "
        "Ray cannot spill objects there, so a run whose object store fills up would fail. Free disk "
        "space, or give Ray a temporary directory on another disk (RAY_TMPDIR=/path). "
        "(Ray repeats this every 10 s; shown once, -v shows Ray's lines.)",
        "the raylet checks the disk every 10 s and logs at E level each time it is over "
        "RAY_local_fs_capacity_threshold (0.95): one line per 10 s would bury the run's progress",
    ),
)
_told: set[str] = set()


def tell_once(line: str) -> bool:
    """True when ``line`` is one of ``REPEATING``: the first of its kind in this process is told on
    stderr in asyncrl's words, every one is dropped from Ray's forwarding."""
    for notice in REPEATING:
        said = notice.told(line)
        if said is None:
            continue
        if notice.pattern not in _told:
            _told.add(notice.pattern)
            print(f"asyncrl: warning: {said}", file=sys.stderr, flush=True)
        return True
    return False


def keep_lines(lines: Iterable[str], source: str) -> list[str]:
    """The lines of one forwarded batch that are printed at the default verbosity (a ``REPEATING``
    notice is told once, in asyncrl's words, instead)."""
    return [line for line in lines if not tell_once(line) and not is_noise(line, source)]


def forwarded_lines(data: dict[str, Any]) -> list[str]:
    """The lines of one batch Ray forwards from a worker (``lines``, with ``actor_name`` /
    ``task_name`` / ``pid``) that reach the terminal: all of them when verbose, else ``keep_lines``."""
    lines = data.get("lines", [])
    if verbose():
        return list(lines)
    return keep_lines(lines, source_of(data))


def install_log_filter() -> bool:
    """Filter the driver's forwarding of worker logs through ``forwarded_lines`` (call after
    ``ray.init``); False when verbose or when the installed Ray keeps its own printing
    (``asyncrl.ray_internals.filter_worker_logs``). Idempotent."""
    if verbose():
        return False
    from asyncrl.ray_internals import filter_worker_logs

    return filter_worker_logs(forwarded_lines)
