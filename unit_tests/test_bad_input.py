"""Bad input, fuzzed: configs, prompt files and checkpoints each fail with one line that names the
field or the file and the fix, and ``asyncrl validate`` catches them before any Ray process
starts (it runs ``asyncrl.plan.make_plan``, what ``asyncrl run`` runs beside ``ray.init``, before
any stage or learner process starts)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.cli import main
from asyncrl.config import RunConfig, load_config
from asyncrl.configurable import ConfigError, field_docs
from asyncrl.telemetry.summary import failed_summary

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "configs" / "opd_tiny.yaml"
FIELDS = {name: tname for name, tname, _, _ in field_docs(RunConfig)}
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

torch.set_num_threads(1)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl: error: "), err
    return lines[0]


def validate(capsys: pytest.CaptureFixture[str], *overrides: str, config: Path = TINY) -> str:
    assert main(["validate", "--quiet", str(config), *overrides]) == 2
    return one_error_line(capsys)


# --- a tiny pretrained pair on disk (no training: what validate checks is the files) ---------------------
def save_model(path: Path, *, max_positions: int = 32, seed: int = 0, extra_token: str | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.workloads.checkpoints import save_checkpoint
    from asyncrl.workloads.tokenizer import char_tokenizer

    tok = char_tokenizer()
    if extra_token:
        tok.add_tokens([extra_token])
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    return save_checkpoint(LlamaForCausalLM(config), tok, path, {"accuracy": 0.5})


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    save_model(root / "addition-tiny-s0" / "teacher", seed=0)
    save_model(root / "addition-tiny-s0" / "student", seed=1)
    return root


@pytest.fixture
def pair(cache: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the pair, for tests that break it."""
    t, s = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(cache / "addition-tiny-s0" / "teacher", t)
    shutil.copytree(cache / "addition-tiny-s0" / "student", s)
    return t, s


def paths(pair: tuple[Path, Path]) -> list[str]:
    return [f"workload.teacher_path={pair[0]}", f"workload.student_path={pair[1]}"]


def test_a_good_config_with_its_models_validates(cache: Path, tmp_path: Path, capsys) -> None:
    assert main(["validate", "--quiet", str(TINY), f"workload.cache_dir={cache}", f"run_dir={tmp_path}"]) == 0
    assert "ok:" in capsys.readouterr().err


