"""The benchmarks' own logic: the estimator benchmark's synthetic inputs satisfy every estimator
it times, BENCHMARKS.md's partial regeneration keeps the other sections whole, and the in-flight
benchmark's summary pairs its runs by seed.

``benchmarks/estimators.py`` builds its batches by hand; when an estimator gained a required
column (the top-k cache's ``teacher_topk_log_tail``) the benchmark's top-k rows printed an error
instead of a time, and nothing failed. Here every case runs once, tiny, in this process: a
finite loss and a finite gradient on the logits."""

from __future__ import annotations

import math
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


@pytest.mark.parametrize("system", __import__("vs_trl").REGIMES["smollm2"]["systems"])
def test_vs_trl_smollm2_systems_parse_and_build_their_configs(system: str, tmp_path) -> None:
    """Every system of the real regime (``--regime smollm2``) builds its run config from
    ``opd_smollm2.yaml``: the real preset, 128 new tokens, lr 1e-4, B samples per optimizer step,
    and the precision, layout and loss its name says."""
    import vs_trl

    from asyncrl.plan import absolute_paths

    regime = vs_trl.REGIMES["smollm2"]
    assert system in vs_trl.SYSTEMS and vs_trl.REFERENCE in regime["systems"]
    spec = dict(
        task=regime["task"], preset=regime["preset"], config=regime["config"], base=regime["base"],
        cache_dir=str(tmp_path),
        seed=0, steps=6, batch=8, max_new_tokens=regime["max_new_tokens"], run_dir=str(tmp_path / "run"),
    )  # fmt: skip
    label, kind, overrides, _ = vs_trl.SYSTEMS[system]
    cfg = vs_trl.run_config(spec, overrides)
    assert vs_trl.run_config(spec, overrides, parse_only=True).train.lr == cfg.train.lr == 1.0e-4
    assert cfg.workload.preset == "smollm2" and cfg.sampling.max_new_tokens == 128
    assert cfg.train.batch_size // cfg.train.minibatches == 8 and cfg.train.eval_every == 0
    assert cfg.estimator.name == "forward_kl"
    bf16 = system.endswith("_bf16")
    assert (cfg.train.precision == "bf16") == bf16 == vs_trl.is_bf16(system), label
    assert (cfg.pipeline.teacher_dtype == "bfloat16") == bf16
    assert cfg.pipeline.engine_options == ({"dtype": "bfloat16"} if bf16 else {})
    if kind == "pipeline":
        assert cfg.pipeline.colocate == ("colocated" in system)
        assert cfg.pipeline.max_lag == int(system[3])
        assert bool(cfg.estimator.options.get("dense")) == ("top16" not in system)
        if not cfg.pipeline.colocate:  # stage actors ship the teacher cache: top-k at this vocabulary
            assert not cfg.estimator.options.get("dense")
    else:
        assert cfg.estimator.options.get("dense") is True  # TRL and the plain loop: dense forward KL
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "prepared.json").write_text("{}")  # what `asyncrl prepare` leaves
    made = absolute_paths(cfg).workload  # the prepared splits: train.jsonl to train, eval.jsonl held out
    assert made.prompts_path.endswith("smollm2/prompts/train.jsonl")
    assert made.eval_prompts_path.endswith("smollm2/prompts/eval.jsonl")


