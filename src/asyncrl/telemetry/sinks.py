"""Writing and reading a run directory's records: metrics.jsonl, samples Parquet, summary.json, TensorBoard.

Why this shape: a run can die at any step (preemption, OOM, Ctrl-C), and what it already
logged must survive and must not be duplicated when it resumes from a checkpoint.

- ``metrics.jsonl``: one JSON object per learner step, appended and flushed per call, so a
  killed process loses at most the line being written; readers skip a torn last line.
- samples: ``log_samples`` rows go to one Parquet part (``samples/part-NNNNNN.parquet``,
  written to a temporary name and renamed, so a part is either whole or absent) per call, or,
  with ``samples_flush_s > 0``, per flush: rows are buffered and written when the oldest is that
  old, at ``flush_samples()`` and at ``close()`` (the learner flushes before every checkpoint,
  so what a resume keeps is always on disk; buffered rows of steps after the last checkpoint
  are the ones a resume re-runs). ``close()`` consolidates the parts into ``samples.parquet``.
  Invariant: if ``samples.parquet`` exists it holds every row, and leftover parts are stale copies.
- resume: ``RunWriter(..., resume=True, truncate_after_step=s)`` keeps the records of steps
  ``<= s`` (the last step the checkpoint includes) and drops later ones before appending, so
  the re-run steps are logged exactly once.

One ``RunWriter`` per run, on rank 0 only.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.telemetry import names

__all__ = ["RunWriter", "read_metrics", "read_samples", "read_summary"]

_PART_GLOB = "part-*.parquet"


def _to_float(key: str, value: Any) -> float | None:
    """A metric value as a JSON-safe float (non-finite -> None, i.e. ``null``)."""
    if hasattr(value, "detach"):  # a torch scalar, without importing torch here
        value = value.detach().cpu().item()
    if isinstance(value, np.ndarray | np.generic):
        if np.size(value) != 1:
            raise TypeError(f"metric {key!r} must be a scalar; got an array of shape {np.shape(value)}")
        value = value.reshape(()).item()
    if isinstance(value, bool | int | float):
        x = float(value)
        return x if math.isfinite(x) else None
    raise TypeError(f"metric {key!r} must be a number; got {type(value).__name__} {value!r}")


def _json_safe(value: Any) -> Any:
    """Recursively turn numpy scalars/arrays and non-finite floats into plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, np.generic):
        return _json_safe(value.item())
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _parse_metric_lines(text: str, path: Path) -> list[dict[str, Any]]:
    """Parse metrics.jsonl; a torn *last* line (the writer died mid-write) is skipped."""
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON; the file is corrupt") from None
        if not isinstance(row, dict) or names.STEP not in row:
            raise ValueError(f"{path}: line {i + 1} is not a JSON object with a {names.STEP!r} key")
        rows.append(row)
    return rows


def _sample_parts(run_dir: Path) -> list[Path]:
    return sorted((run_dir / names.SAMPLES_PARTS_DIR).glob(_PART_GLOB))


def _concat(tables: list[pa.Table]) -> pa.Table:
    # Columns may differ between parts (e.g. 'reward' only in RL steps): promote to a common schema.
    return pa.concat_tables(tables, promote_options="default")