def test_models_not_pretrained_yet_are_a_note_not_an_error(tmp_path: Path, capsys) -> None:
    assert main(["validate", "--quiet", str(TINY), f"workload.cache_dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "asyncrl pretrain --task addition --preset tiny" in err and "ok:" in err


# --- configs ----------------------------------------------------------------------------------------------
identifiers = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)


@SETTINGS
@given(
    section=st.sampled_from(["", "train.", "pipeline.", "workload.", "sampling.", "faults."]), key=identifiers
)
def test_unknown_keys_name_the_key(section: str, key: str) -> None:
    dotted = f"{section}{key}"
    if dotted in FIELDS or (not section and key in {f.name for f in dataclasses.fields(RunConfig)}):
        return
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{dotted}=1"])
    assert dotted in str(info.value) and "\n" not in str(info.value)


def test_switching_estimator_on_the_command_line_says_to_reset_its_options() -> None:
    """The demo config's ``estimator.options.tail`` is forward_kl's: ``estimator.name=forward_kl_mc``
    alone keeps it, and the error says whose options they are and how to reset them."""
    demo = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_async.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(demo, ["estimator.name=forward_kl_mc"])
    text = str(info.value)
    assert info.value.field == "estimator.options.tail" and "\n" not in text
    assert "estimator 'forward_kl_mc'" in text and "estimator.options={}" in text, text
    cfg = load_config(demo, ["estimator.name=forward_kl_mc", "estimator.options={}"])  # the fix works
    assert cfg.estimator.name == "forward_kl_mc" and dict(cfg.estimator.options) == {}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            ["estimator.options={}", "estimator.name=reverse_kl_mc", "sampling.mc_samples=0"],
            "sampling.mc_samples",
        ),
        (["estimator.options={}", "estimator.name=grpo", "train.group_size=1"], "train.group_size"),
        (
            ["estimator.options={}", "estimator.name=grpo", "train.group_size=4", "cache.kind=topk"],
            "cache.kind",
        ),
    ],
)
def test_the_plans_config_checks_name_their_field(cache: Path, overrides: list[str], field: str) -> None:
    """The plan's checks of config values raise ``ConfigError`` (``asyncrl run`` exits 2 on it, as
    ``validate`` does), naming the field to change."""
    from asyncrl.config import parse_config, resolve_components
    from asyncrl.plan import check_components

    cfg = resolve_components(parse_config(TINY, [f"workload.cache_dir={cache}", *overrides]))
    with pytest.raises(ConfigError) as info:
        check_components(cfg, str(cache / "addition-tiny-s0" / "student"))
    assert info.value.field == field and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["sampling.temperature=0"], "sampling.temperature"),
        (["train.batch_size=6", "pipeline.learner_workers=4"], "train.batch_size"),
        (["train.batch_size=8", "train.minibatches=3", "train.steps=9"], "train.minibatches"),
        (["train.group_size=8", "pipeline.learner_workers=4"], "train.minibatches"),
    ],
)
def test_checks_across_sections_fail_at_load(overrides: list[str], field: str) -> None:
    """Checks that need no component fail in ``parse_config`` (``asyncrl run`` parses before Ray's
    start, so these cost no Ray start and stop), naming the field to change."""
    from asyncrl.config import parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(TINY, overrides)
    assert info.value.field == field and "\n" not in str(info.value), str(info.value)


def test_a_config_error_found_at_load_stops_asyncrl_run_before_ray(monkeypatch, capsys) -> None:
    """``asyncrl run`` with a cross-section error exits 2 without starting Ray."""
    import asyncrl.pipeline

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a config that fails at load")

    monkeypatch.setattr(asyncrl.pipeline, "init_ray", no_ray)
    assert main(["run", str(TINY), "sampling.temperature=0"]) == 2
    assert "sampling.temperature" in capsys.readouterr().err


wrong_values = st.sampled_from(["abc", "[1, 2]", "{a: 1}", "-7", "1.5", "true", "null", "''", "1e99", "-0.5"])


@SETTINGS
@given(key=st.sampled_from(sorted(FIELDS)), value=wrong_values)
def test_wrong_types_and_out_of_range_values_name_the_field(key: str, value: str) -> None:
    try:
        load_config(TINY, [f"{key}={value}"])
    except ConfigError as err:
        text = str(err)
        assert "\n" not in text and text.startswith("config field ")
        # the field named is the one overridden, or (cross-field checks) a field of its section
        # (an item of a list field is named with its index: controllers[0])
        assert re.split(r"[.\[]", err.field)[0] == key.split(".")[0], (key, text)
    except ValueError as err:  # a component's own check (estimator/controller options, tasks)
        assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("train.steps=0", ["'train.steps'", ">= 1"]),
        ("pipeline.max_learner_failures=-1", ["'pipeline.max_learner_failures'", ">= 0"]),
        ("train.max_nonfinite_steps=-1", ["'train.max_nonfinite_steps'"]),
        ("faults.generator_delay_p=2", ["'faults.generator_delay_p'", "[0, 1]"]),
        ("pipeline.cpus_per_actor=8", ["pipeline.cpus_per_actor", "reserves", "CPUs"]),
        ("pipeline.lag_mode=sometimes", ["'pipeline.lag_mode'", "bound"]),
    ],
)
def test_validate_names_the_field_and_the_fix(capsys, cache: Path, override: str, needles: list[str]) -> None:
    line = validate(capsys, override, f"workload.cache_dir={cache}")
    for needle in needles:
        assert needle in line, line