def test_vs_trl_smollm2_figures_and_markdown_from_fake_results() -> None:
    """The real regime's figures (tokens/s over the steady steps, padding, peak memory, agreement)
    and its table, goals and notes render from children's results of the documented shape."""
    import vs_trl

    def child(tokens_per_step: int, first: float, dt: float, kl: float, pad: float = 0.25) -> dict:
        ends = [100.0 + first + dt * k for k in range(6)]
        return {
            "step_ends": ends, "kept": [8] * 6, "tokens": [tokens_per_step] * 6,
            "padding": [pad - 0.05, pad + 0.05] * 3,
            "memory": {"main": 900.0, "processes": [["ray::RayTrainWorker", 2100.0], ["raylet", 60.0]]},
            "kl_forward": kl, "kl_reverse": kl, "top1_agree": 0.5, "teacher_nll": 2.0, "rouge_l": 0.2,
            "launch": 100.0, "process_s": first + 6 * dt + 5, "loadavg_1m": [3.0, 4.0],
        }  # fmt: skip

    fig = vs_trl.figures(child(500, 10.0, 2.0, 0.5), skip=2)
    assert fig["steady_tokens_per_s"] == pytest.approx(4 * 500 / 8.0)
    assert fig["steady_samples_per_s"] == pytest.approx(4 * 8 / 8.0)
    assert fig["first_step_s"] == pytest.approx(10.0) and fig["padding_frac"] == pytest.approx(0.25)
    assert fig["peak_rss_main_mb"] == 900.0 and fig["peak_rss_other_max_mb"] == 2100.0
    with pytest.raises(SystemExit, match="token counts"):
        vs_trl.figures({**child(500, 10.0, 2.0, 0.5), "tokens": [1, 2]}, skip=2)
    results = {
        "trl": child(500, 30.0, 4.0, 0.6),
        "trl_bf16": child(500, 30.0, 3.0, 0.6),
        "lag1_colocated": child(500, 15.0, 2.0, 0.55, pad=0.3),
        "lag1_colocated_top16_bf16": child(500, 25.0, 1.0, 0.58),
    }
    rounds = {
        n: [{**vs_trl.figures(r, 2), "memory": r["memory"], "loadavg_1m": r["loadavg_1m"]}]
        for n, r in results.items()
    }
    medians = {n: {k: v for k, v in rows[0].items() if isinstance(v, float)} for n, rows in rounds.items()}
    q = {"kl_forward": 1.0, "kl_reverse": 0.9, "top1_agree": 0.4, "teacher_nll": 3.0, "rouge_l": 0.1}
    parity = {"loss_asyncrl": 1.0, "loss_trl": 1.0, "loss_rel_diff": 0.0, "grad_rel_diff": 0.0}
    report = {
        "settings": {"eval": "agreement", "steps": 6, "skip": 2, "batch": 8, "max_new_tokens": 128,
                     "rounds": 1, "lr": 1e-4, "eval_size": 16},
        "rounds": rounds, "medians": medians,
        "stages": {"limits": {}, "initial": q, "initial_seed1": {**q, "kl_reverse": 0.95}, "parity": parity},
    }  # fmt: skip
    md = vs_trl.markdown(report)
    assert "| system | tokens/s |" in md and "untrained student (eval seed 1)" in md
    # fp32: 250 / 125 tokens/s = 2.00x (met); bf16: 500 / 166.7 = 3.00x against TRL bf16
    assert "best asyncrl layout `lag1_colocated` 250.0 vs `trl` 125.0 = 2.00x" in md
    assert "`lag1_colocated_top16_bf16` 500.0 vs `trl_bf16` 166.7 = 3.00x" in md
    assert "**missed** by 1 of 2" in md  # first step 25 s > 20 s
    assert "**missed**: `lag1_colocated` 30.0 %" in md  # the others' 25.0 % is within the floor
    assert "- `lag1_colocated`: main 900; ray::RayTrainWorker 2100" in md  # raylet's 60 MiB left out


def test_batching_headroom_replays_agree_where_they_must() -> None:
    """``benchmarks/batching_headroom.py``'s schedule replays: with equal lengths nothing finishes
    early, so compaction and static cost the same; with a flat step cost continuous batching takes
    sum(L) / B steps; partial rollouts emit every row once, and a row spans calls only if carried."""
    import batching_headroom as bh
    import numpy as np

    flat = bh.Costs(step={1: 1.0, 8: 1.0}, prefill_per_token=0.0)
    equal = [np.full(8, 5) for _ in range(4)]
    assert bh.static(equal, flat, 4).seconds == bh.compaction(equal, flat, 4).seconds == 20.0
    tail = [np.array([1, 1, 1, 1, 1, 1, 1, 9]), np.array([2, 2, 2, 2, 2, 2, 2, 2])]
    assert bh.static(tail, flat, 4).seconds == 9 + 2
    linear = bh.Costs(step={1: 1.0, 8: 8.0}, prefill_per_token=0.0)  # c(r) = r: cost = tokens
    assert bh.compaction(tail, linear, 4).seconds == sum(int(b.sum()) for b in tail)
    assert bh.continuous(tail, flat, 4).seconds == 9  # 8 slots: the 9-token row outlasts all others
    # two blocks at once, flat cost: both run beside the 9-token row (9 shared steps); one at a time
    # is compaction; with c(r) = r sharing changes nothing (cost = tokens either way)
    assert bh.blocks_at_once(tail, flat, 4).seconds == 9
    assert bh.blocks_at_once(tail, linear, 4, at_once=1).seconds == bh.compaction(tail, linear, 4).seconds
    linear16 = bh.Costs(step={1: 1.0, 16: 16.0}, prefill_per_token=0.0)  # c(r) = r up to both blocks' 16
    assert bh.blocks_at_once(tail, linear16, 4).seconds == sum(int(b.sum()) for b in tail)
    # three at once, flat cost: the first block's 9-token row holds its slot while the 2-token block
    # and then the third (1 token) decode beside it; two at once must wait for a freed slot
    three = [*tail, np.full(8, 1)]
    assert bh.blocks_at_once(three, flat, 4, at_once=3).seconds == 9
    assert bh.blocks_at_once(three, flat, 4, at_once=2).seconds == 9  # the third joins at step 3
    assert bh.blocks_at_once(three, flat, 4, at_once=3).name == "3 blocks at once"
    same = [np.full(8, 9)] * 3  # equal lengths: a third slot runs the third block beside the others
    assert bh.blocks_at_once(same, flat, 4, at_once=3).seconds == 9
    assert bh.blocks_at_once(same, flat, 4).seconds == 18
    # carry 8: call 1 holds its 8 rows undecoded; call 2 decodes 16 until at most 8 are unfinished
    # (2 steps: block 1's short rows, then block 2's); call 3 decodes 9 rows one step. The 9-token
    # row is still carried at the end: 23 rows emitted, block 1's 7 after spanning 2 calls.
    part = bh.partial([*tail, np.full(8, 1)], flat, 4, carry=8)
    assert (part.seconds, part.rows, part.tokens) == (3.0, 23, 40 - 9)
    assert part.calls_spanned_max == 2 and part.spanning_frac == 7 / 23


