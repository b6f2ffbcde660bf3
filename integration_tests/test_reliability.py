"""Every process of a run can die and the run still finishes with nothing lost or repeated.

Faults are injected by config (``faults:``, off by default; ``asyncrl.faults``): a generator, a
scorer and a learner process exit mid-run, a step's loss turns NaN, and (from outside) the
driver is killed with ``kill -9``. After each, the run completes with every step logged once,
no sample trained twice, exactly ``steps x B`` trained, the staleness bound held, and the
sample ledger in ``summary.json`` balanced (drawn = trained + dropped + regenerated + in flight).
Also: the numerics guard stops a run whose loss stays NaN, with a checkpoint from before the
first bad step that the same command resumes from; the same seed at ``max_lag = 0`` gives the
same losses twice; and a 2-minute soak (``scripts/soak.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CACHE, REPO, tiny_config

from asyncrl import checkpoint
from asyncrl.pipeline import RunAborted, run
from asyncrl.telemetry.sinks import read_metrics, read_summary
from asyncrl.telemetry.summary import read_samples
from asyncrl.workloads.checkpoints import missing_parts

pytestmark = pytest.mark.ray

STEPS = 8
BASE = ("train.eval_every=0", f"train.steps={STEPS}", "train.checkpoint_every=3", "pipeline.max_lag=1")


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def assert_complete_and_exact(result, *, max_lag: int = 1) -> None:
    """Every step once, no sample twice, steps x B trained, the bound held, the ledger balanced."""
    s, cfg = result.summary, result.config
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    assert s["status"] == "completed", s
    assert sorted(losses(result.run_dir)) == list(range(1, cfg.train.steps + 1))
    assert samples["sample_id"].is_unique  # no sample consumed (let alone trained) twice
    assert len(kept) == cfg.train.steps * cfg.train.batch_size == s["samples_trained"]
    assert kept["lag"].max() <= max_lag
    assert s["ledger_balanced"], s
    assert s["samples_drawn"] == (
        s["samples_trained"] + s["samples_dropped"] + s["samples_regenerated"] + s["samples_in_flight_end"]
    )


@pytest.mark.slow  # CI runs the soak, which injects every fault kind (and a driver kill) in one run
def test_every_in_run_fault_at_once(ray_local, tiny_pair, tmp_path):
    """A generator, the scorer and the learner die, and one step's loss is NaN, in one run."""
    cfg = tiny_config(
        tmp_path / "run",
        *BASE,
        "faults.generator_exit=2",  # the generator dies after its 2nd admission
        "faults.scorer_exit=4",  # the teacher scorer dies at its 4th block
        "faults.learner_exit=5",  # the learner dies after step 5 (checkpoint at 3)
        "faults.nonfinite_step=7",  # step 7's first attempt has NaN logits: skipped
    )
    result = run(cfg)
    s = result.summary
    fired = sorted(p.name for p in (tmp_path / "run" / "faults").iterdir())
    assert fired == ["generator_exit", "learner_exit", "nonfinite_step", "scorer_exit"]
    assert_complete_and_exact(result)
    assert s["learner_restarts"] == 1 and s["generation_retries"] == 1
    B = cfg.train.batch_size
    # the skipped step's samples are dropped as nonfinite; the draws lost to the learner's death
    # (blocks after the step-3 checkpoint) and the re-run generator block are regenerated
    assert s["samples_dropped_nonfinite"] == B
    assert s["samples_regenerated"] >= 2 * B + B  # steps 4-5 trained after the checkpoint, + the retry
    metrics = read_metrics(result.run_dir)
    assert sum(m.get("numerics/skipped", 0) for m in metrics) == 1
    # mem/* every telemetry.memory_every_s (and with each process's first step): valid where logged
    sampled = [m for m in metrics if "mem/learner_rss_mb" in m]
    assert sampled and sampled[0]["step"] == min(m["step"] for m in metrics if "loss" in m)
    assert all(m["mem/learner_rss_mb"] > 0 and m["mem/object_store_mb"] >= 0 for m in sampled)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "check"),
    [
        ("faults.generator_exit=3", lambda s: s["generation_retries"] == 1),
        ("faults.scorer_exit=3", lambda s: s["generation_retries"] == 0 and s["samples_regenerated"] == 0),
        ("faults.learner_exit=4", lambda s: s["learner_restarts"] == 1 and s["samples_regenerated"] > 0),
    ],
)
def test_each_process_fault_alone(ray_local, tiny_pair, tmp_path, fault, check):
    for max_lag in (0, 2):
        result = run(tiny_config(tmp_path / f"lag{max_lag}", *BASE, f"pipeline.max_lag={max_lag}", fault))
        assert_complete_and_exact(result, max_lag=max_lag)
        assert check(result.summary), result.summary


@pytest.mark.parametrize("colocate", [False, True], ids=["stages", "colocated"])
def test_learner_death_restart_reproduces_the_uninterrupted_run(ray_local, tiny_pair, tmp_path, colocate):
    """At max_lag 0 the run is deterministic: a learner restarted from its checkpoint (weights,
    optimizer, RNG, controllers, the stream after the ledger) trains exactly the same steps; so
    does a colocated one (``pipeline.colocate``), whose rollouts die and restart with it."""
    common = (
        "pipeline.max_lag=0",
        "train.steps=6",
        "train.eval_every=0",
        "train.checkpoint_every=2",
        f"pipeline.colocate={str(colocate).lower()}",
    )
    clean = run(tiny_config(tmp_path / "clean", *common))
    again = run(tiny_config(tmp_path / "again", *common))
    crashed = run(tiny_config(tmp_path / "crashed", *common, "faults.learner_exit=3"))
    want = losses(clean.run_dir)
    assert losses(again.run_dir) == want  # the same seed, the same losses, bit for bit
    assert crashed.summary["learner_restarts"] == 1
    got = losses(crashed.run_dir)
    assert sorted(got) == sorted(want) and max(abs(got[k] - want[k]) for k in want) <= 1e-6, (got, want)
    assert_complete_and_exact(crashed, max_lag=0)