@SETTINGS
@given(text=st.text(max_size=80))
def test_malformed_yaml_names_the_file(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("yaml") / "config.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as err:
        assert str(path) in str(err) or err.field != "config", str(err)
        assert "\n" not in str(err)


def test_malformed_and_non_utf8_yaml_via_validate(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1\n")
    line = validate(capsys, config=bad)
    assert str(bad) in line and "line" in line
    bad.write_bytes(b"train:\n  steps: \xff\xfe\n")
    line = validate(capsys, config=bad)
    assert str(bad) in line and "UTF-8" in line


# --- prompt files -------------------------------------------------------------------------------------------
def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("name", "write", "needle"),
    [
        ("empty.jsonl", lambda p: p.write_text(""), "no rows"),
        (
            "empty.parquet",
            lambda p: pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p),
            "no rows",
        ),
        ("latin1.jsonl", lambda p: p.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1")), "UTF-8"),
        ("nocol.jsonl", lambda p: jsonl(p, [{"question": "1+1="}]), "no 'prompt' column"),
        ("nocol.parquet", lambda p: pq.write_table(pa.table({"text": ["1+1="]}), p), "no 'prompt' column"),
        ("fake.parquet", lambda p: p.write_bytes(b"prompt,answer\n1+1=,2\n"), "not a readable Parquet"),
        ("blank.jsonl", lambda p: jsonl(p, [{"prompt": "1+1="}, {"prompt": "  "}]), "row 1 has an empty"),
        ("number.jsonl", lambda p: jsonl(p, [{"prompt": 12}]), "non-string 'prompt'"),
        ("broken.jsonl", lambda p: p.write_text('{"prompt": "1+1="\n'), "line 1 is not valid JSON"),
        ("prompts.csv", lambda p: p.write_text("prompt\n1+1=\n"), "unsupported extension"),
        ("missing.jsonl", lambda p: None, "does not exist"),
    ],
)
def test_bad_prompt_files_are_caught_by_validate(
    tmp_path: Path, capsys, name: str, write, needle: str
) -> None:
    path = tmp_path / name
    write(path)
    line = validate(capsys, f"workload.prompts_path={path}")  # models not needed for these
    assert name in line and needle in line, line


def test_prompts_longer_than_the_models_context_are_caught(tmp_path: Path, cache: Path, capsys) -> None:
    path = jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1="}, {"prompt": "9" * 30 + "="}])
    line = validate(capsys, f"workload.prompts_path={path}", f"workload.cache_dir={cache}")
    assert "long.jsonl" in line and "row 1" in line and "context of 32 tokens" in line
    assert "sampling.max_new_tokens" in line


@SETTINGS
@given(data=st.binary(max_size=200), suffix=st.sampled_from([".jsonl", ".parquet"]))
def test_random_bytes_as_a_prompt_file(tmp_path_factory, data: bytes, suffix: str) -> None:
    from asyncrl.workloads.prompts import load_prompts

    path = tmp_path_factory.mktemp("prompts") / f"p{suffix}"
    path.write_bytes(data)
    try:
        load_prompts(path)
    except ValueError as err:
        assert str(path) in str(err) and "\n" not in str(err)


# --- checkpoints -------------------------------------------------------------------------------------------
def test_missing_checkpoint_files_are_named(pair, capsys) -> None:
    teacher, _ = pair
    (teacher / "config.json").unlink()
    line = validate(capsys, *paths(pair))
    assert str(teacher) in line and "missing: config" in line and "save_pretrained" in line
    shutil.rmtree(teacher)
    assert "does not exist" in validate(capsys, *paths(pair))


def test_a_truncated_safetensors_file_is_named(pair, capsys) -> None:
    weights = pair[1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    line = validate(capsys, *paths(pair))
    assert "student" in line and "model.safetensors is truncated" in line
    weights.write_bytes(b"\x80\x04not safetensors")
    assert "model.safetensors is not a safetensors file" in validate(capsys, *paths(pair))


def test_a_vocabulary_mismatch_is_named(pair, tmp_path, capsys) -> None:
    other = save_model(tmp_path / "other", extra_token="<extra>")
    capsys.readouterr()  # the save's progress bar
    line = validate(capsys, f"workload.teacher_path={other}", f"workload.student_path={pair[1]}")
    assert "tokenizer" in line and "differ" in line and "<extra>" in line


def test_a_gguf_path_that_is_not_a_gguf_file_is_named(pair, tmp_path, capsys) -> None:
    bad = tmp_path / "teacher.gguf"
    line = validate(capsys, f"workload.teacher_path={bad}", f"workload.student_path={pair[1]}")
    assert "workload.teacher_path" in line and str(bad) in line and "does not exist" in line
    bad.write_text("not a model")
    line = validate(capsys, f"workload.teacher_path={bad}", f"workload.student_path={pair[1]}")
    assert "workload.teacher_path" in line and str(bad) in line and "not a GGUF file" in line


def test_a_checkpoint_whose_config_is_not_json_is_named(pair, capsys) -> None:
    (pair[0] / "config.json").write_text("{")
    line = validate(capsys, *paths(pair))
    assert "config.json" in line


# --- a failed run's summary -------------------------------------------------------------------------------
def test_a_failed_run_summary_says_failed(tmp_path: Path) -> None:
    s = failed_summary(tmp_path, RuntimeError("the learner died\nthree times"), wall_s=1.0)
    assert (
        s["status"] == "failed"
        and s["steps"] == 0
        and s["error"] == "RuntimeError: the learner died three times"
    )


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("pipeline.engine=vllm", "pipeline.engine"),
        ("pipeline.generators=2", "pipeline.generators"),
        ("pipeline.teacher_scorers=2", "pipeline.teacher_scorers"),
        ("pipeline.fuse_scoring=true", "pipeline.fuse_scoring"),
        ("pipeline.engine_options={dtype: bfloat16}", "pipeline.engine_options"),
    ],
)
def test_colocate_names_the_setting_it_cannot_honour(override: str, field: str) -> None:
    """``pipeline.colocate`` generates in the learner's process; at ``max_lag=0`` from the learner's
    own model: a setting it would have to ignore (another engine, stage actors, an engine dtype
    in step) is an error naming it."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["pipeline.colocate=true", "pipeline.max_lag=0", override])
    assert err.value.field == field, str(err.value)
    assert "colocate=false" in str(err.value) and "\n" not in str(err.value)


def test_colocate_with_a_lag_runs_its_own_engine() -> None:
    """``max_lag >= 1`` with ``colocate``: a rollout thread with its own engine, so every engine
    option applies; stage actors still do not exist to be set."""
    cfg = load_config(
        TINY,
        [
            "pipeline.colocate=true",
            "pipeline.max_lag=2",
            "pipeline.engine_options={decode: hf, dtype: float32}",
        ],
    )
    assert cfg.pipeline.colocate and cfg.pipeline.max_lag == 2
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["pipeline.colocate=true", "pipeline.max_lag=2", "pipeline.generators=2"])
    assert err.value.field == "pipeline.generators", str(err.value)


def test_colocate_reserves_only_the_learner_workers() -> None:
    from asyncrl.plan import check_cpus

    cfg = load_config(
        TINY, ["pipeline.colocate=true", "pipeline.max_lag=0", "pipeline.engine_options={decode: hf}"]
    )
    check_cpus(cfg, cfg.pipeline.cpus_per_worker)  # no stage actors to reserve CPUs for
    with pytest.raises(ValueError, match=r"pipeline\.cpus_per_worker"):
        check_cpus(dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, colocate=False)), 0.5)
