"""Every built-in task x tiny preset pretrains to its targets, and the demo path runs on each task.

Pretraining lands the teacher at >= its ``stop_at`` and the student inside its band (or raises
``PretrainError``: a pair outside its targets is never cached), within the per-task budgets
``Preset.per_task`` sets. The pairs go to the shared test cache, so the demo test below (and
later sessions) reuse them. The demo path sizes generation from the task: a 129-token
``running_sum_long`` answer is generated whole, so the pretrained student's accuracy is seen by
the run's first evaluation instead of 0 (what the old fixed ``max_new_tokens=6`` produced).
"""

from __future__ import annotations

import json

import pytest
from conftest import CACHE, check_demo_sizing

from asyncrl.cli import main
from asyncrl.lab.presets import get_preset
from asyncrl.workloads.tasks import TASKS

BUILTIN_TASKS = TASKS.names()
TINY_PRESETS = ("tiny", "tiny-gpt2")
#: the cell CI runs by default (a long-answer task the char presets budget); the rest: ``-m slow``
SAMPLED = ("running_sum", "tiny")


def _cells(*presets: str, sampled: tuple[str, str] | None = SAMPLED) -> list:
    """Every task (x preset); all but the ``sampled`` cell marked slow."""
    cells = []
    for task in BUILTIN_TASKS:
        for preset in presets:
            marks = () if (task, preset) == sampled else (pytest.mark.slow,)
            cells.append(pytest.param(task, preset, marks=marks, id=f"{task}-{preset}"))
    return cells


def _budgeted(preset: str, task: str) -> bool:
    """False where the preset refuses the task up front (``Preset.per_task[task]`` is a reason)."""
    return not isinstance(get_preset(preset).per_task.get(task), str)


@pytest.mark.parametrize(("task", "preset"), _cells(*TINY_PRESETS))
def test_tiny_presets_pretrain_every_task_into_its_targets(task: str, preset: str, tmp_path) -> None:
    from asyncrl.lab.pretrain import PretrainError, pretrain

    if not _budgeted(preset, task):  # refused at once, naming the knob, nothing trained or cached
        with pytest.raises(
            PretrainError, match=rf"no pretraining budget for task '{task}'.*Preset\.per_task"
        ):
            pretrain(task=task, preset=preset, cache_dir=tmp_path, seed=0, progress=False)
        assert not any(tmp_path.iterdir())
        return
    res = pretrain(task=task, preset=preset, cache_dir=CACHE, seed=0, progress=False)
    p = get_preset(preset).for_task(task)
    assert res.teacher_accuracy >= p.teacher_schedule.stop_at
    assert p.student_schedule.stop_at <= res.student_accuracy <= p.student_schedule.cap
    meta = json.loads((res.student_dir / "asyncrl_meta.json").read_text())
    assert meta["task"] == task and meta["model"]["layers"] == p.student.layers
    print(f"{task} x {preset}: teacher {res.teacher_accuracy:.3f}, student {res.student_accuracy:.3f}")


@pytest.mark.ray
# CI's demo-path cell (`running_sum` x `tiny`) is run by integration_tests/test_cli_terminal.py, which
# makes the same checks (check_demo_sizing) on the demo it runs in a terminal: one demo, not two
@pytest.mark.parametrize(("task", "preset"), _cells("tiny", sampled=None))
def test_demo_path_sizes_generation_from_each_task(
    task: str, preset: str, ray_local, tmp_path, capsys
) -> None:
    root = tmp_path / "demo"
    argv = ["demo", "--quiet", "--task", task, "--preset", preset, "--steps", "2", "--cache-dir", str(CACHE)]
    argv += ["--run-root", str(root), "train.batch_size=8", "train.eval_every=2", "train.eval_size=32"]
    argv += ["telemetry.tensorboard=false"]
    if not _budgeted(preset, task):
        assert main(argv) == 1
        assert "no pretraining budget" in capsys.readouterr().err
        return
    assert main(argv) == 0
    check_demo_sizing(root, task, steps=2)
    assert "student accuracy before" in capsys.readouterr().out
