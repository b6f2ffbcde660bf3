"""Sweep files: grid x variants x seeds expansion, cell names, and validation errors that name the
file, the cell and the field, all before anything runs. No Ray."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from asyncrl.lab.sweep import RUNS_DIR, SweepError, cell_key, load_sweep, value_label

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "examples" / "sweeps"
TINY = REPO / "examples" / "configs" / "opd_tiny.yaml"


def write_sweep(tmp_path: Path, body: dict, name: str = "study.yaml") -> Path:
    """A sweep file over the tiny OPD config (absolute base unless the body says otherwise)."""
    data = {"base": str(TINY), "output_dir": str(tmp_path / "out"), **body}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_grid_times_variants_times_seeds_in_file_order(tmp_path: Path) -> None:
    path = write_sweep(
        tmp_path,
        {
            "overrides": {"train.steps": 5},
            "grid": {"pipeline.max_lag": [0, 2], "train.lr": [1.0e-3, 3.0e-3]},
            "variants": {
                "mc_stale": {"estimator.name": "reverse_kl_mc", "estimator.options": {"advantage": "stale"}},
                "fkl": {"estimator.name": "forward_kl", "estimator.options": {"tail": "bucket"}},
            },
            "seeds": [0, 1, 2],
        },
    )
    sweep = load_sweep(path)
    assert len(sweep.cells) == 2 * 2 * 2 * 3
    assert sweep.swept == ("variant", "pipeline.max_lag", "train.lr")
    first, last = sweep.cells[0], sweep.cells[-1]
    assert first.key == "variant=mc_stale__pipeline.max_lag=0__train.lr=0.001__seed=0"
    assert last.key == "variant=fkl__pipeline.max_lag=2__train.lr=0.003__seed=2"
    assert [c.seed for c in sweep.cells[:3]] == [0, 1, 2]  # seeds vary fastest
    for cell in sweep.cells:
        cfg = cell.config
        assert cfg.train.steps == 5 and cfg.seed == cell.seed
        assert cfg.pipeline.max_lag == cell.settings["pipeline.max_lag"]
        assert cfg.train.lr == cell.settings["train.lr"]
        assert cfg.telemetry.progress is False  # the grid shows progress, not each cell
        assert Path(cfg.run_dir) == (tmp_path / "out").resolve() / RUNS_DIR / cell.key
    # a mapping value replaces the node: the forward-KL variant does not inherit MC options
    fkl = next(c for c in sweep.cells if c.settings["variant"] == "fkl")
    stale = next(c for c in sweep.cells if c.settings["variant"] == "mc_stale")
    assert fkl.config.estimator.options == {"tail": "bucket"}
    assert stale.config.estimator.options == {"advantage": "stale"}
    # defaults of aggregate: x = the first grid key, every other swept key groups
    assert sweep.x == "pipeline.max_lag" and sweep.group_by == ("variant", "train.lr")


def test_seeds_default_to_the_base_config_seed_and_base_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "base.yaml").write_text(TINY.read_text().replace("seed: 0", "seed: 7"))
    (tmp_path / "sweeps").mkdir()
    path = write_sweep(
        tmp_path / "sweeps", {"base": "../configs/base.yaml", "grid": {"pipeline.max_lag": [1]}}
    )
    sweep = load_sweep(path)
    assert [c.key for c in sweep.cells] == ["pipeline.max_lag=1__seed=7"]
    assert sweep.base == (tmp_path / "configs" / "base.yaml").resolve()
    assert sweep.name == "study"


def test_a_variant_overrides_a_fixed_value_and_the_command_line_cannot_touch_swept_keys(
    tmp_path: Path,
) -> None:
    body = {
        "overrides": {"sampling.mc_samples": 2},
        "variants": {"many": {"sampling.mc_samples": 8}, "few": {"train.lr": 0.01}},
    }
    sweep = load_sweep(write_sweep(tmp_path, body))
    assert [c.config.sampling.mc_samples for c in sweep.cells] == [8, 2]
    with pytest.raises(SweepError, match=r"command-line overrides: sampling.mc_samples: this key is swept"):
        load_sweep(write_sweep(tmp_path, body), ["sampling.mc_samples=4"])


def test_command_line_overrides_and_output_dir(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, {"grid": {"pipeline.max_lag": [0, 1]}})
    sweep = load_sweep(path, ["train.steps=2", "train.batch_size=8"], output_dir=tmp_path / "elsewhere")
    assert all(c.config.train.steps == 2 and c.config.train.batch_size == 8 for c in sweep.cells)
    assert sweep.output_dir == (tmp_path / "elsewhere").resolve()
    assert all(c.run_dir.parent == sweep.output_dir / RUNS_DIR for c in sweep.cells)


@pytest.mark.parametrize(
    ("value", "label"),
    [
        (4, "4"),
        (0.0003, "0.0003"),
        (1e-05, "1e-05"),
        (True, "true"),
        (None, "null"),
        (-1, "-1"),
        ("reverse_kl_mc", "reverse_kl_mc"),
        ("pkg.mod:Class", "pkg.mod-Class"),
        ({"tail": "bucket"}, "tail-bucket"),
        ([1, 2], "1,2"),
    ],
)
def test_value_labels(value: object, label: str) -> None:
    assert value_label(value) == label


def test_long_values_are_cut_and_stay_distinct() -> None:
    a, b = value_label({"x": "a" * 80}), value_label({"x": "a" * 79 + "b"})
    assert len(a) <= 48 and len(b) <= 48 and a != b


def test_cell_key_is_deterministic_and_human_readable() -> None:
    assert cell_key({"pipeline.max_lag": 4}, 1) == "pipeline.max_lag=4__seed=1"
    assert cell_key({}, 0) == "seed=0"
    assert cell_key({"variant": "a", "train.lr": 0.001}, 2) == "variant=a__train.lr=0.001__seed=2"


def test_examples_are_valid_sweeps() -> None:
    kl = load_sweep(SWEEPS / "kl_direction_x_lag.yaml")
    assert len(kl.cells) == 4 * 5 * 3 and kl.x == "pipeline.max_lag" and kl.group_by == ("variant",)
    names = {c.settings["variant"]: c.config for c in kl.cells}
    assert names["reverse_kl_mc_stale"].estimator.options["advantage"] == "stale"
    assert names["reverse_kl_mc_online"].estimator.options["advantage"] == "online"
    assert names["forward_kl_topk"].estimator.name == "forward_kl"
    assert all(c.config.pipeline.lag_mode == "fixed" for c in kl.cells)  # the x axis is the lag itself
    assert names["reverse_kl_topk"].estimator.name == "reverse_kl"
    lr = load_sweep(SWEEPS / "lr_x_lag.yaml")
    assert len(lr.cells) == 4 * 4 * 3 and {c.config.train.lr for c in lr.cells} == {3e-4, 1e-3, 3e-3, 1e-2}
    assert all(c.config.pipeline.lag_mode == "fixed" for c in lr.cells)
    cache = load_sweep(SWEEPS / "cache_finiteness.yaml")
    assert len(cache.cells) == 14 * 5  # 5 seeds (the round-2 rule)
    assert all(c.config.telemetry.grad_reference == "dense" for c in cache.cells)
    by_variant = {c.settings["variant"]: c.config for c in cache.cells}
    assert by_variant["reverse_mc_m16"].sampling.mc_samples == 16 and by_variant["forward_mc_m4"].cache.m == 4
    assert by_variant["reverse_topk_k64"].cache.k == 64
    grpo = load_sweep(SWEEPS / "async_grpo.yaml")
    assert len(grpo.cells) == 8 * 2 * 5 and all(c.config.algo == "rl" for c in grpo.cells)  # 5 seeds
    assert {c.settings["variant"]: c.config.controllers for c in grpo.cells}["none"] == ()
    tiny = load_sweep(SWEEPS / "tiny.yaml")
    assert [c.key for c in tiny.cells] == ["pipeline.max_lag=0__seed=0", "pipeline.max_lag=2__seed=0"]
    assert all(c.config.workload.preset == "tiny" and c.config.train.steps <= 3 for c in tiny.cells)
    real = load_sweep(SWEEPS / "real_pair.yaml")  # experiment 10: the real pair, 3 seeds
    assert len(real.cells) == 2 * 3 * 3 and all(c.config.workload.preset == "smollm2" for c in real.cells)
    assert all(c.config.pipeline.lag_mode == "fixed" for c in real.cells)
    by_variant = {c.settings["variant"]: c.config for c in real.cells}
    assert by_variant["forward_kl"].estimator.name == "forward_kl"
    assert by_variant["rkl_online"].estimator.options["advantage"] == "online"
    healed = load_sweep(SWEEPS / "real_pair_healed.yaml")  # experiment 11: the same cells, healed student
    assert [c.key for c in healed.cells] == [c.key for c in real.cells]
    assert all(c.config.workload.preset == "smollm2-healed" for c in healed.cells)
    for a, b in zip(real.cells, healed.cells):  # only the preset (and where it writes) differs
        assert dataclasses.replace(a.config, workload=b.config.workload, run_dir=b.config.run_dir) == b.config
    assert set(SWEEPS.glob("*.yaml")) == {
        SWEEPS / f
        for f in (
            "accuracy_vs_wall_time.yaml",
            "async_grpo.yaml",
            "cache_finiteness.yaml",
            "cache_finiteness_frozen.yaml",
            "kl_direction_x_lag.yaml",
            "lr_x_lag.yaml",
            "real_pair.yaml",
            "real_pair_healed.yaml",
            "recompute_vs_stabilisers.yaml",
            "s_eta_grpo.yaml",
            "s_eta_opd.yaml",
            "tiny.yaml",
        )
    }


# --- validation: every message names the sweep file, and the cell / field ----------------------------
@pytest.mark.parametrize(
    ("body", "where", "says"),
    [
        ({"grid": {"pipeline.max_lag": 2}}, "grid.pipeline.max_lag", "non-empty list"),
        ({"grid": {"pipeline.max_lag": []}}, "grid.pipeline.max_lag", "non-empty list"),
        ({"grid": {"pipeline.max_lag": [1, 1]}}, "grid.pipeline.max_lag", "once"),
        ({"grid": {"seed": [0, 1]}}, "grid", "seeds:"),
        ({"overrides": {"run_dir": "x"}}, "overrides", "output_dir"),
        ({"grid": {"pipeline..max_lag": [1]}}, "grid", "not a dotted config key"),
        (
            {"grid": {"train.lr": [0.1]}, "variants": {"a": {"train.lr": 0.2}}},
            "grid.train.lr",
            "also set by a variant",
        ),
        ({"grid": {"train.lr": [0.1]}, "overrides": {"train.lr": 0.2}}, "overrides: train.lr", "swept"),
        ({"variants": {"bad name": {"train.lr": 0.1}}}, "variants.bad name", "letters, digits"),
        ({"variants": {"a": [1]}}, "variants.a", "mapping"),
        ({"seeds": []}, "field 'seeds'", "at least one"),
        ({"seeds": [1, 1]}, "field 'seeds'", "once"),
        ({"grid": {"train.lr": [0.1]}, "aggregate": {"x": "train.steps"}}, "aggregate.x", "swept key"),
        (
            {
                "grid": {"train.lr": [0.1], "pipeline.max_lag": [0]},
                "aggregate": {"x": "train.lr", "group_by": []},
            },
            "aggregate.group_by",
            "pipeline.max_lag",
        ),
        ({"aggregate": {"y": ["final:"]}}, "aggregate.y[0]", "final:<metric>"),
        (
            {"aggregate": {"y": ["eval_acuracy_final"]}},
            "aggregate.y[0]",
            "did you mean 'eval_accuracy_final'",
        ),
        ({"gird": {"train.lr": [0.1]}}, "", "did you mean 'grid'"),
    ],
)
def test_bad_sweep_fields_name_the_file_and_field(tmp_path: Path, body: dict, where: str, says: str) -> None:
    path = write_sweep(tmp_path, body)
    with pytest.raises(SweepError) as info:
        load_sweep(path)
    message = str(info.value)
    assert message.startswith(f"sweep {path}")
    assert where in message and says in message


def test_bad_cell_config_names_the_cell_and_the_field(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, {"grid": {"pipeline.max_lag": [0, -1]}, "seeds": [3]})
    with pytest.raises(
        SweepError,
        match=re.escape(f"sweep {path}, cell pipeline.max_lag=-1__seed=3: config field 'pipeline.max_lag'"),
    ):
        load_sweep(path)
    path = write_sweep(tmp_path, {"variants": {"a": {"pipeline.max_lagg": 1}}})
    with pytest.raises(
        SweepError, match=r"variant=a__seed=<base seed>: config field 'pipeline.max_lagg'.*did you mean"
    ):
        load_sweep(path)


def test_pipeline_build_checks_run_for_every_cell(tmp_path: Path) -> None:
    """The last cell is broken (MC estimator without MC samples): refused before anything runs."""
    path = write_sweep(tmp_path, {"grid": {"sampling.mc_samples": [4, 0]}})
    with pytest.raises(SweepError, match=r"cell sampling.mc_samples=0__seed=0: .*needs behavior MC samples"):
        load_sweep(path)


def test_missing_or_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="does not exist"):
        load_sweep(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(SweepError, match="top level must be a mapping"):
        load_sweep(tmp_path / "list.yaml")
    (tmp_path / "nobase.yaml").write_text("grid: {train.lr: [0.1]}\n")
    with pytest.raises(SweepError, match=r"nobase.yaml, field 'base': missing"):
        load_sweep(tmp_path / "nobase.yaml")
    path = write_sweep(tmp_path, {"base": "missing.yaml"})
    with pytest.raises(SweepError, match=r"field 'base': .*missing.yaml does not exist"):
        load_sweep(path)
    with pytest.raises(SweepError, match="command-line overrides"):
        load_sweep(write_sweep(tmp_path, {}), ["train.steps"])


def test_values_with_the_same_directory_name_are_refused(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, {"grid": {"workload.task": ["a/b", "a:b"]}})
    with pytest.raises(SweepError, match=r"grid.workload.task: .*each value must appear once.*\(a-b, a-b\)"):
        load_sweep(path)


def test_every_sweep_field_is_documented() -> None:
    import dataclasses

    from asyncrl.lab.sweep import AggregateSpec, SweepSpec

    doc = (REPO / "docs" / "sweeps.md").read_text()
    for f in dataclasses.fields(SweepSpec):
        if f.name != "aggregate":  # documented field by field below
            assert f"| `{f.name}` |" in doc, f.name
    for f in dataclasses.fields(AggregateSpec):
        assert f"| `aggregate.{f.name}` |" in doc, f.name
