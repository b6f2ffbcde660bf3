"""The `asyncrl` command: help everywhere, one-line errors, report, ls, eval hints, the demo flow."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_report_html import write_fake_run

import asyncrl
from asyncrl import cli
from asyncrl.cli import demo_table, main
from asyncrl.telemetry.sinks import read_summary

COMMANDS = ("demo", "run", "sweep", "validate", "report", "pretrain", "eval", "ls")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_everywhere_mentions_quiet(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"] if command else ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--quiet" in out
    if command is None:
        assert all(c in out for c in COMMANDS)


def test_quiet_before_or_after_the_subcommand() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["-q", "ls"]).quiet is True
    assert parser.parse_args(["ls", "--quiet"]).quiet is True
    assert getattr(parser.parse_args(["ls"]), "quiet", False) is False


def test_console_script_entry_point_runs_without_heavy_imports() -> None:
    code = "import sys; from asyncrl.cli import main; main(['--version'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == f"asyncrl {asyncrl.__version__}"


def test_run_checks_what_it_can_before_ray_without_importing_torch(tmp_path: Path) -> None:
    """`asyncrl run` starts Ray's processes before the driver imports torch, transformers and the
    components (about 2 s of CPU, made beside Ray's start): what it checks before Ray starts (the
    config's fields, types and values; the pretrained pair's files) and the pipeline module must
    import none of them, else the start-up pays them serially again."""
    cache = tmp_path / "cache"
    for role in ("teacher", "student"):  # a complete pair as _check_checkpoints sees it: its files
        d = cache / "addition-small-s0" / role
        d.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (d / name).write_text("{}")
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_async.yaml"
    code = (
        "import sys\n"
        "import asyncrl.pipeline\n"
        "from asyncrl.cli import _check_checkpoints\n"
        "from asyncrl.config import parse_config\n"
        f"cfg = parse_config({str(config)!r}, ['workload.cache_dir={cache}', 'train.lr=0.001'])\n"
        "assert cfg.train.lr == 0.001\n"
        "_check_checkpoints(cfg)\n"
        "heavy = ('torch', 'transformers', 'ray.train', 'asyncrl.estimators')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_run_resolves_names_and_checks_the_plan_beside_ray_start(tmp_path: Path) -> None:
    """What ``asyncrl.run`` prepares beside ``ray.init`` (``prepare_driver``) makes the checks
    ``parse_config`` leaves out: an unknown component is refused there, with the nearest name, before
    the run directory is touched (``run`` then stops the Ray instance it started and raises it)."""
    from asyncrl.config import parse_config
    from asyncrl.configurable import ConfigError
    from asyncrl.pipeline import prepare_driver

    cfg = parse_config(None, ["estimator.name=forward_kll", f"run_dir={tmp_path / 'run'}"])  # parses
    with pytest.raises(ConfigError, match=r"estimator.*forward_kl"):
        prepare_driver(cfg)
    assert not (tmp_path / "run").exists()


def test_unexpected_errors_are_one_line_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(args):
        raise RuntimeError("the generator actor died\n(details)")

    monkeypatch.setattr(cli, "cmd_ls", boom)
    monkeypatch.delenv("ASYNCRL_DEBUG", raising=False)
    assert main(["ls"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "RuntimeError: the generator actor died (details)" in err and "ASYNCRL_DEBUG=1" in err
    monkeypatch.setenv("ASYNCRL_DEBUG", "1")
    with pytest.raises(RuntimeError):
        main(["ls"])


def test_ls_prints_one_line_per_entry(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncrl.workloads.tasks import TASKS

    assert main(["ls", "tasks"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == TASKS.names()
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # name + description


def test_ls_everything_groups_by_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    for kind in cli.REGISTRIES:
        assert f"{kind}:\n" in out
    for name in ("reverse_kl_mc", "grpo", "bounded_staleness", "addition", "tiny", "hf"):
        assert f"  {name} " in out


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_fake_run(tmp_path / "sync", max_lag=0, steps=3)
    b = write_fake_run(tmp_path / "async", max_lag=2, steps=3)
    assert main(["report", str(a), str(b), "-o", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'r.html'}"
    assert main(["report", str(a)]) == 0
    assert (a / "report.html").exists()


def test_report_on_an_incomplete_run_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_fake_run(tmp_path / "r", max_lag=0, steps=2)
    (run / "metrics.jsonl").unlink()
    assert main(["report", str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing metrics.jsonl" in err and str(run) in err


def test_eval_on_a_missing_checkpoint_names_the_pretrain_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--model", str(tmp_path / "nope"), "--n", "4"]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "asyncrl pretrain --task addition --preset small" in err


# --- demo ----------------------------------------------------------------------------------------
SYNC = {
    "max_lag": 0,
    "eval_accuracy_initial": 0.31,
    "eval_accuracy_final": 0.8,
    "wall_time_s": 100.0,
    "samples_per_s": 10.0,
    "lag_p50": 0.0,
    "lag_max": 0,
    "samples_dropped": 0,
}
# lag_max as a float, as it comes back from JSON written by another tool: still printed as an integer
ASYNC = {**SYNC, "max_lag": 2, "wall_time_s": 55.5, "samples_per_s": 20.5, "lag_p50": 1.0, "lag_max": 2.0}


def test_demo_table_from_fake_summaries() -> None:
    table = demo_table(0.984, SYNC, {**ASYNC, "samples_dropped": 7}, "runs/demo/report.html")
    rows = {line[:24].strip(): line[24:].split() for line in table.splitlines()}
    assert rows[""] == ["sync", "(max_lag", "0)", "async", "(max_lag", "2)"]
    assert rows["teacher accuracy"] == ["0.984"]
    assert rows["student accuracy before"] == ["0.310", "0.310"]
    assert rows["student accuracy after"] == ["0.800", "0.800"]
    assert rows["wall time (s)"] == ["100.0", "55.5"]
    assert rows["samples/s"] == ["10.0", "20.5"]
    assert rows["speedup (samples/s)"] == ["1.00x", "2.05x"]
    assert rows["lag p50 / max"] == ["0", "/", "0", "1", "/", "2"]
    assert rows["dropped samples"] == ["0", "7"]
    assert table.splitlines()[-1] == "report: runs/demo/report.html"


def test_demo_table_tolerates_missing_figures() -> None:
    table = demo_table(None, {"max_lag": 0}, {"max_lag": 2}, "r.html", student_accuracy=0.25)
    assert "speedup (samples/s)      1.00x" in table
    assert "student accuracy before  0.250" in table  # the pretrained student stands in
    assert "teacher accuracy         -" in table


def test_demo_runs_sync_and_async_and_writes_the_overlaid_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncrl import pipeline as pipeline_module
    from asyncrl.lab import pretrain as pretrain_module

    calls: dict[str, object] = {}

    def fake_pretrain(**kw):
        calls["pretrain"] = kw
        return SimpleNamespace(teacher_accuracy=0.97, student_accuracy=0.3, reused=True, wall_time_s=0.1)

    def fake_run(cfg):
        calls.setdefault("runs", []).append(cfg)
        run = write_fake_run(Path(cfg.run_dir), max_lag=cfg.pipeline.max_lag, steps=cfg.train.steps)
        return SimpleNamespace(run_dir=run, summary=read_summary(run), config=cfg)

    @contextlib.contextmanager
    def fake_session(cfg):  # both runs share one Ray instance
        calls["session"] = "open"
        yield
        calls["session"] = f"closed after {len(calls['runs'])} runs"

    monkeypatch.setattr(pretrain_module, "pretrain", fake_pretrain)
    monkeypatch.setattr(asyncrl, "run", fake_run)
    monkeypatch.setattr(pipeline_module, "ray_session", fake_session)
    root = tmp_path / "demo"
    argv = ["demo", "--quiet", "--preset", "tiny", "--steps", "3", "--run-root", str(root), "train.lr=0.002"]
    assert main(argv) == 0
    assert calls["pretrain"] == {
        "task": "addition",
        "preset": "tiny",
        "cache_dir": ".asyncrl_cache",
        "seed": 0,
        "progress": False,
    }
    assert calls["session"] == "closed after 2 runs"
    sync, asyn = calls["runs"]
    assert (sync.pipeline.max_lag, asyn.pipeline.max_lag) == (0, cli.DEMO_MAX_LAG)
    assert (Path(sync.run_dir), Path(asyn.run_dir)) == (root / "sync", root / "async")
    for cfg in (sync, asyn):
        assert cfg.train.steps == 3 and cfg.train.lr == 0.002  # user overrides reach both runs
        assert cfg.workload.preset == "tiny" and cfg.telemetry.progress is False
        assert cfg.pipeline.resume is False and cfg.algo == "opd"
    out = capsys.readouterr().out
    assert out.startswith(" " * 25 + "sync (max_lag 0)")  # quiet: only the table
    assert "teacher accuracy         0.970" in out
    assert out.strip().endswith(f"report: {root / 'report.html'}")
    page = (root / "report.html").read_text()
    assert "asyncrl demo: sync vs async" in page and "<th>sync</th><th>async</th>" in page


def test_demo_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_demo_checks_its_configs_before_pretraining(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncrl.lab import pretrain as pretrain_module

    def no_pretrain(**kw):
        raise AssertionError("pretrain must not start when a config is invalid")

    monkeypatch.setattr(pretrain_module, "pretrain", no_pretrain)
    assert main(["demo", "-q", "train.stesp=3"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_run_without_pretrained_checkpoints_names_the_exact_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_tiny.yaml"
    cache = tmp_path / "cache"
    argv = [
        "run",
        str(tiny),
        f"workload.cache_dir={cache}",
        "workload.pretrain_seed=3",
        f"run_dir={tmp_path / 'r'}",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "teacher" in err and "does not exist" in err
    assert err.endswith(f"asyncrl pretrain --task addition --preset tiny --seed 3 --cache-dir {cache}")
    assert not (tmp_path / "r").exists()  # nothing started
