"""GRPO, 2 learner workers (DDP), checkpoint/resume ledger, and build-time / RPC failures."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import REPO, tiny_config

from asyncrl.checkpoint import latest as latest_checkpoint
from asyncrl.coordinator import CoordinatorError, PolicyStoreClient
from asyncrl.pipeline import run
from asyncrl.plan import resolve_models
from asyncrl.telemetry.sinks import read_metrics, read_summary
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray


def test_grpo_raises_mean_reward(ray_local, small_pair, tmp_path):
    """The shipped GRPO config (small pair, groups of 8), synchronous so the outcome is reproducible,
    at 32 prompts per step: learning, measured on the same held-out prompts before and after.

    Why 256 samples per step: at 64 (8 prompts) the GRPO gradient is noise-dominated and AdamW at
    lr 1e-4 does not raise the exact expected reward (at 3e-4 it collapses it), in the pipeline and
    in a plain single-process loop alike, while the same loop at 256 raises it at seeds 0, 1, 2
    (CHANGELOG, the GRPO learning test). Greedy eval on 512 held-out prompts, at 40 steps:
    batch 256 0.238 -> 0.305 / 0.348 / 0.324 (seeds 0 / 1 / 2); batch 64 0.238 -> 0.211 / 0.191 / 0.234.
    """
    cfg = tiny_config(
        tmp_path / "grpo",
        "pipeline.max_lag=0",
        "train.steps=40",
        "train.batch_size=256",
        "train.eval_every=40",
        "train.eval_size=512",
        config="grpo.yaml",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    assert len(kept) == 40 * 256
    assert (kept.groupby("group_id").size() == 8).all()  # groups are trained whole
    evals = {m["step"]: m["eval/accuracy"] for m in read_metrics(result.run_dir) if "eval/accuracy" in m}
    assert sorted(evals) == [0, 40]
    assert evals[40] >= evals[0] + 0.03, evals  # paired: the same 512 prompts (SE of the gain ~0.02)
    first = kept[kept["step"] < 10]["reward"].mean()
    last = kept[kept["step"] >= 20]["reward"].mean()
    assert last > first, (first, last)


def test_two_learner_workers_ddp(ray_local, tiny_pair, tmp_path):
    cfg = tiny_config(
        tmp_path / "ddp",
        "pipeline.learner_workers=2",
        "pipeline.max_lag=1",
        "train.steps=6",
        "train.eval_every=0",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    assert len(kept) == 6 * cfg.train.batch_size
    assert kept["sample_id"].is_unique
    assert kept["lag"].max() <= 1
    steps = [m["step"] for m in read_metrics(result.run_dir) if "loss" in m]
    assert steps == list(range(1, 7))


def test_checkpoint_crash_resume_ledger_balances(ray_local, tiny_pair, tmp_path):
    run_dir = tmp_path / "resume"
    args = ("pipeline.max_lag=2", "train.steps=8", "train.checkpoint_every=3", "train.eval_every=0")
    cfg = tiny_config(run_dir, *args)
    # the learner dies after step 4 and may not restart: the run fails after its step-3 checkpoint
    dies = tiny_config(run_dir, *args, "faults.learner_exit=4", "pipeline.max_learner_failures=0")
    with pytest.raises(Exception):  # noqa: B017 - the worker group's death, in Ray Train's words
        run(dies)
    assert read_summary(run_dir)["status"] == "failed"
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and json.loads((ckpt / "asyncrl_state.json").read_text())["step"] == 3
    result = run(cfg)  # resumes from step 3
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    # no sample trained twice, exactly steps * B trained, steps contiguous
    assert kept["sample_id"].is_unique
    assert len(kept) == 8 * cfg.train.batch_size
    assert sorted(kept["step"].unique()) == list(range(1, 9))
    ledger = np.load(latest_checkpoint(run_dir) / "ledger.npy")
    assert len(ledger) == len(samples) and np.isin(kept["sample_id"], ledger).all()
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == list(range(1, 9)), steps
    s = result.summary
    assert s["status"] == "completed" and s["driver_resumes"] == 1 and s["ledger_balanced"], s


def test_unresponsive_store_raises_clear_error(ray_local):
    ray = ray_local

    @ray.remote
    class Hung:
        def latest(self, have):
            import time

            time.sleep(30)

    client = PolicyStoreClient(Hung.remote(), timeout_s=1.0)
    with pytest.raises(CoordinatorError, match="did not answer within"):
        client.latest(-1)


def test_vocab_mismatch_fails_at_build(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    bad = tmp_path / "teacher"
    shutil.copytree(tiny_pair.teacher_dir, bad)
    tok = AutoTokenizer.from_pretrained(bad)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(bad)
    cfg = tiny_config(
        tmp_path / "run", f"workload.teacher_path={bad}", f"workload.student_path={tiny_pair.student_dir}"
    )
    with pytest.raises(ValueError, match=r"(?i)tokenizer|vocab"):
        resolve_models(cfg, rl=False)


def test_a_failed_check_stops_the_ray_instance_the_run_started(tiny_pair, tmp_path):
    """``run`` starts Ray and makes the plan's checks beside it (``prepare_driver``): a failed check
    is raised as it is, after the Ray instance that call started is stopped again (none is left
    behind in the caller's process), and no run directory claims an outcome. A process of its own:
    the test session's Ray instance would be joined, not started."""
    import subprocess
    import sys

    from asyncrl.config import save_config

    cfg = tiny_config(
        tmp_path / "run",
        f"workload.teacher_path={tmp_path / 'no-teacher'}",
        f"workload.student_path={tiny_pair.student_dir}",
    )
    path = tmp_path / "cfg.yaml"
    save_config(cfg, path)
    code = (
        "import ray, asyncrl\n"
        "from asyncrl.workloads.checkpoints import CheckpointError\n"
        "try:\n"
        f"    asyncrl.run({str(path)!r})\n"
        "except CheckpointError as err:\n"
        "    print('refused', 'no-teacher' in str(err), ray.is_initialized())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert proc.stdout.strip().splitlines()[-1:] == ["refused True False"], proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()
