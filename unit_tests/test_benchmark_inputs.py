"""The benchmarks' own logic: the estimator benchmark's synthetic inputs satisfy every estimator
it times, and BENCHMARKS.md's partial regeneration keeps the other sections whole.

``benchmarks/estimators.py`` builds its batches by hand; when an estimator gained a required
column (the top-k cache's ``teacher_topk_log_tail``) the benchmark's top-k rows printed an error
instead of a time, and nothing failed. Here every case runs once, tiny, in this process: a
finite loss and a finite gradient on the logits."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import estimators as bench


@pytest.mark.parametrize(("label", "kind", "options", "which"), bench.CASES, ids=[c[0] for c in bench.CASES])
def test_every_benchmark_case_runs_on_its_inputs(label: str, kind: str, options: dict, which: str) -> None:
    z, batch = bench._inputs(kind, B=2, T=5, V=16, k=4, m=4, dense=options.get("dense", False))
    bench._step_fn(kind, options, chunk=2)(z, batch)
    assert z.grad is not None and torch.isfinite(z.grad).all(), label


def test_benchmarks_md_sections_ignore_headings_inside_printed_output(tmp_path) -> None:
    """``make_benchmarks_md --only`` keeps the other sections whole: a ``## `` line inside a
    benchmark's fenced output (estimators.py prints ``## V=64``) does not start a section."""
    import make_benchmarks_md as md

    text = (
        "# Benchmarks\n\nintro\n\n## A\n\nDate: x.\n\n```\n## V=64\nrow 1\n## V=128\nrow 2\n```\n\n"
        "## B\n\n| t |\n\n_Regeneration in progress: 1 more section(s) to come._\n"
    )
    (tmp_path / "B.md").write_text(text)
    kept = md.kept_sections(tmp_path / "B.md", {"B"})
    assert list(kept) == ["A"]
    assert kept["A"] == "## A\n\nDate: x.\n\n```\n## V=64\nrow 1\n## V=128\nrow 2\n```\n"
    assert list(md.kept_sections(tmp_path / "B.md", set())) == ["A", "B"]
    assert "Regeneration" not in md.kept_sections(tmp_path / "B.md", set())["B"]


@pytest.mark.parametrize("system", ["lag2_fused2", "lag2_fused2_mb2"])
def test_vs_trl_systems_train_batch_samples_per_optimizer_step(system: str, tmp_path) -> None:
    """A vs_trl system with train.minibatches=N gets a rollout batch of N x B, so every optimizer
    step trains the B samples TRL's steps do (the comparison is per sample at equal step size)."""
    import vs_trl

    spec = dict(
        task="addition", preset="tiny", cache_dir=str(tmp_path), seed=0, steps=60, batch=32,
        max_new_tokens=6, run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    cfg = vs_trl.run_config(spec, vs_trl.SYSTEMS[system][2])
    assert cfg.train.batch_size // cfg.train.minibatches == 32
    assert cfg.train.minibatches == (2 if system.endswith("_mb2") else 1)


def test_overlap_ceiling_layouts_train_every_batch_once_in_order() -> None:
    """``overlap_ceiling.py``'s serial and thread layouts run each batch through generate -> score ->
    learn exactly once and in order, and report shares of the wall clock within [0, 1]."""
    import overlap_ceiling as oc

    class Fake:
        def __init__(self) -> None:
            self.learned: list[tuple[int, int]] = []

        def generate(self, i: int) -> dict[str, int]:
            time.sleep(0.002)
            return {"i": i}

        def score(self, batch: dict[str, int]) -> dict[str, int]:
            return {**batch, "scored": 1}

        def learn(self, batch: dict[str, int], i: int) -> float:
            assert batch["scored"] == 1
            self.learned.append((batch["i"], i))
            time.sleep(0.002)
            return 0.0

    for layout in (oc.serial, oc.threads):
        st = Fake()
        res = layout(st, 5, 6)
        assert st.learned == [(i, i) for i in range(5, 11)], layout.__name__
        assert res["wall_s"] > 0 and res["minflt_per_batch"] >= 0
        shares = {k: v for k, v in res.items() if k.endswith(("_on_core", "_waiting"))}
        if layout is oc.threads and Path("/proc/thread-self/schedstat").exists():
            assert set(shares) == {
                "learner_on_core",
                "learner_waiting",
                "rollouts_on_core",
                "rollouts_waiting",
            }
        assert all(0 <= v <= 1.05 for v in shares.values()), shares


def test_an_interrupted_benchmarks_md_regeneration_keeps_every_section(tmp_path, monkeypatch) -> None:
    """``--only`` rewrites the file after every section; until a regenerated section is done, its
    old text and those after it stay in the file (a killed run used to leave only those before)."""
    import make_benchmarks_md as md

    a, b, c = md.BENCHES[:3]
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(
        f"# Benchmarks\n\nintro\n\n## {a.title}\n\nold a\n\n## {b.title}\n\nold b\n\n## {c.title}\n\nold c\n"
    )

    def interrupted(bench, args, work):
        assert md.kept_sections(out, set()).keys() == {a.title, b.title, c.title}  # while it runs
        raise KeyboardInterrupt

    monkeypatch.setattr(md, "run_bench", interrupted)
    with pytest.raises(KeyboardInterrupt):
        md.main(["--only", b.key, "--out", str(out), "--cache-dir", str(tmp_path)])
    kept = md.kept_sections(out, set())
    assert list(kept) == [a.title, b.title, c.title] and "old b" in kept[b.title]

    monkeypatch.setattr(md, "run_bench", lambda bench, args, work: (f"## {bench.title}\n\nnew b\n", True))
    assert md.main(["--only", b.key, "--out", str(out), "--cache-dir", str(tmp_path)]) == 0
    kept = md.kept_sections(out, set())
    assert list(kept) == [a.title, b.title, c.title]
    assert "new b" in kept[b.title] and "old a" in kept[a.title] and "old c" in kept[c.title]
