"""Prompt files streamed by Ray Data: the Ray Data readers keep the files' order, and a
streaming worker's warning and error reach the user's terminal (the resume test is in
test_pipeline_streamed_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CACHE, REPO

from asyncrl.stream import local_reader, ray_reader
from asyncrl.workloads.prompts import PromptSource

pytestmark = pytest.mark.ray


def test_ray_data_readers_give_each_format_in_file_order(ray_local, tmp_path):
    """``read_parquet`` / ``read_json`` / the Arrow IPC datasource keep the files' row order, so
    the streamed order does not depend on Ray's read parallelism."""
    rows = [{"prompt": f"{i}=", "k": i} for i in range(40)]
    table = pa.Table.from_pylist(rows)
    (tmp_path / "pq").mkdir()
    (tmp_path / "jl").mkdir()
    for part in range(4):
        chunk = table.slice(10 * part, 10)
        pq.write_table(chunk, tmp_path / "pq" / f"{part}.parquet")
        (tmp_path / "jl" / f"{part}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in chunk.to_pylist())
        )
    hf = tmp_path / "hf"
    hf.mkdir()
    with (
        pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        for part in range(4):
            w.write_table(table.slice(10 * part, 10))
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    for name in ("pq", "jl", "hf"):
        src = PromptSource.open(tmp_path / name)
        files = list(reversed(src.files))  # an epoch's seeded file order, here: reversed
        got = [r["k"] for t in ray_reader(src.kind)(files) for r in t.to_pylist()]
        want = [r["k"] for t in local_reader(src.kind)(files) for r in t.to_pylist()]
        assert got == want, name
        assert sorted(got) == list(range(40)), name


def test_a_worker_warning_and_error_reach_the_terminal(tiny_pair, tmp_path):
    """At the default verbosity Ray's internals are hidden but a real warning (a prompt skipped
    in the streaming actor) and a real error (a bad row, raised in that actor) are shown; the
    error ends the run without replaying the stream in restarted learners.

    The bad rows sit in a file the driver's check (``plan.check_prompts``: the first 2048 rows in
    sorted file order) does not reach but the stream reads first (files in ``rng([seed, 0])``
    order), so only the stream finds them."""
    import numpy as np

    seed = next(s for s in range(100) if np.random.default_rng([s, 0]).permutation(2)[0] == 1)
    rows = [{"prompt": f"{i % 50:02d}+01=", "answer": "x"} for i in range(60)]
    rows[3] = {"prompt": "1" * 40 + "=", "answer": "x"}  # longer than max_prompt_tokens: skipped
    rows[40] = {"prompt": "", "answer": "x"}  # a bad row, found only when the stream reaches it
    path = tmp_path / "prompts"
    path.mkdir()
    good = [{"prompt": f"{i % 50:02d}+02=", "answer": "x"} for i in range(2048)]
    (path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))  # checked, streamed second
    (path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # streamed first
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "run",
        str(REPO / "examples" / "configs" / "opd_tiny.yaml"),
        f"run_dir={tmp_path / 'run'}",
        f"workload.cache_dir={CACHE}",
        f"workload.prompts_path={path}",
        f"seed={seed}",
        "workload.shuffle_window=1",  # stream order = file order: the bad row comes at block 2
        "workload.max_prompt_tokens=8",
        "pipeline.max_lag=0",
        "pipeline.generators=2",  # the error reaches both learner workers' shards of the stream
        "pipeline.learner_workers=2",
        "pipeline.no_progress_timeout_s=60",
        "train.steps=6",
        "train.eval_every=0",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("ASYNCRL_VERBOSE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "skipped a prompt of 42 tokens" in out, out  # the warning, from the actor
    assert "has an empty 'prompt'" in out and str(path) in out, out  # the error, naming the source
    assert out.rstrip().splitlines()[-1].startswith("asyncrl: error:"), out
    for internal in ("core_worker.cc", "PlacementGroupCleaner", "Loading weights", "RayDeprecationWarning"):
        assert internal not in out, (internal, out)
    # the stage's error stops the run: the learners are restarted once at most, and stop at once
    # (a restart would replay the stream into the same row: pipeline.max_learner_failures is for dead workers)
    run = tmp_path / "run"
    assert json.loads((run / "abort.json").read_text())["kind"] == "stream"
    assert json.loads((run / "books.json").read_text())["learner_restarts"] <= 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "ValueError: prompt file" in summary["error"], summary
