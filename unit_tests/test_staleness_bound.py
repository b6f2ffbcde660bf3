"""The staleness bound as one object (``BoundedStaleness``): every question the rest of the code
asks about ``pipeline.max_lag`` (admissible lags, per sample and per token; the versions the
PolicyStore keeps; rollout batches in flight; the fixed-lag version; stream sizing) is answered by
it, and each answer equals the raw formula it replaced. The learner stays a one-screen recipe."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import PipelineConfig, load_config
from asyncrl.configurable import ConfigError
from asyncrl.controllers import AdmissionBudget, BoundedStaleness, build_chain, chain
from asyncrl.controllers.base import AdmissionRequest
from asyncrl.controllers.bounded import BoundedStalenessConfig
from asyncrl.plan import controller_specs, stream_blocks

SRC = Path(__file__).resolve().parents[1] / "src" / "asyncrl"
lags = st.integers(0, 12)
modes = st.sampled_from(["bound", "fixed"])


def _cfg(S: int = 2, mode: str = "bound", N: int = 1, steps: int = 8, B: int = 8, W: int = 1):
    return load_config(
        None,
        [
            f"pipeline.max_lag={S}",
            f"pipeline.lag_mode={mode}",
            f"pipeline.learner_workers={W}",
            f"train.minibatches={N}",
            f"train.steps={steps}",
            f"train.batch_size={B}",
        ],
    )


# --- admissibility: the object's rule vs the raw ``lag <= max_lag`` --------------------------------
@settings(deadline=None)
@given(lags, st.lists(st.integers(-3, 20), min_size=1, max_size=30))
def test_admissible_is_the_raw_rule_for_ints_and_arrays(S, values):
    bound = BoundedStaleness(S)
    assert [bool(bound.admissible(v)) for v in values] == [v <= S for v in values]
    assert np.array_equal(bound.admissible(np.asarray(values)), np.asarray(values) <= S)


@settings(deadline=None)
@given(lags, modes, st.integers(0, 30), st.integers(0, 30), st.integers(1, 16), st.integers(0, 64))
def test_admit_and_pin_are_the_raw_rules(S, mode, learner_version, ahead, B, in_flight):
    bound = BoundedStaleness(S, mode=mode)
    req = AdmissionRequest(
        n=B, learner_version=learner_version, in_flight=in_flight, batch_size=B, block_index=0,
        expected_version=learner_version + ahead,
    )  # fmt: skip
    assert bound.admit(req) is (req.expected_lag <= S)
    old_pin = max(0, req.expected_version - S) if mode == "fixed" else None
    assert bound.behavior_version(req) == old_pin == bound.fixed_lag_version(req.expected_version)


@settings(deadline=None)
@given(
    lags,
    st.integers(0, 20),
    st.lists(st.tuples(st.integers(0, 25), st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=8),
)
def test_token_bound_is_the_raw_per_token_rule_and_follows_from_the_head_lag(S, v, rows):
    """``admissible_tokens``: every valid token has ``v - token_version <= S``; a sequence's tokens
    are no older than its first, so a head lag within the bound implies every token's is."""
    T = max(n for _, _, n in rows) + 1
    versions = np.zeros((len(rows), T), dtype=np.int32)
    mask = np.zeros((len(rows), T), dtype=bool)
    for r, (first, spread, n) in enumerate(rows):
        first = min(first, v)
        versions[r, :n] = np.minimum(first + np.arange(n) * spread // max(n - 1, 1), v)  # non-decreasing
        mask[r, :n] = True
        versions[r, n:] = -99  # padding: never counted
    bound = BoundedStaleness(S)
    got = bound.admissible_tokens(versions, mask, v)
    raw = [all(v - versions[r, t] <= S for t in range(T) if mask[r, t]) for r in range(len(rows))]
    assert got.tolist() == raw
    head_ok = bound.admissible(v - versions[:, 0])
    assert not (head_ok & ~got).any()


# --- the producer side: the capacity rule and batches in flight --------------------------------------
@settings(max_examples=60, deadline=None)
@given(lags, st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.integers(0, 8)), max_size=60))
def test_admission_is_the_capacity_rule_with_one_step_per_batch(S, B, actions):
    """N = 1, one learner worker: the bound admits the next block of B samples iff
    ``in_flight + B <= (S + 1) B`` (AReaL's capacity rule, the formula it replaced)."""
    budget = AdmissionBudget(chain(BoundedStaleness(S)), B)
    block = 0
    for admit, dropped in actions:
        if admit:
            capacity_ok = budget.in_flight + B <= (S + 1) * B
            assert (budget.try_acquire(B, block) is not None) is capacity_ok
            block += capacity_ok
        elif budget.in_flight:  # the learner trains the oldest rollout batch and releases it
            budget.set_version(budget.version + 1)
            budget.on_consumed(B - min(dropped, B), min(dropped, B))


