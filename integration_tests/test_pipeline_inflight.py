"""In-flight weight updates end to end (``pipeline.inflight_updates``): generators load newer
weights between decode steps, every token carries the version that produced it, and the staleness
contract holds per token, read back from samples.parquet; the provenance check (strict, the
default) passes on every block; an engine that dies mid-sequence, and a learner that dies, lose
no sample and train none twice (a partial rollout is regenerated whole under its admission).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_config

from asyncrl.pipeline import run
from asyncrl.telemetry.sinks import read_metrics
from asyncrl.telemetry.summary import read_samples

pytestmark = pytest.mark.ray

COMMON = (
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "pipeline.inflight_updates=true",
    "pipeline.no_progress_timeout_s=60",
)


def check_token_contract(result, S: int) -> None:
    """Every trained token's lag <= S, from samples.parquet; the run's books and provenance."""
    s = read_samples(result.run_dir)
    kept = s[s["kept"]]
    assert s["sample_id"].is_unique and len(kept) == result.summary["samples_trained"]
    assert result.summary["ledger_balanced"], result.summary
    # per token: learner version - token version, over each sample's valid tokens
    assert (kept["token_lag_max"] <= S).all(), kept["token_lag_max"].max()
    assert (kept["token_lag_min"] >= 0).all()
    assert (kept["token_lag_max"] == kept["lag"]).all()  # the oldest token is the first one
    assert (kept["token_lag_min"] == kept["learner_version"] - kept["version_last"]).all()
    counts = np.stack(kept["token_lag_counts"].to_numpy())
    assert counts.sum() == kept["completion_len"].sum()  # every trained token is in the histogram
    metrics = [m for m in read_metrics(result.run_dir) if "loss" in m]
    assert all(m["staleness/token_lag_max"] <= S for m in metrics)
    assert sum(m["provenance/checked"] for m in metrics) > 0
    assert sum(m.get("provenance/mismatches", 0) for m in metrics) == 0


# CI runs S = 2 (where samples span versions); S = 1 is in the slow set
@pytest.mark.parametrize("S", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_inflight_two_generators_token_level_bound(ray_local, tiny_pair, tmp_path, S):
    steps = 8
    cfg = tiny_config(
        tmp_path / f"lag{S}",
        *COMMON,
        f"train.steps={steps}",
        f"pipeline.max_lag={S}",
        "pipeline.generators=2",
        "sampling.max_new_tokens=24",  # longer rollouts: more of them see a version move mid-way
    )
    result = run(cfg)
    assert result.summary["status"] == "completed" and result.summary["steps"] == steps
    check_token_contract(result, S)
    s = read_samples(result.run_dir)
    spanning = int((s["version_last"] > s["version_first"]).sum())
    print(f"S={S}: {spanning} of {len(s)} samples span versions")


def test_engine_death_mid_sequence_regenerates_the_block_whole(ray_local, tiny_pair, tmp_path):
    steps = 6
    cfg = tiny_config(
        tmp_path / "run",
        *COMMON,
        f"train.steps={steps}",
        "pipeline.max_lag=1",
        "sampling.max_new_tokens=24",
        "faults.engine_dies_mid_sequence=6",  # the 6th version check: inside block 1 or 2's rollout
    )
    result = run(cfg)
    assert (tmp_path / "run" / "faults" / "engine_dies_mid_sequence").exists(), "the fault did not fire"
    s = result.summary
    assert s["status"] == "completed" and s["generation_retries"] == 1 and s["engine_restarts"] >= 1
    assert s["samples_regenerated"] == cfg.train.batch_size  # the partial block, drawn again whole
    samples = read_samples(result.run_dir)
    assert len(samples) == steps * cfg.train.batch_size and samples["kept"].all()
    check_token_contract(result, 1)


@pytest.mark.slow  # learner restarts are CI-tested in test_reliability; this adds in-flight updates to them
def test_learner_death_with_inflight_updates_loses_nothing(ray_local, tiny_pair, tmp_path):
    steps = 8
    cfg = tiny_config(
        tmp_path / "run",
        "train.eval_every=0",
        "train.checkpoint_every=3",
        "pipeline.inflight_updates=true",
        f"train.steps={steps}",
        "pipeline.max_lag=1",
        "faults.learner_exit=4",
    )
    result = run(cfg)
    s = result.summary
    assert s["status"] == "completed" and s["learner_restarts"] == 1 and s["samples_regenerated"] > 0
    assert int(read_samples(result.run_dir)["kept"].sum()) == steps * cfg.train.batch_size
    check_token_contract(result, 1)


def test_continuous_batching_runs_two_blocks_at_once_within_the_token_bound(ray_local, tiny_pair, tmp_path):
    """``pipeline.continuous_batching``: one generator runs two blocks at once (Ray Data threads of
    the actor) and decodes their rows in shared steps; heavy-tailed lengths, so a block's long rows
    decode beside the next block's. The token-level contract, the books and provenance hold."""
    steps, S = 8, 2
    cfg = tiny_config(
        tmp_path / "run",
        *COMMON,
        f"train.steps={steps}",
        f"pipeline.max_lag={S}",
        "pipeline.continuous_batching=true",
        "sampling.max_new_tokens=48",
        "sampling.heavy_tail=1.0",
    )
    result = run(cfg)
    assert result.summary["status"] == "completed" and result.summary["steps"] == steps
    check_token_contract(result, S)
    s = read_samples(result.run_dir)
    shared = s.groupby("block_index")["gen_shared_frac"].first()
    # blocks 0 and 1 are admitted together when the learner starts (S = 2): they share steps
    assert shared.iloc[0] > 0 and shared.iloc[1] > 0, shared
    print(f"continuous batching: {int((shared > 0).sum())} of {len(shared)} blocks shared decode steps")


@pytest.mark.slow  # the layout that stalled with two queued tasks per actor (docs/known_issues.md)
@pytest.mark.parametrize("S, blocks", [(0, 2), (1, 2), (2, 3)])
def test_continuous_batching_with_four_generators_does_not_stall(ray_local, tiny_pair, tmp_path, S, blocks):
    steps = 8
    cfg = tiny_config(
        tmp_path / f"lag{S}",
        *COMMON,
        f"train.steps={steps}",
        f"pipeline.max_lag={S}",
        "pipeline.generators=4",
        "pipeline.continuous_batching=true",
        f"pipeline.continuous_blocks={blocks}",
        "sampling.max_new_tokens=24",
    )
    result = run(cfg)
    assert result.summary["status"] == "completed" and result.summary["steps"] == steps
    check_token_contract(result, S)
