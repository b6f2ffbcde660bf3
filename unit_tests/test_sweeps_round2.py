"""The round-2 sweep files (issue 44, item 4) load, and hold what their pre-registered rules read."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from asyncrl.lab.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "examples" / "sweeps"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_experiments", REPO / "scripts" / "gen_experiments.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_experiments"] = module
    spec.loader.exec_module(module)
    return module


def test_recompute_vs_stabilisers_pairs_every_stabiliser_with_the_stale_signal(gen) -> None:
    sweep = load_sweep(SWEEPS / "recompute_vs_stabilisers.yaml")
    assert len(sweep.cells) == 9 * 4 * 5 and sorted({c.seed for c in sweep.cells}) == list(range(gen.SEEDS))
    by = {c.settings["variant"]: c.config for c in sweep.cells}
    assert set(by) == set(gen.RECOMPUTE_VARIANTS)  # the rules read exactly these variants
    assert by["stale_tis"].estimator.options["anchor"] == "proximal"
    assert by["stale_tis"].controllers[0].name == "truncated_is"
    for tau in ("0.1", "0.3", "0.5"):
        gac = by[f"stale_gac_t{tau}"].controllers[0]
        assert gac.name == "gradient_alignment" and gac.options["apply_to"] == "update"
        assert gac.options["tau"] == float(tau) and gac.options["min_lag"] == 0  # acts at S = 0: tuned there
    assert by["online"].estimator.options["advantage"] == "online"
    assert {c.settings["pipeline.max_lag"] for c in sweep.cells} == {0, 2, 4, 8}


def test_s_eta_grids_hold_matched_products(gen) -> None:
    for name, n in (("s_eta_opd", 2 * 3 * 4 * 5), ("s_eta_grpo", 3 * 4 * 5)):
        sweep = load_sweep(SWEEPS / f"{name}.yaml")
        assert len(sweep.cells) == n
        points = {(c.config.train.lr, c.config.pipeline.max_lag) for c in sweep.cells}
        products: dict[float, int] = {}
        for lr, s in points:
            if s:
                products[round(lr * s, 12)] = products.get(round(lr * s, 12), 0) + 1
        assert sum(k >= 2 for k in products.values()) >= 3  # at least three matched-S·η groups
    opd = {c.settings["variant"]: c.config for c in load_sweep(SWEEPS / "s_eta_opd.yaml").cells}
    assert opd["rkl_mc_stale"].estimator.options["advantage"] == "stale"
    assert opd["forward_kl"].estimator.name == "forward_kl"  # the negative control
    assert opd["rkl_mc_stale"].telemetry.grad_reference == "dense"


def test_wall_time_and_frozen_sweeps(gen) -> None:
    wall = load_sweep(SWEEPS / "accuracy_vs_wall_time.yaml")
    assert len(wall.cells) == 2 * 2 * 5
    assert all(c.config.pipeline.lag_mode == "bound" for c in wall.cells)  # real async, not a fixed lag
    frozen = load_sweep(SWEEPS / "cache_finiteness_frozen.yaml")
    assert len(frozen.cells) == 5 and all(c.config.train.checkpoint_every == 50 for c in frozen.cells)
    assert {name for name, _ in gen.EXPERIMENTS} >= {
        "recompute_vs_stabilisers",
        "s_eta_opd",
        "s_eta_grpo",
        "accuracy_vs_wall_time",
    }
