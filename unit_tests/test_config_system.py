"""The config system: unknown keys, bad values, key=value overrides, round trips, `asyncrl validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.cli import main
from asyncrl.config import RunConfig, apply_overrides, load_config, save_config
from asyncrl.configurable import ConfigError, from_dict, to_dict

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "configs" / "opd_tiny.yaml"


def _error(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    return info.value


# --- unknown keys ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "field", "nearest"),
    [
        ({"trian": {}}, "trian", "train"),
        ({"train": {"stpes": 3}}, "train.stpes", "steps"),
        ({"pipeline": {"max_lagg": 1}}, "pipeline.max_lagg", "max_lag"),
        ({"workload": {"presets": "tiny"}}, "workload.presets", "preset"),
        ({"telemetry": {"tensorbord": False}}, "telemetry.tensorbord", "tensorboard"),
    ],
)
def test_unknown_keys_fail_with_the_nearest_valid_key(data: dict, field: str, nearest: str) -> None:
    err = _error(data)
    assert err.field == field
    assert f"did you mean {nearest!r}" in str(err)


# --- bad values -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "field", "value", "fix"),
    [
        ({"train": {"steps": 0}}, "train.steps", 0, ">= 1"),
        ({"train": {"lr": -1}}, "train.lr", -1.0, "positive"),
        ({"train": {"batch_size": 30, "group_size": 4}}, "train.batch_size", 30, "multiple of group_size=4"),
        ({"pipeline": {"max_lag": -1}}, "pipeline.max_lag", -1, "0 (synchronous)"),
        ({"pipeline": {"zero_stage": 3}}, "pipeline.zero_stage", 3, "use 1 or 2"),
        ({"algo": "grpo"}, "algo", "grpo", "unknown key"),
        ({"train": {"steps": 10, "minibatches": 4}}, "train.steps", 10, "multiple of minibatches=4"),
        ({"pipeline": {"lag_mode": "exact"}}, "pipeline.lag_mode", "exact", "['bound', 'fixed']"),
        ({"train": {"steps": "many"}}, "train.steps", "many", "expected an integer"),
        ({"telemetry": {"progress": "maybe"}}, "telemetry.progress", "maybe", "true or false"),
        ({"sampling": {"temperature": -0.5}}, "sampling.temperature", -0.5, "0 (greedy)"),
    ],
)
def test_bad_values_name_field_value_and_fix(data: dict, field: str, value: object, fix: str) -> None:
    err = _error(data)
    assert (err.field, err.value) == (field, value)
    assert fix in err.fix
    assert str(err).startswith(f"config field {field!r}: got {value!r};")


def test_bad_component_names_fail_at_load_time() -> None:
    with pytest.raises(ConfigError, match=r"'estimator.name'.*did you mean 'reverse_kl_mc'"):
        load_config(TINY, ["estimator.name=reverse_kl_mx"])
    with pytest.raises(ConfigError, match=r"'workload.task'.*did you mean 'addition'"):
        load_config(TINY, ["workload.task=additon"])
    with pytest.raises(ConfigError, match=r"'estimator.options.tial'.*did you mean 'tail'"):
        load_config(TINY, ["estimator.name=forward_kl", "estimator.options.tial=drop"])
    with pytest.raises(ConfigError, match=r"controllers\[0\]"):
        load_config(TINY, ["controllers=[{name: ess_lrr}]"])


# --- overrides ------------------------------------------------------------------------------------
def test_overrides_are_nested_and_yaml_typed() -> None:
    data = apply_overrides(
        {"train": {"steps": 5, "lr": 0.1}, "seed": 1},
        [
            "train.lr=3e-4",
            "pipeline.ray_address=null",
            "telemetry.progress=false",
            "workload.task='123'",
            "controllers=[{name: ess_lr, options: {rho_base: 0.5}}]",
            "estimator.options.tail=drop",
            "seed=7",
            "seed=8",  # later overrides win
        ],
    )
    assert data["train"] == {"steps": 5, "lr": "3e-4"}  # siblings kept; YAML 1.1 reads 3e-4 as text...
    assert (
        from_dict(RunConfig, {"train": data["train"]}).train.lr == 3e-4
    )  # ...and the float field coerces it
    assert data["pipeline"] == {"ray_address": None}
    assert data["telemetry"]["progress"] is False
    assert data["workload"]["task"] == "123"
    assert data["controllers"] == [{"name": "ess_lr", "options": {"rho_base": 0.5}}]
    assert data["estimator"] == {"options": {"tail": "drop"}}
    assert data["seed"] == 8


def test_overrides_do_not_mutate_the_input_and_reject_missing_equals() -> None:
    base = {"train": {"steps": 5}}
    apply_overrides(base, ["train.steps=6"])
    assert base == {"train": {"steps": 5}}
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        apply_overrides(base, ["train.steps"])


def test_load_config_applies_overrides_over_the_file() -> None:
    cfg = load_config(TINY, ["train.steps=3", "pipeline.max_lag=0", "estimator.options.form=value"])
    assert (cfg.train.steps, cfg.pipeline.max_lag) == (3, 0)
    assert cfg.estimator.options == {"form": "value"}
    assert cfg.workload.preset == "tiny"  # from the file


# --- round trip -----------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        TINY,
        [
            "controllers=[{name: ess_lr, options: {rho_base: 0.5}}, {name: gradient_alignment}]",
            "train.lr=2.5e-4",
        ],
    )
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    text = (tmp_path / "config.yaml").read_text()
    assert "!!python" not in text and yaml.safe_load(text) == to_dict(cfg)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.integers(1, 10_000),
    group=st.sampled_from([1, 2, 4, 8]),
    groups=st.integers(1, 16),
    lr=st.floats(1e-7, 1.0, allow_nan=False),
    max_lag=st.integers(0, 64),
    progress=st.booleans(),
    address=st.one_of(st.none(), st.just("auto"), st.just("10.0.0.1:6379")),
)
def test_round_trip_through_yaml_text(steps, group, groups, lr, max_lag, progress, address) -> None:
    """Property: to_dict -> YAML text -> from_dict is the identity on valid configs."""
    cfg = from_dict(
        RunConfig,
        {
            "train": {"steps": steps, "group_size": group, "batch_size": group * groups, "lr": lr},
            "pipeline": {"max_lag": max_lag, "ray_address": address},
            "telemetry": {"progress": progress},
            "controllers": [{"name": "truncated_is", "options": {"upper": 2.0}}],
        },
    )
    assert from_dict(RunConfig, yaml.safe_load(yaml.safe_dump(to_dict(cfg)))) == cfg


# --- asyncrl validate -----------------------------------------------------------------------------
def test_validate_prints_the_resolved_config_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(TINY), "train.steps=3"]) == 0
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed["train"]["steps"] == 3 and printed["workload"]["preset"] == "tiny"
    assert printed == to_dict(load_config(TINY, ["train.steps=3"]))
    assert "valid" in err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["train.stpes=3"], ["'train.stpes'", "did you mean 'steps'"]),
        (["pipeline.max_lag=-2"], ["'pipeline.max_lag'", "-2", "0 (synchronous)"]),
        (["sampling.mc_samples=0"], ["reverse_kl_mc", "sampling.mc_samples"]),  # pairing checked too
        (["estimator.name=grpo"], ["grpo", "train.group_size >= 2"]),
        (["algo=grpo"], ["algo", "derived from the estimator"]),
        (
            ["controllers=[{name: bounded_staleness, options: {max_lag: 5}}]"],
            ["pipeline.max_lag", "remove it"],
        ),
    ],
)
def test_validate_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv, needles) -> None:
    assert main(["validate", str(TINY), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl: error: ")
    for needle in needles:
        assert needle in lines[0]


def test_validate_missing_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    assert main(["validate", str(bad)]) == 2
    assert "top level must be a mapping" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("task", "budget"), [("addition", 4), ("running_sum", 33), ("running_sum_long", 129)]
)
def test_max_new_tokens_auto_is_sized_from_the_task(tmp_path: Path, task: str, budget: int) -> None:
    """The default (auto) becomes the longest answer in tokens + EOS; a number given is kept."""
    from asyncrl.config import resolve_auto

    base = [f"workload.task={task}", "workload.preset=tiny", f"workload.cache_dir={tmp_path}"]
    cfg = load_config(None, base)
    assert cfg.sampling.max_new_tokens == budget and resolve_auto(cfg) is cfg
    assert load_config(None, [*base, "sampling.max_new_tokens=7"]).sampling.max_new_tokens == 7
    assert RunConfig().sampling.max_new_tokens == "auto"
    assert resolve_auto(RunConfig(workload=cfg.workload)).sampling.max_new_tokens == budget
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(None, [*base, "sampling.max_new_tokens=0"])


def test_max_new_tokens_auto_uses_the_student_tokenizer(tmp_path: Path) -> None:
    """A student on disk decides how answers tokenize; one without a tokenizer fails naming the fix."""
    from asyncrl.workloads.tokenizer import qwen_tokenizer

    qwen_tokenizer().save_pretrained(tmp_path / "student")
    cfg = load_config(None, ["workload.task=running_sum", f"workload.student_path={tmp_path / 'student'}"])
    assert cfg.sampling.max_new_tokens == 33
    with pytest.raises(ConfigError, match=r"student_path.*sampling\.max_new_tokens"):
        load_config(None, [f"workload.student_path={tmp_path / 'missing'}"])


def test_engines_refuse_an_unresolved_max_new_tokens() -> None:
    import torch

    from asyncrl.engines.base import SamplingParams, check_prompts

    ids, mask = torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"max_new_tokens='auto'.*pass max_new_tokens=N"):
        check_prompts(ids, mask, SamplingParams(), 10, ("ctx", None))