@settings(max_examples=60, deadline=None)
@given(lags, st.integers(1, 4), st.lists(st.booleans(), max_size=80))
def test_batches_in_flight_never_exceed_the_bound_s_answer(S, N, actions):
    """Admissions interleaved with single optimizer steps: at most ``batches_in_flight``
    (``ceil(S/N) + 1``) rollout batches are started-but-untrained, never more than ``batches_ahead``."""
    bound = BoundedStaleness(S, minibatches=N)
    budget = AdmissionBudget(chain(bound), 2, versions_per_rollout=N)
    block, steps_into_batch, most = 0, 0, 0
    for admit in actions:
        if admit:
            block += budget.try_acquire(2, block) is not None
        elif budget.in_flight:
            budget.set_version(budget.version + 1)
            steps_into_batch += 1
            if steps_into_batch == N:
                budget.on_consumed(2, 0)
                steps_into_batch = 0
        most = max(most, budget.in_flight // 2)
    assert most <= bound.batches_in_flight <= bound.batches_ahead


# --- the run's bound: one factory, the same numbers as before ----------------------------------------
@given(lags, modes, st.sampled_from([1, 2, 4]))
@settings(max_examples=25, deadline=None)
def test_from_config_answers_what_the_raw_reads_did(S, mode, N):
    cfg = _cfg(S, mode, N, steps=4 * N, B=8)
    bound = BoundedStaleness.from_config(cfg)
    assert (bound.max_lag, bound.config.mode, bound.config.minibatches) == (S, mode, N)
    assert bound.synchronous is (cfg.pipeline.max_lag == 0)
    old_kept = S + N if mode == "fixed" else 0  # asyncrl.plan.kept_versions before
    assert bound.kept_versions == old_kept
    old_need = (cfg.train.steps // N + S + 2) * cfg.train.batch_size  # asyncrl.plan.stream_blocks before
    assert stream_blocks(cfg) == (int(old_need * 1.25) + cfg.train.batch_size) // cfg.train.batch_size


def test_the_chain_is_built_from_the_one_bound_and_rebuilds_it_elsewhere():
    cfg = _cfg(3, "fixed", 2, steps=8)
    specs = controller_specs(cfg)
    assert specs[0] == BoundedStaleness.from_config(cfg).spec()
    rebuilt = build_chain(specs).controllers[0].inner
    assert rebuilt.config == BoundedStaleness.from_config(cfg).config
    assert rebuilt.kept_versions == 5


def test_a_second_max_lag_under_controllers_is_refused_naming_both_keys():
    cfg = load_config(None, ["controllers=[{name: bounded_staleness, options: {max_lag: 5}}]"])
    with pytest.raises(ValueError, match=r"pipeline\.max_lag.*controllers: .*pipeline\.max_lag=5"):
        controller_specs(cfg)


def test_the_controller_default_is_the_pipeline_default_and_both_validate_alike():
    assert BoundedStalenessConfig().max_lag == PipelineConfig().max_lag == BoundedStaleness().max_lag
    with pytest.raises(ConfigError, match="max_lag"):
        PipelineConfig(max_lag=-1)
    with pytest.raises(ConfigError, match="max_lag"):
        BoundedStaleness(-1)
    with pytest.raises(ConfigError, match="minibatches"):
        BoundedStaleness(2, minibatches=0)


def test_no_module_reads_the_raw_bound_for_a_decision():
    """``pipeline.max_lag`` is read by its config (validation), ``BoundedStaleness.from_config``,
    the refusal of a second declaration and the run's labels (summary, CLI); everything else asks
    the bound object."""
    allowed = {"config.py", "controllers/bounded.py", "plan.py", "pipeline.py", "cli.py"}
    readers = {
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if re.search(r"\b(?:cfg\.pipeline|pc)\.max_lag\b", p.read_text())
    }
    assert readers <= allowed, sorted(readers - allowed)
    plan = (SRC / "plan.py").read_text()
    assert not re.findall(r"cfg\.pipeline\.max_lag\b", re.sub(r'f?"[^"\n]*"', "", plan))  # messages only
    pipeline = (SRC / "pipeline.py").read_text()
    assert re.findall(r"\bpc\.max_lag\b", pipeline) == ["pc.max_lag"]  # the summary's label


def test_the_learner_stays_a_one_screen_recipe():
    lines = (SRC / "learner.py").read_text().splitlines()
    assert len(lines) <= 260, f"asyncrl/learner.py has {len(lines)} lines: keep it a recipe (<= ~250)"
