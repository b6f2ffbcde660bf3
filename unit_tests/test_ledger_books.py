"""The sample ledger without Ray: the PolicyStore's books across every fault (a generator's block
re-run, a learner restart from a checkpoint, a driver resume), stale requests from a replaced
stream, the summary's balance check, and the fault plan's once-only markers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.coordinator import PolicyStore
from asyncrl.faults import FaultConfig, Faults
from asyncrl.telemetry import names as N
from asyncrl.telemetry.summary import ledger

Store = PolicyStore.__ray_actor_class__  # the plain class: its methods run without Ray
B = 4


def store(books: Path | None = None, resume: bool = False) -> Store:
    return Store(
        [("bounded_staleness", {"max_lag": 1, "mode": "bound"})],
        B,
        books_path=str(books) if books else None,
        resume_books=resume,
    )


def acquire(s: Store, block: int, stream: int | None = None):
    """One poll of ``acquire`` (admission is granted at once or the request is still waiting)."""

    async def once():
        task = asyncio.ensure_future(s.acquire(B, block, stream))
        await asyncio.sleep(0.02)
        if task.done():
            return task.result()
        task.cancel()
        return "waiting"

    return asyncio.run(once())


def balanced(b: dict[str, int]) -> bool:
    return b["drawn"] == b["trained"] + b["dropped"] + b["regenerated"] + b["in_flight"]


def test_books_balance_through_every_fault(tmp_path: Path) -> None:
    books = tmp_path / "books.json"
    s = store(books)
    stream = s.begin_stream(None)
    assert acquire(s, 0, stream) == "waiting"  # closed until the learner starts
    s.start([None], 0)
    assert acquire(s, 0, stream)["ticket"] == 0
    assert acquire(s, 1, stream)["ticket"] == 1
    assert acquire(s, 1, stream)["ticket"] == 1  # block 1's generator died: re-run, drawn twice
    assert s.books()["regenerated"] == B and s.books()["drawn"] == 3 * B
    s.publish([None], 1, (B - 1, 1))  # block 0 consumed: one sample dropped by a controller
    checkpoint = s.state_dict()  # the learner checkpoints at version 1
    assert acquire(s, 2, stream)["ticket"] == 2
    s.publish([None], 2, (B, 0))  # block 1
    assert balanced(s.books()) and s.books()["in_flight"] == B

    # the learner dies: Ray Train restarts it from the version-1 checkpoint, a new stream begins
    new = s.begin_stream(checkpoint)
    assert new == stream + 1 and s.books()["in_flight"] == 0
    assert acquire(s, 5, stream) is None  # a request from the dead stream is refused
    with pytest.raises(ValueError, match="version 1"):
        s.start([None], 2)  # a learner that loaded another checkpoint than the stream
    s.start([None], 1)
    b = s.books()
    # everything drawn since the checkpoint (blocks 1 twice, 2) is regenerated; block 0's books stay
    assert (b["trained"], b["dropped"], b["regenerated"], b["learner_restarts"]) == (B - 1, 1, 3 * B, 1)
    assert balanced(b)
    assert acquire(s, 0, new)["ticket"] == 0  # the new stream numbers its blocks from 0
    s.publish([None], 2, (B, 0))
    written = json.loads(books.read_text())
    assert written == s.books() and balanced(written)

    # the driver dies (its in-flight draw was written to the books file); the next one resumes
    resumed = store(books, resume=True)
    resumed.begin_stream(s.state_dict())
    resumed.start([None], 2)
    b = resumed.books()
    assert b["drawn"] == written["drawn"] and b["driver_resumes"] == 1 and b["learner_restarts"] == 1
    assert b["in_flight"] == 0 and b["regenerated"] == written["regenerated"] + written["in_flight"]
    assert balanced(b)


def test_a_fresh_store_ignores_old_books(tmp_path: Path) -> None:
    books = tmp_path / "books.json"
    books.write_text(json.dumps({"dispatched": 99, "retried": 4, "learner_restarts": 2}))
    s = store(books, resume=False)
    s.begin_stream(None)
    assert s.books()["drawn"] == 0 and s.books()["driver_resumes"] == 0


# --- the summary's statement -------------------------------------------------------------------------
def samples(kept: list[bool], reasons: list[str], ids: list[int] | None = None) -> pd.DataFrame:
    ids = ids if ids is not None else list(range(len(kept)))
    return pd.DataFrame({"sample_id": ids, "kept": kept, N.DROP_REASON: reasons})


def stats(drawn, trained, dropped, regenerated, in_flight) -> dict[str, int]:
    b = dict(drawn=drawn, trained=trained, dropped=dropped, regenerated=regenerated, in_flight=in_flight)
    return {f"books/{k}": v for k, v in b.items()}


@settings(max_examples=80, deadline=None)
@given(
    trained=st.integers(0, 20),
    by_controllers=st.integers(0, 5),
    nonfinite=st.integers(0, 5),
    regenerated=st.integers(0, 10),
    in_flight=st.integers(0, 10),
    tweak=st.sampled_from(["none", "drawn", "trained", "rows", "duplicate"]),
)
def test_the_ledger_balances_exactly_when_every_count_agrees(
    trained, by_controllers, nonfinite, regenerated, in_flight, tweak
) -> None:
    kept = [True] * trained + [False] * (by_controllers + nonfinite)
    reasons = [""] * trained + [N.DROPPED_CONTROLLERS] * by_controllers + [N.DROPPED_NONFINITE] * nonfinite
    ids = list(range(len(kept)))
    dropped = by_controllers + nonfinite
    drawn = trained + dropped + regenerated + in_flight
    if tweak == "drawn":
        drawn += 1  # a draw the books cannot place
    if tweak == "trained":
        trained += 1  # the store counted a sample the rows do not have
        drawn += 1
    if tweak == "rows" and kept:
        kept, reasons, ids = kept[1:], reasons[1:], ids[1:]  # a consumed sample without its row
    if tweak == "duplicate" and ids:
        ids[-1] = ids[0]  # a sample trained twice
    out = ledger(samples(kept, reasons, ids), stats(drawn, trained, dropped, regenerated, in_flight))
    assert out["ledger_balanced"] == (tweak == "none" or (tweak in ("rows", "duplicate") and not ids))
    if tweak == "none":
        assert out["samples_dropped_nonfinite"] == nonfinite
        assert out["samples_dropped_controllers"] == by_controllers
        assert out["samples_drawn"] == drawn and out["samples_in_flight_end"] == in_flight


def test_no_books_is_not_balanced() -> None:
    assert ledger(samples([True], [""]), {})["ledger_balanced"] is False


# --- the fault plan ------------------------------------------------------------------------------------
def test_faults_fire_once_per_run_directory(tmp_path: Path) -> None:
    f = Faults(FaultConfig(generator_exit=3, learner_exit=5), str(tmp_path / "faults"))
    assert [f.once("generator_exit", k) for k in (1, 2, 3, 3, 4)] == [False, False, True, False, False]
    assert not f.once("scorer_exit", 3)  # not configured
    again = Faults(f.config, f.marker_dir)  # a restarted process or a resumed run
    assert not again.once("generator_exit", 3) and again.once("learner_exit", 5)
    assert sorted(p.name for p in (tmp_path / "faults").iterdir()) == ["generator_exit", "learner_exit"]


def test_generator_delay_is_seeded_per_block() -> None:
    f = Faults(FaultConfig(generator_delay_p=1.0, generator_delay_s=0.01), "")
    assert f.delay(0, 3) == f.delay(0, 3) and 0 < f.delay(0, 3) <= 0.01
    assert Faults(FaultConfig(), "").delay(0, 3) == 0.0


def test_no_fault_is_on_by_default() -> None:
    assert not FaultConfig().active and FaultConfig(scorer_exit=1).active
    with pytest.raises(ValueError, match=r"generator_delay_p"):
        FaultConfig(generator_delay_p=2.0)
    assert np.isfinite(FaultConfig().generator_delay_s)


# --- a skipped non-finite step in the learner's telemetry -------------------------------------------------
def test_a_nonfinite_step_is_logged_as_skipped_and_its_samples_as_dropped() -> None:
    """What the learner logs for a step ``loss_step`` skipped: no figure computed from its NaNs
    (the ESS of NaN log-weights raised and failed the run before), and its samples dropped."""
    import math

    import torch

    from asyncrl import records as R
    from asyncrl.step import StepResult
    from asyncrl.telemetry.steps import bucket_metrics, sample_rows, step_metrics

    n = 4
    nan = np.full(n, np.nan)
    result = StepResult(
        stepped=False, nonfinite=True, version=3, n_kept=3, n_dropped=1, loss=math.nan, grad_norm=math.nan,
        lr_scheduled=1e-3, lr_applied=0.0, kl_behavior_current=math.nan, tokens=12,
        lags_global=torch.zeros(3, dtype=torch.long), seq_log_ratio_global=torch.full((3,), math.nan),
        metrics={}, samples={"kept": np.array([True, True, True, False]), "lag": np.zeros(n), "loss": nan,
                             "kl_behavior_current": nan, "seq_log_ratio": nan},
    )  # fmt: skip
    metrics = step_metrics(result)
    assert metrics[N.NUMERICS_SKIPPED] == 1.0 and metrics[N.SAMPLES_KEPT] == 0.0 and N.ESS_RHO not in metrics
    batch = {
        R.SAMPLE_ID: np.arange(n), R.PROMPT_ID: np.arange(n), R.GROUP_ID: np.arange(n),
        R.VERSION_FIRST: np.full(n, 3), R.VERSION_LAST: np.full(n, 3),
        R.COMPLETION_MASK: np.ones((n, 2), dtype=bool),
    }  # fmt: skip
    rows = sample_rows(batch, result, 3, step=4)
    assert not rows["kept"].any()
    assert rows[N.DROP_REASON].tolist() == ["nonfinite"] * 3 + ["controllers"]
    assert bucket_metrics(rows) == {}
