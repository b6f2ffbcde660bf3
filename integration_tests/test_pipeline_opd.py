"""End-to-end OPD through Ray Data + Ray Train on the tiny preset.

- max_lag = 0 reproduces, step by step, the loss of a plain single-process loop
  (``conftest.plain_loop_losses``).
- max_lag in {0, 2} (and 2 colocated: a rollout thread in the learner's process): every kept
  sample respects the bound and the student's accuracy rises.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import check_contract, plain_loop_losses, tiny_config

from asyncrl.pipeline import run
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray


def ray_actor_classes() -> Counter:
    """Every actor this Ray instance has had (alive or dead), counted by class."""
    from ray._private import state

    return Counter(a["ActorClassName"] for a in state.actors().values())


@pytest.mark.parametrize("colocate", [False, True], ids=["stages", "colocated"])
def test_sync_reproduces_plain_loop(ray_local, tiny_pair, tmp_path, colocate):
    """Through the stage actors, and colocated in the learner (``pipeline.colocate``): the same
    samples, versions and losses as the plain loop."""
    cfg = tiny_config(
        tmp_path / "sync",
        "pipeline.max_lag=0",
        "train.steps=8",
        "train.eval_every=0",
        f"pipeline.colocate={str(colocate).lower()}",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    assert len(samples) == 8 * cfg.train.batch_size
    assert samples["kept"].all() and (samples["lag"] == 0).all()
    losses = [m["loss"] for m in read_metrics(result.run_dir) if "loss" in m]
    assert len(losses) == 8
    ref = plain_loop_losses(cfg)
    np.testing.assert_allclose(losses, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("colocate", [False, True], ids=["stages", "colocated"])
def test_minibatches_count_versions_and_keep_sync_parity(ray_local, tiny_pair, tmp_path, colocate):
    """``train.minibatches=2`` at max_lag 0: each generated batch takes two optimizer steps (the
    version counts steps), the first on-policy, the second one version later (PPO-style), and the
    losses still match the plain loop doing the same (colocated too: the learner samples rollout
    batch r from its own model at version 2r)."""
    cfg = tiny_config(
        tmp_path / "mb2",
        "pipeline.max_lag=0",
        "train.minibatches=2",
        "train.steps=8",
        "train.eval_every=0",
        f"pipeline.colocate={str(colocate).lower()}",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    assert len(samples) == 8 * cfg.train.batch_size // 2 and samples["kept"].all()
    assert sorted(samples["learner_version"].unique()) == list(range(8))
    # rollout batch r: generated with v = 2r, its mini-batches trained at 2r and 2r + 1
    assert (samples["version_first"] == samples["learner_version"] - samples["learner_version"] % 2).all()
    assert (samples["lag"] == samples["learner_version"] % 2).all()
    first = samples[samples["lag"] == 0]
    assert np.abs(first["kl_behavior_current"]).max() < 1e-4
    assert np.abs(samples[samples["lag"] == 1]["kl_behavior_current"]).max() > 1e-6  # the step moved pi
    metrics = [m for m in read_metrics(result.run_dir) if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    np.testing.assert_allclose([m["loss"] for m in metrics], plain_loop_losses(cfg), atol=1e-5, rtol=0)


#: every part in bf16: the rollout thread's engine, the teacher and the learner's forward (autocast)
BF16 = (
    "train.precision=bf16",
    "pipeline.teacher_dtype=bfloat16",
    "pipeline.engine_options={dtype: bfloat16}",
)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_machine_config_rollout_thread_with_minibatches(ray_local, small_pair, tmp_path, precision):
    """The shipped one-machine layout (``opd_one_machine.yaml``): a rollout thread beside the step
    (``colocate``, ``max_lag=2``) *and* two optimizer steps per rollout batch. The combination keeps
    the contract (each sample once, a batch's first step within ``max_lag`` of its behavior version,
    admission knew the training version, batches in stream order, every step logged), trains the
    second mini-batch one version later, and learns; also with every part in bf16 (engine, teacher,
    the learner's autocast), whose behavior log-probabilities then come from a bf16 student while
    the learner's weights stay fp32. Learning over 40 steps is read from the KL (last 10 steps below
    the first 10) and the mean of the evals every 10 steps (above the initial one): single evals on
    256 prompts move by 0.05-0.1 between neighbouring checkpoints (measured, both precisions: the same
    KL at step 40, 0.520, and a last eval 0.043 apart)."""
    steps = ("train.steps=40", "train.eval_every=10")
    extra = BF16 if precision == "bf16" else ()
    cfg = tiny_config(tmp_path / "one", *steps, *extra, config="opd_one_machine.yaml")
    assert cfg.pipeline.colocate and cfg.train.minibatches == 2 and cfg.pipeline.max_lag == 2
    assert cfg.train.precision == precision
    before = ray_actor_classes()
    result = run(cfg)
    check_contract(result, steps=40, minibatches=2)
    # a local instance, one learner worker: Ray Train started no placement-group cleaner (none on
    # this instance at all: every run here is local) and no idle DatasetManager, and neither it nor
    # the learner's Ray Data stream an AutoscalingCoordinator (a named singleton: counted only where
    # no earlier test's driver-side Ray Data made one): patches of asyncrl.ray_internals
    started = ray_actor_classes() - before
    assert {"TrainController", "RayTrainWorker"} <= set(started), started
    assert not started["DatasetManager"] and not ray_actor_classes()["PlacementGroupCleaner"], started
    assert not started["_AutoscalingCoordinatorActor"], started
    samples = read_samples(result.run_dir)
    second = samples[samples["learner_version"] % 2 == 1]
    assert len(second) == len(samples) // 2 and (second["lag"] >= 1).all()
    assert samples["lag"].max() <= cfg.pipeline.max_lag + 1
    s = result.summary
    metrics = read_metrics(result.run_dir)
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert len(evals) == 5 and evals[0] == s["eval_accuracy_initial"]
    assert np.mean(evals[1:]) > evals[0], evals
    kl = [m["est/kl_value"] for m in metrics if "est/kl_value" in m]
    assert np.mean(kl[-10:]) < np.mean(kl[:10]), "distillation did not reduce KL(teacher || student)"
    assert s["ledger_balanced"], s


@pytest.mark.parametrize(
    ("max_lag", "colocate"), [(0, False), (2, False), (2, True)], ids=["lag0", "lag2", "lag2-colocated"]
)
def test_opd_respects_bound_and_learns(ray_local, small_pair, tmp_path, max_lag, colocate):
    """The demo config (small preset, forward KL on the teacher top-16), 60 steps. Colocated with a
    lag (``pipeline.colocate``, ``max_lag=2``): a rollout thread of the learner's process, with its
    own engine, generates while the learner trains; lag-0 samples' behavior log-probabilities
    equal the learner's (``seq_log_ratio`` 0), so that engine held the weights it tagged."""
    cfg = tiny_config(
        tmp_path / f"lag{max_lag}{'-colocated' if colocate else ''}",
        f"pipeline.max_lag={max_lag}",
        f"pipeline.colocate={str(colocate).lower()}",
        "train.steps=60",
        "train.eval_every=20",
        config="opd_async.yaml",
    )
    result = run(cfg)
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    assert len(kept) == cfg.train.steps * cfg.train.batch_size
    assert kept["lag"].max() <= max_lag
    assert kept["sample_id"].is_unique
    s = result.summary
    assert s["eval_accuracy_final"] > s["eval_accuracy_initial"], s
    assert s["ledger_balanced"], s
    kl = [m["est/kl_value"] for m in read_metrics(result.run_dir) if "est/kl_value" in m]
    assert np.mean(kl[-15:]) < np.mean(kl[:15]), "distillation did not reduce KL(teacher || student)"
    if max_lag > 0:
        assert kept["lag"].max() >= 1, "async run never overlapped generation and training"
    # per-staleness-bucket ESS of the sequence weights; lag-0 samples are on-policy: weights 1
    ess = {k: v for m in read_metrics(result.run_dir) for k, v in m.items() if k.endswith("/ess")}
    assert ess and all(0 < v <= 1 + 1e-9 for v in ess.values()), ess
    assert np.isfinite(kept["seq_log_ratio"]).all()
    assert np.abs(kept[kept["lag"] == 0]["seq_log_ratio"]).max() < 1e-4
    for key in ("config.yaml", "metrics.jsonl", "summary.json"):
        assert (result.run_dir / key).exists()