class RunWriter:
    """Append-only sinks of one run: per-step metrics, per-sample rows, the summary.

    Args:
        run_dir: the run directory (created if missing).
        tensorboard: also write every step metric as a TensorBoard scalar to ``RUN/tb``
            (skipped with a warning if ``torch.utils.tensorboard`` cannot be imported).
        resume: reopen an existing run directory and append to it. Without it, records an
            earlier run left in ``run_dir`` (metrics, samples, summary, TensorBoard events) are
            deleted first, so two runs never interleave in one directory.
        truncate_after_step: with ``resume``, the last step whose records are kept
            (the checkpoint's last completed step); records of later steps are dropped.
            ``None`` keeps everything already logged. Ignored without ``resume``.
        keep_sample_ids: with ``resume``, the checkpoint's ledger: exactly the sample rows whose
            ``sample_id`` it holds are kept (instead of cutting them by step), so the rows match
            the ledger also when the checkpoint follows consumptions that took no step.
        samples_flush_s: 0 (default): every ``log_samples`` call is durable when it returns.
            ``> 0``: rows are buffered and written as one part once the oldest buffered row is
            that many seconds old, at ``flush_samples()`` and at ``close()``: a Parquet part per
            learner step costs milliseconds of the step (measured ~4 ms at B = 64 on 2 cores).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume: bool = False,
        truncate_after_step: int | None = None,
        keep_sample_ids: np.ndarray | None = None,
        samples_flush_s: float = 0.0,
    ) -> None:
        if samples_flush_s < 0:
            raise ValueError(f"samples_flush_s must be >= 0 seconds, got {samples_flush_s}")
        self.run_dir = Path(run_dir)
        self._flush_s = samples_flush_s
        # rows buffered as numpy columns; one Arrow table per flush (building a table per step
        # cost the learner ~0.7 ms a step)
        self._buffer: list[dict[str, np.ndarray]] = []
        self._buffered_at = 0.0  # when the oldest buffered row arrived (monotonic)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.run_dir / names.METRICS_FILE
        self._parts_dir = self.run_dir / names.SAMPLES_PARTS_DIR
        self._last_step: int | None = None
        self._time_offset = 0.0
        self._closed = False
        if resume:
            self._reopen(truncate_after_step, keep_sample_ids)
        else:
            self._discard_previous()
        self._next_part = 1 + max(
            (int(p.stem.split("-")[1]) for p in _sample_parts(self.run_dir)), default=-1
        )
        self._start = time.monotonic()
        self._metrics_file = self._metrics_path.open("a", encoding="utf-8")
        self._tb = self._open_tensorboard(truncate_after_step) if tensorboard else None

    # --- fresh start / resume --------------------------------------------------------------
    def _discard_previous(self) -> None:
        for name in (names.METRICS_FILE, names.SAMPLES_FILE, names.SUMMARY_FILE):
            (self.run_dir / name).unlink(missing_ok=True)
        for name in (names.SAMPLES_PARTS_DIR, names.TENSORBOARD_DIR):
            shutil.rmtree(self.run_dir / name, ignore_errors=True)

    def _reopen(self, keep_upto: int | None, keep_ids: np.ndarray | None = None) -> None:
        def keep(step: Any) -> bool:
            return keep_upto is None or (step is not None and step <= keep_upto)

        if self._metrics_path.exists():
            rows = _parse_metric_lines(self._metrics_path.read_text(encoding="utf-8"), self._metrics_path)
            rows = [r for r in rows if keep(r[names.STEP])]
            _atomic_write_text(self._metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
            if rows:
                self._last_step = int(rows[-1][names.STEP])
                self._time_offset = float(rows[-1].get(names.TIME_S) or 0.0)
        consolidated = self.run_dir / names.SAMPLES_FILE
        if consolidated.exists():  # it holds every row; parts beside it are stale copies
            shutil.rmtree(self._parts_dir, ignore_errors=True)
            self._parts_dir.mkdir()
            os.replace(consolidated, self._parts_dir / "part-000000.parquet")
        if keep_upto is not None or keep_ids is not None:
            by_id = keep_ids is not None
            column = "sample_id" if by_id else names.STEP
            for part in _sample_parts(self.run_dir):
                table = pq.read_table(part)
                if column not in table.column_names:
                    continue
                values = table.column(column).to_numpy(zero_copy_only=False)
                mask = np.isin(values, keep_ids) if by_id else np.asarray(values <= keep_upto)
                if mask.all():
                    continue
                if not mask.any():
                    part.unlink()
                    continue
                tmp = part.with_name(part.name + ".tmp")
                pq.write_table(table.filter(pa.array(mask)), tmp)
                os.replace(tmp, part)

    def _open_tensorboard(self, keep_upto: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            warnings.warn(f"TensorBoard logging disabled: {err}", stacklevel=3)
            return None
        purge = None if keep_upto is None else keep_upto + 1  # TensorBoard drops events >= purge_step
        return SummaryWriter(str(self.run_dir / names.TENSORBOARD_DIR), purge_step=purge, flush_secs=10)

    # --- per step --------------------------------------------------------------------------
    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append ``{"step": step, "time_s": ..., **metrics}`` as one JSON line and flush it.

        ``metrics`` values are scalars (python/numpy/torch); non-finite values are written as
        ``null``. ``time_s`` is wall seconds since this process started the run (measured by the
        writer unless ``metrics`` has one); after a resume the time already logged is added, so
        ``time_s`` keeps increasing across restarts.
        Steps must increase strictly: a repeated step would mean duplicated records.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise TypeError(f"step must be an int; got {type(step).__name__} {step!r}")
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} is not after the last logged step {self._last_step}; when resuming, "
                f"pass truncate_after_step=<checkpoint step> so re-run steps are not duplicated"
            )
        row: dict[str, Any] = {names.STEP: step, names.TIME_S: time.monotonic() - self._start}
        for key, value in metrics.items():
            if key == names.STEP:
                raise ValueError("metrics must not contain 'step'; pass it as the step argument")
            row[str(key)] = _to_float(key, value)
        if row[names.TIME_S] is not None:
            row[names.TIME_S] += self._time_offset
        self._metrics_file.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics_file.flush()
        self._last_step = step
        if self._tb is not None:
            for key, value in row.items():
                if key != names.STEP and value is not None:
                    self._tb.add_scalar(key, value, global_step=step)

    # --- per sample ------------------------------------------------------------------------
    def log_samples(self, columns: Mapping[str, Any]) -> None:
        """Log one row per sample. ``columns`` maps a name to a [N] array.

        Durable when it returns (``samples_flush_s = 0``; else at the next flush): the part is
        written under a temporary name and renamed. Torch tensors are accepted (detached, moved
        to CPU). Columns: ``names.SAMPLE_COLUMNS``.
        """
        self._check_open()
        arrays: dict[str, np.ndarray] = {}
        for key, value in columns.items():
            if hasattr(value, "detach"):
                value = value.detach().cpu().numpy()
            arr = np.asarray(value)
            if arr.ndim != 1:
                raise ValueError(f"samples column {key!r} must be 1-D [N]; got shape {arr.shape}")
            arrays[str(key)] = arr
        lengths = {k: len(a) for k, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"samples columns must have one length N; got {lengths}")
        if not arrays or next(iter(lengths.values())) == 0:
            return
        now = time.monotonic()
        if not self._buffer:
            self._buffered_at = now
        self._buffer.append(arrays)
        if now - self._buffered_at >= self._flush_s:
            self.flush_samples()

    def flush_samples(self) -> None:
        """Write the buffered sample rows as one Parquet part (nothing if none are buffered)."""
        self._check_open()
        if not self._buffer:
            return
        tables = [  # consecutive parts with the same columns concatenated as arrays, then promoted
            pa.table({k: np.concatenate([part[k] for part in group]) for k in keys})
            for keys, group in ((k, list(g)) for k, g in itertools.groupby(self._buffer, key=tuple))
        ]
        table = tables[0] if len(tables) == 1 else _concat(tables)
        self._parts_dir.mkdir(exist_ok=True)
        part = self._parts_dir / f"part-{self._next_part:06d}.parquet"
        tmp = part.with_name(part.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, part)
        self._next_part += 1
        self._buffer = []

    # --- end of run ------------------------------------------------------------------------
    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (see ``write_summary``)."""
        write_summary(self.run_dir, summary)

    def close(self) -> None:
        """Flush everything and consolidate the sample parts into ``samples.parquet``. Idempotent."""
        if self._closed:
            return
        self.flush_samples()
        self._closed = True
        self._metrics_file.close()
        if self._tb is not None:
            self._tb.close()
        parts = _sample_parts(self.run_dir)
        if parts:
            target = self.run_dir / names.SAMPLES_FILE
            tmp = target.with_name(target.name + ".tmp")
            pq.write_table(_concat([pq.read_table(p) for p in parts]), tmp)
            os.replace(tmp, target)
            shutil.rmtree(self._parts_dir)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RunWriter for {self.run_dir} is closed")

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- readers ------------------------------------------------------------------------------------
def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``RUN/summary.json`` atomically; numpy values and NaN become plain JSON."""
    path = Path(run_dir) / names.SUMMARY_FILE
    _atomic_write_text(path, json.dumps(_json_safe(dict(summary)), indent=2, allow_nan=False) + "\n")
    return path


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step records of ``RUN/metrics.jsonl`` in file order (a torn last line is skipped).

    If a step appears twice (a resume without truncation), the later record wins.
    """
    path = Path(run_dir) / names.METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the learner writes it from its first step")
    by_step: dict[Any, dict[str, Any]] = {}
    for row in _parse_metric_lines(path.read_text(encoding="utf-8"), path):
        by_step.pop(row[names.STEP], None)
        by_step[row[names.STEP]] = row
    return list(by_step.values())


def read_samples(run_dir: str | Path) -> pa.Table | None:
    """The per-sample rows: ``samples.parquet``, else the live parts under ``samples/``; None if neither."""
    run_dir = Path(run_dir)
    consolidated = run_dir / names.SAMPLES_FILE
    if consolidated.exists():
        return pq.read_table(consolidated)
    parts = _sample_parts(run_dir)
    return _concat([pq.read_table(p) for p in parts]) if parts else None


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """``RUN/summary.json`` as a dict, or None if the run has not finished (no summary yet)."""
    path = Path(run_dir) / names.SUMMARY_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
