"""Healing a pruned student (``asyncrl.workloads.heal``, ``real.heal_student``): the loss, the fit,
determinism, and the prepared student's record (tiny models, no download, no Ray)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from asyncrl import records as R
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads import real
from asyncrl.workloads.checkpoints import load_model, save_checkpoint
from asyncrl.workloads.heal import HealSpec, forward_kl_loss, heal, teacher_corpus
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()
SPEC = ModelSpec("llama", hidden=32, layers=4, heads=2, intermediate=64, max_positions=64)
PROMPTS = [
    [TOK.convert_tokens_to_ids(c) for c in w] for w in ("12+3=", "4+56=", "7+8=", "90+1=", "2+2=", "33+4=")
]


def test_forward_kl_loss_is_the_masked_token_mean_of_the_exact_kl() -> None:
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    want = []
    for b, t in [(0, 0), (0, 1), (1, 0)]:
        pp, qq = torch.softmax(p[b, t], -1), torch.softmax(q[b, t], -1)
        want.append(float((pp * (pp.log() - qq.log())).sum()))
    assert float(forward_kl_loss(q, p, mask)) == pytest.approx(sum(want) / 3, rel=1e-6)
    assert float(forward_kl_loss(p, p, mask)) == pytest.approx(0.0, abs=1e-6)


def _kl_on(corpus, student, teacher) -> float:
    with torch.no_grad():
        total, n = 0.0, 0.0
        for ids, mask, y, ym in corpus:
            q = R.completion_logits(student, ids, mask, y, ym)
            p = R.completion_logits(teacher, ids, mask, y, ym)
            total += float(forward_kl_loss(q, p, ym)) * float(ym.sum())
            n += float(ym.sum())
    return total / n


def _pair(tmp_path: Path):
    teacher = build_model(SPEC, len(TOK), seed=0).eval()
    save_checkpoint(teacher, TOK, tmp_path / "teacher", {})
    real.prune_layers(tmp_path / "teacher", tmp_path / "prune", 2)
    return teacher


def test_heal_fits_the_student_to_the_teacher_on_its_responses_deterministically(tmp_path: Path) -> None:
    teacher = _pair(tmp_path)
    kw = dict(max_new_tokens=6, temperature=1.0, batch_size=4)
    corpus = teacher_corpus(teacher, TOK, PROMPTS, seed=3, **kw)
    again = teacher_corpus(teacher, TOK, PROMPTS, seed=3, **kw)
    assert len(corpus) == 2 and [c[0].shape[0] for c in corpus] == [4, 2]
    for a, b in zip(corpus, again):
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # a function of the seed
    students = []
    for _ in range(2):
        student, _ = load_model(tmp_path / "prune")
        before = _kl_on(corpus, student, teacher)
        out = heal(student, teacher, corpus, epochs=15, lr=3e-3, seed=1)
        students.append(student)
    after = _kl_on(corpus, student, teacher)
    assert after < 0.5 * before, (before, after)
    assert out["steps"] == 30 and len(out["epoch_loss"]) == 15
    assert out["epoch_loss"][-1] < out["epoch_loss"][0]
    assert out["corpus_tokens"] == sum(int(c[3].sum()) for c in corpus)
    assert not student.training  # left in eval mode
    for (k, a), b in zip(students[0].state_dict().items(), students[1].state_dict().values()):
        assert torch.equal(a, b), k
    # the teacher as its own student: nothing to fit
    assert _kl_on(corpus, teacher, teacher) == pytest.approx(0.0, abs=1e-6)


def test_heal_refuses_an_empty_corpus(tmp_path: Path) -> None:
    teacher = _pair(tmp_path)
    with pytest.raises(ValueError, match="non-empty corpus"):
        heal(teacher, teacher, [], epochs=1, lr=1e-3, seed=0)


@pytest.mark.parametrize(
    ("field", "value"), [("prompts", 0), ("epochs", 0), ("lr", 0.0), ("temperature", 0.0), ("batch_size", 0)]
)
def test_heal_spec_names_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"HealSpec.{field}"):
        HealSpec(**{field: value})


def test_heal_student_saves_the_healed_prune_with_its_record(tmp_path: Path) -> None:
    _pair(tmp_path)
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": TOK.decode(p)}) + "\n" for p in PROMPTS))
    spec = real.RealPreset(
        "tiny",
        teacher=real.REAL_PRESETS.get("smollm2").teacher,
        prompts=real.REAL_PRESETS.get("smollm2").prompts,
        student_layers=2,
        heal=HealSpec(prompts=4, epochs=2, lr=1e-3, batch_size=2, max_new_tokens=4, temperature=1.0),
    )
    said: list[str] = []
    out = real.heal_student(spec, tmp_path / "teacher", tmp_path / "student", prompts, said.append)
    student, _ = load_model(out)
    assert student.config.num_hidden_layers == 2
    meta = json.loads((out / "asyncrl_meta.json").read_text())
    assert meta["layers_kept"] == [0, 3]
    assert meta["heal"]["spec"] == spec.heal.to_dict() and meta["heal"]["steps"] == 4
    assert real._heal_of(out) == spec.heal.to_dict()  # what prepare compares to rebuild
    assert real._heal_of(tmp_path / "prune") is None
    bare, _ = load_model(tmp_path / "prune")
    moved = any(
        not torch.equal(a, b) for a, b in zip(student.state_dict().values(), bare.state_dict().values())
    )
    assert moved
    assert any("epoch 2/2" in s for s in said)
    # more prompts than the split has: the error names the field and the fix
    big = real.RealPreset(
        "tiny", teacher=spec.teacher, prompts=spec.prompts, student_layers=2, heal=HealSpec(prompts=99)
    )
    with pytest.raises(ValueError, match=r"heal\.prompts is 99 but the train split has 6"):
        real.heal_student(big, tmp_path / "teacher", tmp_path / "student2", prompts, said.append)


def test_the_healed_preset_shares_the_split_of_smollm2() -> None:
    healed = real.REAL_PRESETS.get("smollm2-healed")
    assert healed.split_key == "smollm2" and healed.heal is not None
    assert real.REAL_PRESETS.get("smollm2").heal is None
