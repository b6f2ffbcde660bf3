"""scripts/gen_experiments.py decides EXPERIMENTS.md's verdicts: its rules are checked on synthetic sweeps
whose outcome is known (each claim made to hold, made to fail, and left untestable)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_experiments", REPO / "scripts" / "gen_experiments.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_experiments"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


Metrics = Callable[[dict[str, Any], int], list[dict[str, Any]]]


def write_sweep(
    root: Path,
    name: str,
    cells: list[dict[str, Any]],
    final: Callable[[dict[str, Any], int], float],
    metrics: Metrics,
    *,
    algo: str = "opd",
) -> None:
    """A sweep directory as ``asyncrl sweep`` writes it: ``sweep.json`` plus one run directory per cell
    with ``summary.json`` and ``metrics.jsonl``."""
    out = root / name
    doc = {"name": name, "cells": []}
    for settings in cells:
        for seed in (0, 1, 2):
            key = "__".join(f"{k}={v}" for k, v in settings.items()) + f"__seed={seed}"
            run = out / "runs" / key
            run.mkdir(parents=True)
            summary = {
                "status": "completed",
                "algo": algo,
                "eval_accuracy_initial": 0.25,
                "eval_accuracy_final": final(settings, seed),
                "teacher_accuracy": 0.95,
                "wall_time_s": 30.0,
            }
            (run / "summary.json").write_text(json.dumps(summary))
            rows = metrics(settings, seed)
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            doc["cells"].append({"key": key, "settings": settings, "seed": seed, "run_dir": str(run)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(doc))


def jitter(seed: int) -> float:
    return 0.004 * (seed - 1)


KL_VARIANTS = ("forward_kl_topk", "reverse_kl_mc_stale", "reverse_kl_mc_online", "reverse_kl_topk")


def kl_sweep(root: Path, gain: Callable[[str, int], float]) -> None:
    cells = [{"variant": v, "pipeline.max_lag": s} for v in KL_VARIANTS for s in (0, 8)]

    def metrics(settings: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        return [{"step": i, "kl/teacher_reverse": 0.5, "gradref/cos": 0.9} for i in range(1, 21)]

    write_sweep(
        root,
        "kl_direction_x_lag",
        cells,
        lambda st, seed: 0.25 + gain(st["variant"], st["pipeline.max_lag"]) + jitter(seed),
        metrics,
    )


def kl_verdict(gen: Any, root: Path) -> Any:
    return gen.kl_direction(gen.load_sweep(root, "kl_direction_x_lag"), root / "plots")


def test_kl_direction_reproduced_when_only_stale_reverse_kl_degrades(gen: Any, tmp_path: Path) -> None:
    kl_sweep(tmp_path, lambda v, s: 0.05 if (v == "reverse_kl_mc_stale" and s == 8) else 0.2)
    section = kl_verdict(gen, tmp_path)
    assert section.verdict == gen.REPRODUCED, section.why
    assert (tmp_path / "plots" / "kl_direction_x_lag.png").exists()


def test_kl_direction_not_reproduced_when_forward_kl_degrades(gen: Any, tmp_path: Path) -> None:
    kl_sweep(tmp_path, lambda v, s: 0.05 if (v != "reverse_kl_mc_online" and s == 8) else 0.2)
    section = kl_verdict(gen, tmp_path)
    assert section.verdict == gen.NOT_REPRODUCED
    assert "forward KL at S=8 not below S=0: fails" in section.why


def test_kl_direction_inconclusive_when_reverse_kl_does_not_learn_on_policy(gen: Any, tmp_path: Path) -> None:
    kl_sweep(tmp_path, lambda v, s: 0.2 if v.startswith("forward") else 0.0)
    section = kl_verdict(gen, tmp_path)
    assert section.verdict == gen.INCONCLUSIVE
    assert "precondition" in section.why and "untestable" in section.why


def lr_sweep(
    root: Path, diverges: Callable[[float, int], bool], drift: Callable[[float, int], float]
) -> None:
    cells = [{"train.lr": lr, "pipeline.max_lag": s} for lr in (0.001, 0.01) for s in (0, 2, 4)]

    def metrics(settings: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        lr, s = settings["train.lr"], settings["pipeline.max_lag"]
        loss = np.linspace(1.0, 0.5, 60)
        if diverges(lr, s):
            loss = np.concatenate([loss[:20], np.linspace(0.9, 3.0, 40)])
        return [
            {"step": i + 1, "loss": float(x), "kl/behavior_current": drift(lr, s)} for i, x in enumerate(loss)
        ]

    write_sweep(root, "lr_x_lag", cells, lambda st, seed: 0.4 + jitter(seed), metrics)


def test_lr_x_lag_reproduced_when_stable_lr_falls_and_drift_scales_as_s_eta(gen: Any, tmp_path: Path) -> None:
    lr_sweep(tmp_path, lambda lr, s: lr == 0.01 and s >= 2, lambda lr, s: (s * lr) ** 2)
    section = gen.lr_x_lag(gen.load_sweep(tmp_path, "lr_x_lag"), tmp_path / "plots")
    assert section.verdict == gen.REPRODUCED, section.why
    assert "S=0: 0.01, S=2: 0.001, S=4: 0.001" in "\n".join(section.body)
    assert "initial 0.250" in "\n".join(section.body)


def test_lr_x_lag_not_reproduced_when_drift_depends_on_eta_alone(gen: Any, tmp_path: Path) -> None:
    lr_sweep(tmp_path, lambda lr, s: lr == 0.01 and s >= 2, lambda lr, s: lr**2)
    section = gen.lr_x_lag(gen.load_sweep(tmp_path, "lr_x_lag"), tmp_path / "plots")
    assert section.verdict == gen.NOT_REPRODUCED


def test_lr_x_lag_untestable_without_divergence(gen: Any, tmp_path: Path) -> None:
    lr_sweep(tmp_path, lambda lr, s: False, lambda lr, s: (s * lr) ** 2)
    section = gen.lr_x_lag(gen.load_sweep(tmp_path, "lr_x_lag"), tmp_path / "plots")
    assert "needs divergence inside the LR grid): untestable" in section.why
    assert section.verdict == gen.INCONCLUSIVE


def test_cache_finiteness_reads_bias_and_the_one_over_m_slope(gen: Any, tmp_path: Path) -> None:
    cells = [{"variant": f"forward_topk_k{k}"} for k in (1, 16)]
    cells += [{"variant": f"reverse_mc_m{m}"} for m in (1, 4)]

    def metrics(settings: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        v = settings["variant"]
        n = int(v.rsplit("k" if "topk" in v else "m", 1)[1])
        bias = (0.5 / n + jitter(seed)) if "topk" in v else 0.001 * (seed - 1)
        noise = 0.01 if "topk" in v else 0.8 / n
        return [
            {"step": 10 * i, "gradref/bias_sq_rel": bias, "gradref/noise_rel": noise} for i in range(1, 6)
        ]

    write_sweep(tmp_path, "cache_finiteness", cells, lambda st, seed: 0.4, metrics)
    section = gen.cache_finiteness(gen.load_sweep(tmp_path, "cache_finiteness"), tmp_path / "plots")
    assert "forward KL, top-k: biased at k=1, less at k=16: holds" in section.why
    assert "reverse KL, m behavior draws: unbiased: holds" in section.why
    assert "noise ~ m^-1.00" in section.why
    assert "reverse KL, top-k biased: untestable" in section.why  # a family the sweep did not run
    assert section.verdict == gen.INCONCLUSIVE


def test_document_takes_model_accuracies_from_the_runs(gen: Any, tmp_path: Path) -> None:
    kl_sweep(tmp_path, lambda v, s: 0.2)
    out = tmp_path / "EXPERIMENTS.md"
    assert gen.main(["--sweeps-root", str(tmp_path), "--out", str(out), "--plots", str(tmp_path / "p")]) == 0
    text = out.read_text()
    assert "student exact match 0.250, teacher 0.950" in text
    assert text.count("not run yet (no finished cells)") == 3  # the three sweeps that have no directory


GRPO_VARIANTS = ("none", "truncated_is", "ess_lr", "gradient_alignment", "staleness_lr_law")


def test_async_grpo_collapse_preceded_by_ess_drop_and_controllers_stabilise(gen: Any, tmp_path: Path) -> None:
    cells = [{"variant": v, "pipeline.max_lag": s} for v in GRPO_VARIANTS for s in (0, 8)]

    def metrics(settings: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        v, s = settings["variant"], settings["pipeline.max_lag"]
        collapses = s == 8 and v in ("none", "truncated_is")
        rows = []
        for step in range(1, 61):
            reward = 0.3 + 0.001 * step + jitter(seed)
            ess = 0.9
            if collapses and step >= 30:
                ess = 0.3  # the ESS falls first ...
            if collapses and step >= 40:
                reward = 0.02  # ... then the reward collapses
            cos = 0.1 + 0.1 * (s > 0)
            rows.append({"step": step, "est/reward_mean": reward, "ess/rho_seq": ess, "grad/cos_prev": cos})
        return rows

    write_sweep(tmp_path, "async_grpo", cells, lambda st, seed: 0.4, metrics, algo="grpo")
    section = gen.async_grpo(gen.load_sweep(tmp_path, "async_grpo"), tmp_path / "plots")
    assert section.verdict == gen.REPRODUCED, section.why
    assert "ESS drops precede collapses: holds" in section.why
    assert "ess_lr at S=8 above none at S=8, no collapse: holds" in section.why


def test_a_failed_cell_is_not_a_result(gen: Any, tmp_path: Path) -> None:
    kl_sweep(tmp_path, lambda v, s: 0.2)
    run = tmp_path / "kl_direction_x_lag" / "runs" / "variant=forward_kl_topk__pipeline.max_lag=0__seed=1"
    (run / "summary.json").write_text(json.dumps({"status": "failed", "error": "SystemExit: 1"}))
    sweep = gen.load_sweep(tmp_path, "kl_direction_x_lag")
    assert len(sweep.runs) == 23 and sweep.pending == 1
    assert "23 cells, 1 not finished" in gen.kl_direction(sweep, tmp_path / "plots").cells


def test_the_summary_says_how_many_rule_parts_hold(gen: Any, tmp_path: Path) -> None:
    kl_sweep(tmp_path, lambda v, s: 0.05 if (v == "reverse_kl_mc_stale" and s == 8) else 0.2)
    out = tmp_path / "EXPERIMENTS.md"
    gen.main(["--sweeps-root", str(tmp_path), "--out", str(out), "--plots", str(tmp_path / "p")])
    assert "| **reproduced** | 3 of 3 parts hold |" in out.read_text()
    kl_sweep(tmp_path / "b", lambda v, s: 0.05 if (v != "reverse_kl_mc_online" and s == 8) else 0.2)
    section = kl_verdict(gen, tmp_path / "b")
    assert section.tally == "2 of 3 parts hold"
