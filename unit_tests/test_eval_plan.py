"""Which eval a run gets (exact match or agreement with the teacher), and how it is reported."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from asyncrl.cli import real_demo_table, response_samples
from asyncrl.config import load_config
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.plan import ModelPaths, eval_plan
from asyncrl.telemetry import names as N
from asyncrl.telemetry.progress import Display
from asyncrl.telemetry.summary import agreement, read_evals
from asyncrl.workloads.checkpoints import save_checkpoint
from asyncrl.workloads.tasks import Example, prompt_token_ids
from asyncrl.workloads.tokenizer import char_tokenizer

TOK = char_tokenizer()
TASK_EXAMPLES = [Example(prompt="1+1=", answer="2", prompt_id=0)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelPaths:
    d = tmp_path_factory.mktemp("m") / "student"
    save_checkpoint(build_model(ModelSpec(), len(TOK), 0), TOK, d, {})
    return ModelPaths(teacher_dir=str(d), student_dir=str(d), teacher_accuracy=None, student_accuracy=None)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(**workload: str | None):
    over = [f"workload.{k}={v}" for k, v in workload.items() if v is not None]
    return load_config(None, [*over, "train.eval_size=2"])


def test_task_split_without_prompt_files_or_teacher(models: ModelPaths, tmp_path: Path) -> None:
    assert eval_plan(_cfg(), models, TASK_EXAMPLES).kind == "exact_match"
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    rl = ModelPaths(None, models.student_dir, None, None)
    plan = eval_plan(_cfg(prompts_path=f), rl, TASK_EXAMPLES)
    assert plan.kind == "exact_match" and plan.examples == TASK_EXAMPLES


def test_held_out_prompts_without_answers_are_evaluated_by_agreement(
    models: ModelPaths, tmp_path: Path
) -> None:
    ev = _jsonl(tmp_path / "e.jsonl", [{"prompt": "abc"}, {"prompt": "de"}, {"prompt": "not read"}])
    plan = eval_plan(_cfg(eval_prompts_path=ev), models, TASK_EXAMPLES)
    assert plan.kind == "agreement" and plan.note is None
    assert plan.prompt_ids == prompt_token_ids(TOK, ["abc", "de"])  # the first train.eval_size rows


def test_training_prompts_without_answers_get_agreement_and_a_note(
    models: ModelPaths, tmp_path: Path
) -> None:
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": "abc"}, {"prompt": "de"}])
    plan = eval_plan(_cfg(prompts_path=f), models, TASK_EXAMPLES)
    assert plan.kind == "agreement" and "workload.eval_prompts_path" in plan.note


def test_rows_with_answers_keep_exact_match(models: ModelPaths, tmp_path: Path) -> None:
    ev = _jsonl(tmp_path / "e.jsonl", [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}])
    own = eval_plan(_cfg(eval_prompts_path=ev), models, TASK_EXAMPLES)
    assert own.kind == "exact_match" and [(e.prompt, e.answer) for e in own.examples] == [
        ("1+2=", "3"),
        ("2+2=", "4"),
    ]
    train = eval_plan(_cfg(prompts_path=ev), models, TASK_EXAMPLES)  # as before: the task's split
    assert train.kind == "exact_match" and train.examples == TASK_EXAMPLES


def _evals(run: Path) -> None:
    recs = [
        {"step": 0, "seconds": 1.0, "metrics": {"kl_reverse": 8.0, "kl_forward": 9.0, "top1_agree": 0.1,
                                                 "teacher_nll": 5.0, "rouge_l": 0.0},
         "samples": [{"prompt": "p", "student": "garbage", "teacher": "answer"}]},
        {"step": 10, "seconds": 1.0, "metrics": {"kl_reverse": 3.0, "kl_forward": 3.5, "top1_agree": 0.3,
                                                  "teacher_nll": 3.0, "rouge_l": 0.1},
         "samples": [{"prompt": "p", "student": "closer", "teacher": "answer"}]},
        {"step": 10, "seconds": 1.0, "metrics": {"kl_reverse": 2.0, "kl_forward": 2.5, "top1_agree": 0.4,
                                                  "teacher_nll": 2.0, "rouge_l": 0.2},
         "samples": [{"prompt": "p", "student": "resumed", "teacher": "answer"}]},
    ]  # fmt: skip
    (run / N.EVAL_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_summary_reads_first_and_last_evaluation(tmp_path: Path) -> None:
    assert agreement(tmp_path)["eval_kl_reverse_initial"] is None
    _evals(tmp_path)
    assert [r["step"] for r in read_evals(tmp_path)] == [0, 10]  # a step evaluated again: the latest wins
    out = agreement(tmp_path)
    assert out["eval_kl_reverse_initial"] == 8.0 and out["eval_kl_reverse_final"] == 2.0
    assert out["eval_rouge_l_final"] == 0.2
    assert set(out) <= set(N.SUMMARY_KEYS)


def test_demo_table_and_samples(tmp_path: Path) -> None:
    _evals(tmp_path)
    s = {"max_lag": 0, **agreement(tmp_path), "samples_per_s": 2.0, "wall_time_s": 10.0, "lag_max": 0}
    a = {**s, "max_lag": 2, "samples_per_s": 3.0, "lag_max": 2}
    table = real_demo_table(s, a, "r.html")
    assert "8.000 -> 2.000" in table and "1.50x" in table and "async (max_lag 2)" in table
    shown = response_samples(tmp_path)
    assert "garbage" in shown and "resumed" in shown and "answer" in shown


def test_progress_line_shows_the_agreement_eval() -> None:
    with Display(enabled=True, mode="plain") as d:
        row = d.row("run", total=20)
        row.update(5, {N.EVAL_KL_REVERSE: 3.25, N.EVAL_STEP: 0.0, N.LOSS: 1.0})
        assert "rKL 3.250@0" in row.stats({})