def test_inflight_summary_pairs_runs_by_seed_and_reads_the_idle_change_relative() -> None:
    """``inflight.py --summarize``: each non-off configuration against each off one over their
    shared seeds; the idle change is per-seed relative (-0.5 = halved), the lag token-weighted."""
    import inflight

    def row(S: int, variant: str, seed: int, idle: float, lags: dict[str, int], blocks: int = 1) -> dict:
        return {
            "max_lag": S, "variant": variant, "seed": seed, "blocks_at_once": blocks, "samples_per_s": 1.0,
            "idle": idle, "tok_lag": lags, "kl_all": 0.5, "eval_kl_reverse": 1.0 + seed,
            "eval_top1_agree": 0.5,
        }  # fmt: skip

    rows = [
        row(2, "off", 0, 0.4, {"0": 1, "1": 3}),
        row(2, "off", 1, 0.5, {"1": 2}),
        row(2, "continuous", 0, 0.2, {"2": 4}, blocks=2),
        row(2, "continuous", 1, 0.3, {"2": 4}, blocks=2),
        row(1, "continuous", 0, 0.1, {"0": 4}, blocks=2),  # one seed only: no pair with S=2 off
    ]
    assert inflight.mean_token_lag(rows[0]) == 0.75
    assert math.isnan(inflight.mean_token_lag({"tok_lag": {"2": 1, "3-4": 1}}))  # a range: not exact
    assert inflight.mean_token_lag({"tok_lag": {"3-4": 1}, "tok_lag_mean": 3.25}) == 3.25
    text = inflight.summarize(rows)
    head = "| S=2 continuous, 2 blocks at once | S=2 off"
    pair = [line for line in text.splitlines() if line.startswith(head)]
    assert len(pair) == 1 and "| 0,1 |" in pair[0]
    cuts = [0.2 / 0.4 - 1, 0.3 / 0.5 - 1]  # -0.5 and -0.4
    assert f"{sum(cuts) / 2:+.3f} [" in pair[0]  # the relative idle change, seed-paired
    assert f"{(2 - 0.75 + 2 - 1) / 2:+.3f} [" in pair[0]  # the mean token lag's change
    assert "S=1 continuous" not in text.split("| configuration |")[1]


def test_inflight_goal_verdicts_decide_only_what_the_intervals_decide() -> None:
    """Issue 42's goal off a pair's intervals: the wait is halved only if the relative change's
    whole interval lies below -0.5; agreement is worse / better only where an interval excludes 0."""
    import inflight

    from asyncrl.lab.stats import Interval

    def pair(idle: tuple, kl: tuple = (0.0, -0.1, 0.1), top1: tuple = (0.0, -0.1, 0.1)) -> dict:
        return {
            "idle change (relative)": Interval(*idle, n=5),
            "Δ held-out KL": Interval(*kl, n=5),
            "Δ held-out top-1": Interval(*top1, n=5),
        }

    assert inflight.goal_verdicts(pair((-0.6, -0.7, -0.55))) == ("yes", "no difference detected")
    assert inflight.goal_verdicts(pair((-0.45, -0.49, -0.41)))[0] == "no"  # S = 2, five seeds
    assert inflight.goal_verdicts(pair((-0.49, -0.73, -0.25)))[0] == "undecided"
    assert inflight.goal_verdicts(pair((-0.6, -0.7, -0.55), kl=(0.3, 0.1, 0.5)))[1] == "worse"
    assert inflight.goal_verdicts(pair((-0.6, -0.7, -0.55), top1=(-0.2, -0.3, -0.1)))[1] == "worse"
    assert inflight.goal_verdicts(pair((-0.6, -0.7, -0.55), top1=(0.1, 0.05, 0.2)))[1] == "better"
    # worse on one figure outweighs better on the other
    assert (
        inflight.goal_verdicts(pair((-0.6, -0.7, -0.55), kl=(0.3, 0.1, 0.5), top1=(0.1, 0.05, 0.2)))[1]
        == "worse"
    )
