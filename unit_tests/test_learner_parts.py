"""The learner recipe's small parts, Ray-free: the numerics guard (``step.NumericsGuard``), the
checkpoint cadence (``checkpoint.Checkpointer.due``), the abort note (``checkpoint.write_abort``)
and NaN injection (``faults.InjectedNaN``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from asyncrl import checkpoint as C
from asyncrl.faults import FaultConfig, Faults, InjectedNaN
from asyncrl.step import NumericsGuard


def _result(version: int, *, nonfinite: bool = False, stepped: bool | None = None) -> SimpleNamespace:
    stepped = not nonfinite if stepped is None else stepped
    return SimpleNamespace(version=version, nonfinite=nonfinite, stepped=stepped)


def test_guard_trips_after_limit_bad_steps_in_a_row_and_remembers_the_first():
    guard = NumericsGuard(limit=2)
    guard.update(_result(3))  # step 3 applied
    guard.update(_result(3, nonfinite=True))  # step 4 skipped
    assert (guard.streak, guard.first_bad_step, guard.tripped) == (1, 4, False)
    guard.update(_result(3, stepped=False))  # every sample dropped: neither breaks nor extends it
    guard.update(_result(3, nonfinite=True))
    assert (guard.streak, guard.first_bad_step, guard.tripped) == (2, 4, True)
    assert "from step 4" in guard.message("RUN/checkpoints/x/step_000003")


def test_guard_streak_resets_on_a_good_step_and_limit_zero_never_trips():
    guard = NumericsGuard(limit=2)
    guard.update(_result(0, nonfinite=True))
    guard.update(_result(1))
    guard.update(_result(1, nonfinite=True))
    assert (guard.streak, guard.first_bad_step, guard.tripped) == (1, 2, False)
    off = NumericsGuard(limit=0)
    for _ in range(5):
        off.update(_result(0, nonfinite=True))
    assert not off.tripped


def test_checkpoint_cadence_counts_from_the_resumed_version_and_the_last_step_is_always_due():
    ckpt = C.Checkpointer(SimpleNamespace(rank=0, world=1), every=5, steps=12, version=3)
    assert [v for v in range(4, 13) if ckpt.due(v)] == [5, 6, 7, 8, 9, 10, 11, 12]  # last = 3 until saved
    ckpt.last = 5
    assert [v for v in range(6, 13) if ckpt.due(v)] == [10, 11, 12]
    never = C.Checkpointer(SimpleNamespace(rank=0, world=1), every=0, steps=12, version=0)
    assert [v for v in range(1, 13) if never.due(v)] == [12]


def test_abort_note_names_the_first_bad_step_and_the_latest_checkpoint(tmp_path):
    guard = NumericsGuard(limit=1)
    guard.update(_result(7, nonfinite=True))
    C.write_abort(tmp_path, guard)
    note = json.loads((tmp_path / C.ABORT_FILE).read_text())
    assert note["step"] == 8 and "checkpointed in None" in note["message"]  # no checkpoint in tmp_path


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(2, 3)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def test_injected_nan_fires_once_per_run_for_count_attempts_from_step_k(tmp_path):
    faults = Faults(FaultConfig(nonfinite_step=2, nonfinite_count=2), str(tmp_path / "faults"))
    model = _Head()
    inject = InjectedNaN(faults, model)
    x = torch.ones(1, 2)
    nan_at = []
    for step in [1, 2, 2, 2, 3]:
        with inject(step):
            nan_at.append(bool(model(x).isnan().any()))
        assert not model(x).isnan().any()  # the hook is gone outside the attempt
    assert nan_at == [False, True, True, False, False]
    again = InjectedNaN(faults, model)  # a restarted learner: the marker says it already fired
    with again(2):
        assert not model(x).isnan().any()
