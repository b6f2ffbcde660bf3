"""RunWriter and the run-directory readers: durability, resume without duplicates, schema."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.telemetry import names
from asyncrl.telemetry.progress import MetricsFollower
from asyncrl.telemetry.sinks import RunWriter, read_metrics, read_samples, read_summary

torch.set_num_threads(1)


def _samples(step: int, n: int = 3, **extra: np.ndarray) -> dict[str, np.ndarray]:
    return {"sample_id": np.arange(n) + 10 * step, "lag": np.arange(n) % 3, "step": np.full(n, step), **extra}


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / names.METRICS_FILE).read_text().splitlines()]


def test_log_step_is_flushed_per_call_and_json_safe(tmp_path: Path) -> None:
    w = RunWriter(tmp_path, tensorboard=False)
    w.log_step(1, {"loss": torch.tensor(0.5), "ess/rho": np.float32(0.25), "n": 3, "bad": float("nan")})
    rows = _lines(tmp_path)  # readable while the writer is still open
    assert rows == [
        {"step": 1, "time_s": rows[0]["time_s"], "loss": 0.5, "ess/rho": 0.25, "n": 3.0, "bad": None}
    ]
    assert "NaN" not in (tmp_path / names.METRICS_FILE).read_text()
    w.log_step(2, {"loss": 0.25})
    t = [r["time_s"] for r in _lines(tmp_path)]
    assert 0 <= t[0] <= t[1]
    w.close()


def test_log_step_rejects_repeats_and_non_scalars(tmp_path: Path) -> None:
    with RunWriter(tmp_path, tensorboard=False) as w:
        w.log_step(3, {"loss": 1.0})
        with pytest.raises(ValueError, match="not after the last logged step 3"):
            w.log_step(3, {"loss": 1.0})
        with pytest.raises(TypeError, match="'grad/norm' must be a scalar"):
            w.log_step(4, {"grad/norm": np.ones(2)})
        with pytest.raises(TypeError, match="'note' must be a number"):
            w.log_step(4, {"note": "hi"})
    with pytest.raises(RuntimeError, match="closed"):
        w.log_step(5, {})


def test_given_time_s_is_kept(tmp_path: Path) -> None:
    with RunWriter(tmp_path, tensorboard=False) as w:
        w.log_step(0, {names.TIME_S: 0.0, names.EVAL_ACCURACY: 0.5})
    assert _lines(tmp_path)[0][names.TIME_S] == 0.0


def test_samples_are_durable_per_call_and_consolidated_on_close(tmp_path: Path) -> None:
    w = RunWriter(tmp_path, tensorboard=False)
    w.log_samples(_samples(1, reward=np.ones(3)))
    w.log_samples(_samples(2))  # no reward column in this part: promoted to null
    w.log_samples({"sample_id": np.zeros(0)})  # empty: no part
    parts = sorted((tmp_path / names.SAMPLES_PARTS_DIR).iterdir())
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet"]
    live = read_samples(tmp_path)  # a reader sees everything before close (the process may die)
    assert live is not None and live.num_rows == 6
    w.close()
    w.close()  # idempotent
    assert not (tmp_path / names.SAMPLES_PARTS_DIR).exists()
    table = read_samples(tmp_path)
    assert table.num_rows == 6
    assert table.column("reward").to_pylist() == [1.0, 1.0, 1.0, None, None, None]
    assert table.column("step").to_pylist() == [1, 1, 1, 2, 2, 2]


def test_buffered_samples_are_one_part_per_flush_and_a_resume_keeps_what_was_flushed(tmp_path: Path) -> None:
    w = RunWriter(tmp_path, tensorboard=False, samples_flush_s=3600.0)
    w.log_samples(_samples(1, reward=np.ones(3)))
    w.log_samples(_samples(2))
    assert read_samples(tmp_path) is None  # buffered: nothing on disk before a flush
    w.flush_samples()  # what the learner does before a checkpoint
    w.flush_samples()  # nothing buffered: no empty part
    parts = sorted((tmp_path / names.SAMPLES_PARTS_DIR).iterdir())
    assert [p.name for p in parts] == ["part-000000.parquet"]
    assert read_samples(tmp_path).column("reward").to_pylist() == [1.0] * 3 + [None] * 3
    w.log_samples(_samples(3))  # after the "checkpoint", then the process dies: never written
    del w
    with RunWriter(
        tmp_path, tensorboard=False, resume=True, truncate_after_step=2, samples_flush_s=3600.0
    ) as w2:
        w2.log_samples(_samples(3))  # the resumed run re-logs step 3 once
    assert read_samples(tmp_path).column("step").to_pylist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_buffered_samples_are_written_once_the_oldest_row_is_flush_s_old(tmp_path: Path) -> None:
    w = RunWriter(tmp_path, tensorboard=False, samples_flush_s=0.05)
    w.log_samples(_samples(1))
    assert read_samples(tmp_path) is None
    time.sleep(0.06)
    w.log_samples(_samples(2))  # the oldest buffered row is now older than 0.05 s: both written
    assert read_samples(tmp_path).num_rows == 6
    with pytest.raises(ValueError, match="samples_flush_s"):
        RunWriter(tmp_path / "x", tensorboard=False, samples_flush_s=-1.0)


def test_log_samples_rejects_ragged_and_2d_columns(tmp_path: Path) -> None:
    with RunWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match="one length N"):
            w.log_samples({"a": np.zeros(2), "b": np.zeros(3)})
        with pytest.raises(ValueError, match="'a' must be 1-D"):
            w.log_samples({"a": np.zeros((2, 2))})
        w.log_samples({"a": torch.ones(2, requires_grad=True) * 2})
    assert read_samples(tmp_path).column("a").to_pylist() == [2.0, 2.0]


def test_summary_is_plain_json(tmp_path: Path) -> None:
    with RunWriter(tmp_path, tensorboard=False) as w:
        w.write_summary(
            {"steps": np.int64(4), "lag_p50": np.float64(1.5), "x": math.inf, "run_dir": tmp_path}
        )
    assert read_summary(tmp_path) == {"steps": 4, "lag_p50": 1.5, "x": None, "run_dir": str(tmp_path)}
    assert read_summary(tmp_path / "nope") is None


def test_fresh_writer_replaces_an_earlier_runs_records(tmp_path: Path) -> None:
    with RunWriter(tmp_path, tensorboard=False) as w:
        w.log_step(1, {"loss": 1.0})
        w.log_samples(_samples(1))
        w.write_summary({"steps": 1})
    with RunWriter(tmp_path, tensorboard=False) as w:
        w.log_step(1, {"loss": 2.0})
    assert [r["loss"] for r in read_metrics(tmp_path)] == [2.0]
    assert read_samples(tmp_path) is None and read_summary(tmp_path) is None


def test_resume_truncates_later_steps_and_continues_time(tmp_path: Path) -> None:
    w = RunWriter(tmp_path, tensorboard=False)
    for step in range(0, 6):
        w.log_step(step, {"loss": float(step), names.TIME_S: 10.0 * step})
        w.log_samples(_samples(step))
    # the process dies here (no close): steps 4, 5 were after the last checkpoint (step 3)
    w._metrics_file.write('{"step": 6, "lo')  # and a torn line
    w._metrics_file.flush()
    w2 = RunWriter(tmp_path, tensorboard=False, resume=True, truncate_after_step=3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert sorted(set(read_samples(tmp_path).column("step").to_pylist())) == [0, 1, 2, 3]
    w2.log_step(4, {"loss": 44.0, names.TIME_S: 1.0})  # this process' clock restarts at 0
    w2.log_samples(_samples(4))
    w2.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["loss"] == 44.0 and rows[-1][names.TIME_S] == 31.0  # 30 s already logged + 1 s
    assert read_samples(tmp_path).column("step").to_pylist() == [s for s in range(5) for _ in range(3)]


def test_resume_after_close_reopens_the_consolidated_samples(tmp_path: Path) -> None:
    with RunWriter(tmp_path, tensorboard=False) as w:
        for step in (1, 2):
            w.log_step(step, {})
            w.log_samples(_samples(step))
    with RunWriter(tmp_path, tensorboard=False, resume=True, truncate_after_step=1) as w:
        w.log_step(2, {})
        w.log_samples(_samples(2, n=2))
    assert read_samples(tmp_path).column("step").to_pylist() == [1, 1, 1, 2, 2]


@settings(max_examples=30, deadline=None)
@given(
    first=st.integers(1, 12),
    keep=st.integers(-1, 12),
    rerun=st.integers(0, 6),
)
def test_resume_never_duplicates_steps(tmp_path_factory: pytest.TempPathFactory, first, keep, rerun) -> None:
    """Property: log steps 0..first-1, resume keeping <= keep, re-log keep+1..: every step exactly once."""
    run = tmp_path_factory.mktemp("run")
    keep = min(keep, first - 1)
    w = RunWriter(run, tensorboard=False)
    for step in range(first):
        w.log_step(step, {"v": 0.0})
        w.log_samples(_samples(step, n=1))
    with RunWriter(run, tensorboard=False, resume=True, truncate_after_step=keep) as w2:
        for step in range(keep + 1, keep + 1 + rerun):
            w2.log_step(step, {"v": 1.0})
            w2.log_samples(_samples(step, n=1))
    expected = list(range(keep + 1 + rerun))
    assert [r["step"] for r in _lines(run)] == expected
    assert [r["v"] for r in _lines(run)] == [0.0] * (keep + 1) + [1.0] * rerun
    table = read_samples(run)
    assert (table.column("step").to_pylist() if table is not None else []) == expected


def test_readers_skip_a_torn_last_line_but_not_corruption(tmp_path: Path) -> None:
    path = tmp_path / names.METRICS_FILE
    path.write_text('{"step": 1, "loss": 1}\n{"step": 1, "loss": 2}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2}]  # later record of a step wins
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl is missing"):
        read_metrics(tmp_path / "none")


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunWriter(tmp_path) as w:
        for step in (1, 2):
            w.log_step(step, {"loss": 1.0 / step, "bad": float("nan")})
    acc = EventAccumulator(str(tmp_path / names.TENSORBOARD_DIR))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 0.5)]
    assert "bad" not in acc.Tags()["scalars"]


def test_metrics_follower_returns_only_complete_new_lines(tmp_path: Path) -> None:
    follower = MetricsFollower(tmp_path)
    assert follower.poll() == []  # no file yet
    path = tmp_path / names.METRICS_FILE
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert follower.poll() == [{"step": 1}]
    with path.open("a") as f:
        f.write('ss": 0.5}\n{"step": 3}\n')
    assert follower.poll() == [{"step": 2, "loss": 0.5}, {"step": 3}]
    assert follower.poll() == []
    path.write_text('{"step": 1}\n{"step": 4}\n')  # truncated and rewritten by a resume
    assert follower.poll() == [{"step": 4}]


def test_names_bucket_keys_round_trip() -> None:
    key = names.bucket_key("3-4", "kl/behavior_current")
    assert key == "bucket/3-4/kl/behavior_current"
    assert names.parse_bucket_key(key) == ("3-4", "kl/behavior_current")
    assert names.parse_bucket_key("staleness/lag_mean") is None
    with pytest.raises(ValueError, match="must not contain '/'"):
        names.bucket_key("a/b", "loss")
