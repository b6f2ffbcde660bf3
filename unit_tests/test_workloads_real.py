"""Real presets: layer pruning, the prompt splits, package files (no download, no Ray)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads import real
from asyncrl.workloads.checkpoints import load_model, save_checkpoint
from asyncrl.workloads.tokenizer import char_tokenizer

torch.set_num_threads(1)
TOK = char_tokenizer()


@pytest.mark.parametrize(
    ("total", "keep", "want"),
    [(30, 6, [0, 6, 12, 17, 23, 29]), (4, 4, [0, 1, 2, 3]), (5, 1, [0]), (5, 2, [0, 4])],
)
def test_kept_layers_evenly_spaced_first_and_last(total: int, keep: int, want: list[int]) -> None:
    assert real.kept_layers(total, keep) == want


def test_kept_layers_refuses_more_than_the_teacher_has() -> None:
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        real.kept_layers(4, 5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_prune_layers_copies_the_kept_layers(tmp_path: Path, arch: str) -> None:
    spec = ModelSpec(arch, hidden=32, layers=4, heads=2, intermediate=64, max_positions=64)
    teacher = build_model(spec, len(TOK), seed=0).eval()
    save_checkpoint(teacher, TOK, tmp_path / "teacher", {})
    real.prune_layers(tmp_path / "teacher", tmp_path / "student", 2)
    student, _ = load_model(tmp_path / "student")
    assert student.config.num_hidden_layers == 2
    t, s = teacher.state_dict(), student.state_dict()
    layer = "transformer.h" if arch == "gpt2" else "model.layers"
    for key, value in s.items():
        src = key.replace(f"{layer}.1.", f"{layer}.3.")  # kept layers [0, 3]: new 1 is old 3
        assert torch.equal(value, t[src]), key
    # all layers kept: the same function as the teacher
    real.prune_layers(tmp_path / "teacher", tmp_path / "full", 4)
    full, _ = load_model(tmp_path / "full")
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    torch.testing.assert_close(full(ids).logits, teacher(ids).logits, rtol=0, atol=0)
    meta = json.loads((tmp_path / "student" / "asyncrl_meta.json").read_text())
    assert meta["layers_kept"] == [0, 3] and meta["teacher_layers"] == 4


def _sharegpt(path: Path, convs: list[dict], *, cut: bool = False) -> Path:
    text = json.dumps(convs, indent=1)
    if cut:  # the shipped file stops inside its last conversation
        text = text[: text.rindex('"value"') + 12]
    path.write_text(text)
    return path


def _conv(cid: str, first: str, who: str = "human") -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": first}, {"from": "gpt", "value": "ok"}]}


def test_conversations_stops_at_a_cut_off_last_element(tmp_path: Path) -> None:
    f = _sharegpt(tmp_path / "d.json", [_conv("a", "hi"), _conv("b", "yo"), _conv("c", "cut")], cut=True)
    assert [c["id"] for c in real.conversations(f)] == ["a", "b"]
    whole = _sharegpt(tmp_path / "w.json", [_conv("a", "hi"), _conv("b", "yo")])
    assert [c["id"] for c in real.conversations(whole)] == ["a", "b"]
    broken = tmp_path / "b.json"
    broken.write_text('[{"id": "a"}, {"id": ]')
    with pytest.raises(json.JSONDecodeError):
        list(real.conversations(broken))


def test_first_turns_takes_the_first_human_turn(tmp_path: Path) -> None:
    convs = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": " q1 "}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only the model"}]},
        _conv("c", "   "),
    ]
    assert list(real.first_turns(_sharegpt(tmp_path / "d.json", convs))) == [("a", "q1")]


def _spec(**kw) -> real.RealPreset:
    pf = real.PackageFile("x", "1", "m", "MIT")
    base = dict(teacher=pf, prompts=pf, student_layers=1, train_size=20, eval_size=4)
    base |= dict(min_prompt_tokens=3, max_prompt_tokens=40, eval_every=4)
    return real.RealPreset("t", **(base | kw))


def test_prompt_splits_dedupe_filter_and_split_by_conversation(tmp_path: Path) -> None:
    convs = [_conv(f"c{i}", f"question number {i}?") for i in range(80)]
    convs += [_conv("dup", "Question   number 3?"), _conv("long", "x" * 200), _conv("short", "a")]
    data = _sharegpt(tmp_path / "d.json", convs)
    counts = real.write_prompt_splits(_spec(), data, TOK, tmp_path / "out")
    rows = {
        s: [json.loads(x) for x in (tmp_path / "out" / f"prompts/{s}.jsonl").read_text().splitlines()]
        for s in ("train", "eval")
    }
    assert counts["train"] == len(rows["train"]) == 20 and counts["eval"] == len(rows["eval"]) == 4
    assert counts["unique_first_turns"] == 82  # the duplicate (case and spaces aside) is dropped
    ids = {s: {r["conversation_id"] for r in rows[s]} for s in rows}
    assert not ids["train"] & ids["eval"]
    assert "long" not in ids["train"] | ids["eval"] and "short" not in ids["train"] | ids["eval"]
    assert all(r["messages"][0]["role"] == "user" and isinstance(r["prompt_id"], int) for r in rows["train"])
    # deterministic, and a conversation's side does not depend on the sizes asked for
    real.write_prompt_splits(_spec(train_size=10), data, TOK, tmp_path / "small")
    small = [json.loads(x) for x in (tmp_path / "small/prompts/train.jsonl").read_text().splitlines()]
    assert [r["conversation_id"] for r in small] == [r["conversation_id"] for r in rows["train"][:10]]


def test_prompt_splits_refuse_too_few(tmp_path: Path) -> None:
    data = _sharegpt(tmp_path / "d.json", [_conv(f"c{i}", f"q {i}") for i in range(10)])
    with pytest.raises(ValueError, match="lower its train_size"):
        real.write_prompt_splits(_spec(eval_size=0), data, TOK, tmp_path / "out")


def test_package_file_from_a_downloaded_wheel(tmp_path: Path) -> None:
    spec = real.PackageFile("my-pkg", "0.2.0", "my_pkg/data/file.bin", "MIT")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "my_pkg-0.2.0-py3-none-any.whl", "w") as z:
        z.writestr("my_pkg/data/file.bin", b"payload")
    f = real.package_file(spec, downloads, say=lambda m: None)
    assert f.read_bytes() == b"payload"
    assert real.package_file(spec, downloads, say=lambda m: None) == f  # extracted once
    missing = real.PackageFile("my-pkg", "0.2.0", "my_pkg/other.bin", "MIT")
    with pytest.raises(FileNotFoundError, match=r"has no 'my_pkg/other\.bin'"):
        real.package_file(missing, downloads, say=lambda m: None)


def test_real_preset_registry_and_paths(tmp_path: Path) -> None:
    assert real.is_real("smollm2") and not real.is_real("small")
    p = real.paths("smollm2", tmp_path)
    assert p["teacher_dir"].endswith("smollm2/teacher") and p["eval_prompts"].endswith("prompts/eval.jsonl")
    assert "asyncrl prepare smollm2" in real.prepare_hint("smollm2", ".asyncrl_cache")


def test_prepare_heals_the_student_once_and_again_when_its_heal_changes(tmp_path: Path, monkeypatch) -> None:
    """``prepare`` of a preset with ``heal``: prompts first, then the healed student, recorded in
    prepared.json; reused when prepared, rebuilt when the preset's HealSpec changes (no download: the
    package files and the GGUF conversion are stand-ins)."""
    from asyncrl.workloads import gguf
    from asyncrl.workloads.heal import HealSpec

    spec = ModelSpec("llama", hidden=32, layers=4, heads=2, intermediate=64, max_positions=96)
    teacher = build_model(spec, len(TOK), seed=0).eval()
    data = _sharegpt(tmp_path / "d.json", [_conv(f"c{i}", f"question number {i}?") for i in range(80)])
    monkeypatch.setattr(real, "package_file", lambda pf, downloads, say=print: data)
    monkeypatch.setattr(gguf, "gguf_to_checkpoint", lambda f, out: save_checkpoint(teacher, TOK, out, {}))
    heal = HealSpec(prompts=4, epochs=1, lr=1e-3, batch_size=2, max_new_tokens=3, temperature=1.0)
    presets = {"t": _spec(student_layers=2, heal=heal)}
    monkeypatch.setattr(real, "REAL_PRESETS", type("R", (), {"get": staticmethod(presets.__getitem__)}))
    made = real.prepare("t", tmp_path / "cache", progress=False)
    assert not made.reused and made.info["student"]["heal"]["spec"] == heal.to_dict()
    assert made.info["student"]["heal"]["steps"] == 2 and made.info["student"]["layers_kept"] == [0, 3]
    assert real.prepare("t", tmp_path / "cache", progress=False).reused
    presets["t"] = _spec(student_layers=2, heal=HealSpec(**(heal.to_dict() | {"epochs": 2})))
    again = real.prepare("t", tmp_path / "cache", progress=False)
    assert not again.reused and again.info["student"]["heal"]["steps"] == 4