def test_a_colocated_rollout_thread_restarts_with_its_learner(ray_local, tiny_pair, tmp_path):
    """``pipeline.colocate`` with ``max_lag=2``: the rollout thread lives in the learner's process,
    so the learner's death takes the blocks it had admitted but not yet handed over; the restarted
    learner (checkpoint at step 3) resumes the stream after its ledger and a new thread regenerates
    them: every step once, no sample twice, the bound held, the books balanced."""
    result = run(
        tiny_config(
            tmp_path / "run", *BASE, "pipeline.max_lag=2", "pipeline.colocate=true", "faults.learner_exit=4"
        )
    )
    assert_complete_and_exact(result, max_lag=2)
    s = result.summary
    assert s["learner_restarts"] == 1 and s["samples_regenerated"] > 0, s


def test_the_numerics_guard_stops_the_run_and_the_rerun_resumes(ray_local, tiny_pair, tmp_path):
    run_dir = tmp_path / "nan"
    args = (*BASE, "train.max_nonfinite_steps=2", "faults.nonfinite_step=4", "faults.nonfinite_count=50")
    with pytest.raises(RunAborted, match=r"2 optimizer steps in a row .*non-finite.*before step 4"):
        run(tiny_config(run_dir, *args))
    s = read_summary(run_dir)
    assert s["status"] == "aborted" and "non-finite" in s["error"] and s["steps"] == 3
    ckpt = checkpoint.latest(run_dir)
    assert checkpoint.step_of(ckpt) == 3  # weights from before the first bad step
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    # the weights in the checkpoint are finite and are the step-3 ones
    from safetensors.torch import load_file

    weights = load_file(ckpt / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    # the model folder is a checkpoint of its own (tokenizer beside the weights): evaluable as is
    assert missing_parts(ckpt / checkpoint.MODEL_DIR) == []
    # the same command again: the NaN fault fired once per run directory, so it resumes and completes
    result = run(tiny_config(run_dir, *args))
    assert_complete_and_exact(result)
    assert result.summary["samples_dropped_nonfinite"] == 2 * result.config.train.batch_size


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), e.get("PYTHONPATH", "")])
    return e


@pytest.mark.slow  # CI: the soak kills the driver (in-flight on) and checks the same
@pytest.mark.parametrize("inflight", [False, True], ids=["whole", "inflight"])
def test_kill_9_of_the_driver_then_the_same_command_resumes(tiny_pair, tmp_path, inflight):
    """The whole ``asyncrl run`` process group is killed once step 4 is logged (checkpoints every 3
    steps; on a quiet machine a few more steps may be done by the time the kill lands, so the run is
    12 steps long and the test reads which checkpoint the kill left); the same command resumes from
    it, and the draws of the killed process are in the ledger as regenerated. With in-flight updates
    the killed rollouts may be partial (tokens of several versions): the same holds, and every
    trained token's lag is within the bound."""
    steps = 12
    run_dir = tmp_path / "driver"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "--quiet",
        "run",
        str(REPO / "examples" / "configs" / "opd_tiny.yaml"),
        f"run_dir={run_dir}",
        f"workload.cache_dir={CACHE}",
        "telemetry.tensorboard=false",
        *BASE,
        f"train.steps={steps}",
        *(["pipeline.inflight_updates=true", "sampling.max_new_tokens=16"] if inflight else []),
    ]
    proc = subprocess.Popen(argv, env=env(), start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and max((m["step"] for m in read_metrics(run_dir)), default=0) >= 4:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_summary(run_dir) is None  # a killed run claims nothing
    resumed_from = checkpoint.step_of(checkpoint.latest(run_dir))
    assert resumed_from % 3 == 0 and 3 <= resumed_from < steps, resumed_from
    done = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    s = read_summary(run_dir)
    assert s["status"] == "completed" and s["driver_resumes"] == 1 and s["ledger_balanced"], s
    samples = read_samples(run_dir)
    assert samples["sample_id"].is_unique and int(samples["kept"].sum()) == steps * 16
    assert sorted(losses(run_dir)) == list(range(1, steps + 1))
    assert s["samples_regenerated"] >= 16  # draws after the checkpoint: trained or in flight when killed
    kept = samples[samples["kept"]]
    assert (kept["token_lag_max"] <= 1).all()  # BASE: max_lag 1, per token


def test_soak_two_minutes(tiny_pair, tmp_path):
    """The CI soak: ``scripts/soak.py --steps 40`` (every fault kind, generator slowdowns, a driver
    kill, memory bounds) with in-flight weight updates on, so that partial sequences (tokens of
    several versions) go through every fault, the driver's kill -9 included; the 30-minute variant
    is documented in docs/reliability.md. The default path (in-flight off) has its driver kill in
    ``test_kill_9_of_the_driver_then_the_same_command_resumes`` and its faults above."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "soak.py"),
            "--steps",
            "40",
            "--run-dir",
            str(tmp_path / "soak"),
            "pipeline.inflight_updates=true",
        ],
        env={**env(), "ASYNCRL_TEST_CACHE": str(CACHE)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert all(report["checks"].values()), report
    assert report["token_lag_max"] <= 2, report
