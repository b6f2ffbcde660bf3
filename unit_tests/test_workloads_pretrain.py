"""Pretraining the tiny pair, the checkpoint cache, load_pair and preset/model building."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import json
import shutil
import time

import pytest
import torch

from asyncrl.lab.presets import PRESETS, ModelSpec, build_model, get_preset, num_parameters
from asyncrl.lab.pretrain import exact_match, pretrain
from asyncrl.registry import RegistryError
from asyncrl.workloads.checkpoints import CheckpointError, load_pair, missing_parts
from asyncrl.workloads.tasks import get_task
from asyncrl.workloads.tokenizer import BOS_ID, EOS_ID, PAD_ID, char_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("pretrain_cache")
    t0 = time.perf_counter()
    result = pretrain("addition", "tiny", cache_dir=cache, seed=0, progress=False)
    return result, cache, time.perf_counter() - t0


def test_tiny_pretrain_reaches_thresholds(tiny) -> None:
    result, cache, seconds = tiny
    assert result.teacher_accuracy >= 0.95
    assert 0.05 <= result.student_accuracy <= 0.60
    assert not result.reused
    assert result.teacher_dir == cache / "addition-tiny-s0" / "teacher"
    for d in (result.teacher_dir, result.student_dir):
        assert missing_parts(d, require_meta=True) == []
        meta = json.loads((d / "asyncrl_meta.json").read_text())
        assert meta["task"] == "addition" and meta["preset"] == "tiny" and meta["seed"] == 0
        assert {"torch", "transformers", "asyncrl"} <= set(meta["versions"])
    print(f"tiny pretrain took {seconds:.1f}s")


def test_saved_pair_loads_and_accuracy_is_reproducible(tiny) -> None:
    result, _, _ = tiny
    teacher, student, tok = load_pair(result.teacher_dir, result.student_dir)
    assert tok.pad_token_id == PAD_ID and tok.eos_token_id == EOS_ID
    assert num_parameters(teacher) > num_parameters(student)
    task = get_task("addition")
    evals = task.make_examples("eval", get_preset("tiny").eval_size, 0)
    max_new = task.max_answer_chars + 1
    assert exact_match(teacher, tok, task, evals, max_new, batch_size=100) == pytest.approx(
        result.teacher_accuracy
    )
    assert exact_match(student, tok, task, evals, max_new, batch_size=512) == pytest.approx(
        result.student_accuracy
    )


def test_second_call_reuses_cache_and_force_retrains_check(tiny) -> None:
    result, cache, _ = tiny
    t0 = time.perf_counter()
    again = pretrain("addition", "tiny", cache_dir=cache, seed=0, progress=False)
    assert again.reused and time.perf_counter() - t0 < 10
    assert again.teacher_accuracy == result.teacher_accuracy
    assert again.student_accuracy == result.student_accuracy


def test_incomplete_or_missing_checkpoint_dirs_raise(tiny, tmp_path) -> None:
    result, _, _ = tiny
    with pytest.raises(
        CheckpointError, match=r"does not exist.*asyncrl pretrain --task addition --preset tiny"
    ):
        load_pair(tmp_path / "addition-tiny-s0" / "teacher", result.student_dir)
    broken = tmp_path / "addition-tiny-s0" / "student"
    shutil.copytree(result.student_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete \(missing: weights\)"):
        load_pair(result.teacher_dir, broken)
    assert missing_parts(broken) == ["weights"]


def test_tokenizer_mismatch_raises(tiny, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    result, _, _ = tiny
    other = tmp_path / "other"
    shutil.copytree(result.student_dir, other)
    tok = char_tokenizer()
    vocab = tok.get_vocab()
    from tokenizers import Tokenizer, models, pre_tokenizers

    swapped = dict(vocab)
    swapped["a"], swapped["b"] = vocab["b"], vocab["a"]
    core = Tokenizer(models.WordLevel(vocab=swapped, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>").save_pretrained(
        other
    )
    with pytest.raises(ValueError, match=r"tokenizers? .*differ.*different ids \['a', 'b'\]"):
        load_pair(result.teacher_dir, other)


def test_unknown_preset_and_task_suggest_names(tmp_path) -> None:
    with pytest.raises(RegistryError, match="did you mean 'tiny'"):
        pretrain("addition", "tiyn", cache_dir=tmp_path, progress=False)
    with pytest.raises(RegistryError, match="did you mean 'reverse'"):
        pretrain("revers", "tiny", cache_dir=tmp_path, progress=False)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2", "small"])
def test_presets_build_float32_models_with_special_ids(name: str) -> None:
    preset = PRESETS.get(name)
    tok = char_tokenizer()
    teacher = build_model(preset.teacher, len(tok), seed=0)
    student = build_model(preset.student, len(tok), seed=0)
    for m in (teacher, student):
        assert next(m.parameters()).dtype == torch.float32
        assert (m.config.pad_token_id, m.config.bos_token_id, m.config.eos_token_id) == (
            PAD_ID,
            BOS_ID,
            EOS_ID,
        )
        assert m.config.vocab_size == len(tok)
    assert num_parameters(teacher) >= 3 * num_parameters(student) if name == "small" else True
    if name == "small":
        assert 0.9e6 <= num_parameters(student) <= 3e6


def test_build_model_is_deterministic_in_seed() -> None:
    spec = ModelSpec("llama", hidden=16, layers=1, heads=2, intermediate=32)
    a, b, c = (build_model(spec, 20, s) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec(hidden=30, heads=4)


def test_supervised_training_shows_a_progress_line_per_eval() -> None:
    """Pretraining reports through the same display as runs: plain lines at its evals."""
    import io

    from asyncrl.lab.presets import Schedule, build_model
    from asyncrl.lab.pretrain import train_supervised
    from asyncrl.telemetry.progress import SUPERVISED_FIELDS, Progress

    tok = char_tokenizer()
    task = get_task("addition")
    model = build_model(get_preset("tiny").student, len(tok), 0)
    schedule = Schedule(max_steps=6, warmup=1, batch_size=8, eval_every=3, stop_at=1.01)
    out = io.StringIO()
    with Progress(6, stream=out, title="pretrain student", fields=SUPERVISED_FIELDS, log_every_s=3600) as bar:
        train_supervised(
            model,
            tok,
            task,
            task.make_examples("train", 32, 0),
            task.make_examples("eval", 8, 0),
            schedule,
            seed=0,
            progress=bar,
        )
    lines = out.getvalue().splitlines()
    assert [line.split()[3] for line in lines] == ["3/6", "6/6"]
    assert all(
        line.startswith("[pretrain student] step") and "loss " in line and "eval " in line for line in lines
    )


# --- per-task presets, the student band and the hard errors --------------------------------------------
def test_for_task_applies_only_that_tasks_overrides() -> None:
    tiny = get_preset("tiny")
    assert tiny.for_task("addition") == tiny  # addition trains the preset as it always did
    rs = tiny.for_task("running_sum")
    assert rs.student != tiny.student and rs.teacher == tiny.teacher and rs.per_task == {}
    long = tiny.for_task("running_sum_long")
    assert long.teacher.max_positions >= 2 * 129 + 1  # prompt + answer + EOS + <bos>
    with pytest.raises(ValueError, match=r"no pretraining budget for task 'reverse'.*per_task\['reverse'\]"):
        tiny.for_task("reverse")
    with pytest.raises(ValueError, match=r"per_task\['x'\] sets \['students'\]"):
        dataclasses.replace(tiny, per_task={"x": {"students": tiny.student}})


def test_qwen_preset_builds_tied_qwen3_models_with_the_qwen_ids() -> None:
    from asyncrl.workloads.tokenizer import TOKENIZERS

    preset = get_preset("qwen-tiny")
    builtin = TOKENIZERS.get(preset.tokenizer)
    tok = builtin.build()
    ids = {"pad_id": tok.pad_token_id, "bos_id": None, "eos_id": tok.eos_token_id}
    student = build_model(preset.student, builtin.vocab_size(tok), seed=0, **ids)
    assert type(student).__name__ == "Qwen3ForCausalLM" and student.config.vocab_size == 151_936
    assert student.get_output_embeddings().weight is student.get_input_embeddings().weight
    assert (student.config.pad_token_id, student.config.eos_token_id) == (151_643, 151_645)


def _preset_with(**schedules) -> object:
    tiny = get_preset("tiny")
    return dataclasses.replace(tiny, name="tiny-test", **schedules)


def test_a_student_below_its_band_fails_naming_the_knob(tmp_path) -> None:
    from asyncrl.lab.presets import Schedule
    from asyncrl.lab.pretrain import PretrainError

    preset = _preset_with(
        teacher_schedule=Schedule(max_steps=5, eval_every=5, stop_at=0.0),  # any teacher passes
        student_schedule=Schedule(max_steps=10, eval_every=5, stop_at=0.2, cap=0.5),
    )
    with pytest.raises(
        PretrainError, match=r"below the band \[0\.2, 0\.5\]; raise student_schedule\.max_steps"
    ):
        pretrain("addition", preset, cache_dir=tmp_path, progress=False)
    assert missing_parts(tmp_path / "addition-tiny-test-s0" / "student") == ["directory"]  # nothing cached


def test_a_teacher_below_stop_at_fails_naming_the_knob(tmp_path) -> None:
    from asyncrl.lab.presets import Schedule
    from asyncrl.lab.pretrain import PretrainError

    preset = _preset_with(teacher_schedule=Schedule(max_steps=5, eval_every=5, stop_at=0.9))
    with pytest.raises(
        PretrainError, match=r"teacher reached .* < teacher_schedule\.stop_at=0\.9.*max_steps"
    ):
        pretrain("addition", preset, cache_dir=tmp_path, progress=False)


def test_an_overshoot_is_bisected_to_a_step_inside_the_band() -> None:
    """Accuracy jumps 0.1 -> 0.9 between two evaluations; the earliest in-band step is found."""
    from asyncrl.lab.presets import Schedule
    from asyncrl.lab.pretrain import PretrainError, _bisect_band

    model = torch.nn.Linear(1, 1, bias=False)
    curve = {11: 0.12, 12: 0.15, 13: 0.18, 14: 0.3, 15: 0.45, 16: 0.8, 17: 0.85, 18: 0.88, 19: 0.89}
    snaps = [(s, {"weight": torch.full((1, 1), float(s))}) for s in curve]
    evaluated = []

    def accuracy() -> float:
        evaluated.append(int(model.weight.item()))
        return curve[evaluated[-1]]

    band = Schedule(max_steps=20, stop_at=0.2, cap=0.5)
    _, acc, step = _bisect_band(model, snaps, accuracy, band, (10, 0.1), (20, 0.9), print)
    assert (step, acc) == (14, 0.3) and len(evaluated) <= 4 and model.weight.item() == 14
    jump = {s: (0.1 if s <= 14 else 0.9) for s in curve}
    with pytest.raises(
        PretrainError, match=r"jumped over the band.*0\.100 at step 14, 0\.900 at step 15.*lr"
    ):
        _bisect_band(model, snaps, lambda: jump[int(model.weight.item())], band, (10, 0.1), (20, 0.9), print)


def test_band_snapshots_copy_tied_weights_once_and_restore_them_tied() -> None:
    """The band search's per-step copy (``_snapshot``): a tied embedding / LM head (qwen3's) is one
    copy under both keys, the copy does not follow later steps, and loading it keeps the tie."""
    from asyncrl.lab.pretrain import _snapshot

    model = torch.nn.Sequential(torch.nn.Embedding(7, 3), torch.nn.Linear(3, 7, bias=False))
    model[1].weight = model[0].weight
    before = model[0].weight.detach().clone()
    snap = _snapshot(model)
    assert set(snap) == {"0.weight", "1.weight"} and snap["0.weight"] is snap["1.weight"]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(snap["0.weight"], before)
    model.load_state_dict(snap)
    assert model[1].weight is model[0].weight and torch.equal(model[0].weight, before)
    untied = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    copies = _snapshot(untied)
    assert len({v.data_ptr() for v in copies.values()}) == 4  # two weights, two biases


def test_cache_lock_lets_one_trainer_at_a_time_and_sits_beside_the_entry(tmp_path):
    """Two callers pretraining the same pair (a background warm-up and a test fixture, or two CLI
    runs) must not train and write one cache entry at once: the second waits for the first."""
    import fcntl
    import threading

    from asyncrl.lab.pretrain import cache_lock

    root = tmp_path / "addition-tiny-s0"
    order: list[str] = []
    with cache_lock(root):
        lock_file = tmp_path / ".locks" / "addition-tiny-s0.lock"
        with open(lock_file, "w") as other:  # another open file description: as another process
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
        assert held

        def second() -> None:
            with cache_lock(root):
                order.append("second")

        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(timeout=0.3)
        order.append("first done")
    waiter.join(timeout=5)
    assert order == ["first done", "second"]
    assert not root.exists()  # the lock lives beside the entry: a failed pretraining caches nothing
