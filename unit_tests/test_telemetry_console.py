"""The terminal filter: Ray's known-harmless lines are hidden by default, real problems never,
and ``-v`` shows everything. Lines below are copied from a real ``asyncrl demo`` run."""

from __future__ import annotations

import pytest

from asyncrl import ray_internals
from asyncrl.telemetry import console

HARMLESS = [
    (
        "TrainController",
        "[2026-12-01 03:06:07,669 E 8126 8260] core_worker.cc:2465: Actor with class name: "
        "'PreemptionWatcher' and ID: '154f1f49a088108686c2761101000000' has constructor arguments in "
        "the object store and "
        "max_restarts > 0. If the arguments in the object store go out of scope or are lost, the actor "
        "restart will fail. See https://github.com/ray-project/ray/issues/53727 for more details.",
    ),
    (
        "RayTrainWorker",
        "[2026-12-01 03:06:13,785 E 8459 8640] core_worker.cc:2465: Actor with class name: "
        "'MapWorker(MapBatches(Generate))' and ID: '2e42' has constructor arguments in the object store "
        "and max_restarts > 0.",
    ),
    (
        "PlacementGroupCleaner",
        "Failed to query Ray Train Controller actor state. State API may be temporarily",
    ),
    ("PlacementGroupCleaner", "Exception in thread PlacementGroupCleanerMonitor:"),
    ("PlacementGroupCleaner", "ConnectionError: Found multiple active Ray instances: {'a', 'b'}."),
    ("TrainController", "Requesting resources: {'CPU': 0.5} * 1"),
    ("TrainController", "Started training worker group of size 1: "),
    ("TrainController", "- (ip=192.0.2.2, pid=8459) world_rank=0, local_rank=0, node_rank=0"),
    ("raylet", "WARNING: 8 PYTHON worker processes have been started on node: abc with address: 1.2.3.4."),
    (
        "DatasetManager",
        "/x/ray/data/_internal/execution/interfaces/execution_options.py:436: RayDeprecationWarning: "
        "`ExecutionOptions.exclude_resources` is deprecated and will be removed after January 2027.",
    ),
    ("DatasetManager", "  self.exclude_resources = exclude_resources"),
    ("RayTrainWorker", "Loading weights:   0%|          | 0/21 [00:00<?, ?it/s]Loading weights: 100%|"),
    ("RayTrainWorker", "Writing model shards: 100%|##########| 1/1 [00:00<00:00, 239.35it/s]"),
    ("RayTrainWorker", "Setting up process group for: env:// [rank=0, world_size=1]"),
    ("RayTrainWorker", "Progress bars disabled. To enable, set `ray.data.DataContext...`"),
    (
        "RayTrainWorker",
        "Checkpoint successfully created at: Checkpoint(filesystem=local, path=/x/step_000004)",
    ),
    ("RayTrainWorker", "Reporting training result 1: TrainingReport(checkpoint=..., metrics={'step': 4})"),
    ("RayTrainWorker", "✔️  Dataset train_0356uR0Nz9iGIZtVYKRJyt_0 execution finished in 14.86 seconds"),
    (
        "raylet",
        "Task MapWorker(MapBatches(Generate)).submit failed. There are infinite retries remaining, so the "
        "task will be retried. Error: The actor is dead because it was killed by `ray.kill`.",
    ),
]

REAL = [
    ("RayTrainWorker", "Traceback (most recent call last):"),
    ("RayTrainWorker", "RuntimeError: fault injected at step 2 (pipeline fail_at_step)"),
    (
        "MapWorker(MapBatches(Generate))",
        "asyncrl: rollout engine died (CUDA OOM); restarting this generator actor",
    ),
    ("MapWorker(MapBatches(StreamBlocks))", "asyncrl: warning: skipped a prompt of 612 tokens"),
    ("RayTrainWorker", "/x/asyncrl/step.py:10: UserWarning: something the user must see"),
    ("TrainController", "Training failed due to worker errors: RuntimeError: boom"),
    ("raylet", "A worker died or was killed while executing a task by an unexpected system error."),
    ("DatasetManager", "ERROR: the stream failed"),
]


@pytest.mark.parametrize(("source", "line"), HARMLESS)
def test_known_harmless_lines_are_noise(source: str, line: str) -> None:
    assert console.is_noise(line, source)


@pytest.mark.parametrize(("source", "line"), REAL)
def test_real_problems_are_never_noise(source: str, line: str) -> None:
    assert not console.is_noise(line, source)


def test_every_noise_rule_says_why() -> None:
    assert all(n.why for n in console.NOISE)


DISK_FULL = (
    "[2026-12-07 01:53:05,398 E 21455 21464] (raylet) file_system_monitor.cc:116: "
    "/tmp/ray/session_2026-12-07_01-53-04_174927_21380 is over 95% full, available space: 12.5985 GB; "
    "capacity: 251.972 GB. Object creation will fail if spilling is required."
)


def test_a_repeating_disk_notice_is_told_once_in_asyncrls_words(monkeypatch, capsys) -> None:
    """The raylet logs its disk check every 10 s (seen in CI, where a full disk printed it into the
    demo's terminal): the first is told once as asyncrl's warning with the figures and the fix, every
    repeat (of any Ray session of the process) is dropped, and -v shows Ray's own lines."""
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.setattr(console, "_told", set())
    other = "A worker died or was killed while executing a task by an unexpected system error."
    for _ in range(3):
        assert console.forwarded_lines({"lines": [DISK_FULL, other], "pid": "raylet"}) == [other]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("asyncrl: warning: ")
    assert "over 95% full (12.5985 GB free of 251.972 GB)" in err[0] and "RAY_TMPDIR" in err[0]
    assert "raylet" not in err[0]
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert console.forwarded_lines({"lines": [DISK_FULL], "pid": "raylet"}) == [DISK_FULL]
    assert all(r.why for r in console.REPEATING)


def test_verbose_switch_and_quiet_env(monkeypatch) -> None:
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    assert not console.verbose()
    assert console.quiet_env() == {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    console.set_verbose(True)
    assert console.verbose() and console.quiet_env() == {}
    console.set_verbose(False)
    assert not console.verbose()


def test_the_filter_replaces_rays_handler_and_forwards_real_lines(monkeypatch) -> None:
    pytest.importorskip("ray")
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    printed: list[list[str]] = []
    monkeypatch.setattr(
        ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data["lines"])
    )
    raw = lambda data: printed.append(["raw"])  # noqa: E731
    monkeypatch.setattr(dispatcher, "handlers", [(ray_internals.RAY_HANDLER, raw)])
    assert console.install_log_filter()
    assert [name for name, _ in dispatcher.handlers] == [ray_internals.FILTER_HANDLER]
    dispatcher.emit({"lines": [line for _, line in HARMLESS[-3:]], "actor_name": "RayTrainWorker", "pid": 1})
    assert printed == []  # an all-noise batch prints nothing
    dispatcher.emit({"lines": [HARMLESS[11][1], REAL[1][1]], "actor_name": "RayTrainWorker", "pid": 1})
    assert printed == [[REAL[1][1]]]
    # a second ray.init in the same process (the demo runs two pipelines) adds Ray's handler again
    dispatcher.add_handler(ray_internals.RAY_HANDLER, lambda data: printed.append(["raw"]))
    assert console.install_log_filter()
    assert [name for name, _ in dispatcher.handlers] == [ray_internals.FILTER_HANDLER]
    console.set_verbose(True)
    monkeypatch.setattr(dispatcher, "handlers", [(ray_internals.RAY_HANDLER, None)])
    assert not console.install_log_filter()  # -v: Ray prints everything
    assert [name for name, _ in dispatcher.handlers] == [ray_internals.RAY_HANDLER]
    console.set_verbose(False)


def test_error_messages_printed_directly_by_ray_are_filtered_too(monkeypatch) -> None:
    """The GCS error subscriber calls ``print_to_stdstream`` itself, bypassing the dispatcher."""
    import types

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    printed: list[list[str]] = []
    fake = types.SimpleNamespace(print_to_stdstream=lambda data, ignore_prefix: printed.append(data["lines"]))
    ray_internals.filter_error_messages(fake, console.forwarded_lines)
    ray_internals.filter_error_messages(fake, console.forwarded_lines)  # once per process: not wrapped twice
    retried = (
        "Task MapWorker(MapBatches(Generate)).submit failed. There are infinite retries remaining, so the "
        "task will be retried. Error: The actor is dead because it was killed by `ray.kill`."
    )
    fake.print_to_stdstream({"lines": [retried], "pid": "raylet"}, ignore_prefix=False)
    real = "Task MapWorker(MapBatches(Generate)).submit failed. Error: The actor died unexpectedly (OOM)"
    fake.print_to_stdstream({"lines": [real], "pid": "raylet"}, ignore_prefix=False)
    assert printed == [[real]]
    monkeypatch.setenv(console.VERBOSE_ENV, "1")  # -v: everything
    fake.print_to_stdstream({"lines": [retried], "pid": "raylet"}, ignore_prefix=False)
    assert printed[-1] == [retried]


def test_the_filter_fails_open_a_raising_rule_shows_the_line(monkeypatch) -> None:
    """An exception inside the filter prints the batch as Ray would: noise, never a lost line or a
    stopped run (both paths: the dispatcher's handler and the error subscriber's printer)."""
    import types

    pytest.importorskip("ray")
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.delenv(ray_internals.DISABLE_ENV, raising=False)

    def broken(line: str, source: str) -> bool:
        raise ValueError("a rule that cannot be applied")

    monkeypatch.setattr(console, "is_noise", broken)
    printed: list[list[str]] = []
    monkeypatch.setattr(
        ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data["lines"])
    )
    monkeypatch.setattr(dispatcher, "handlers", [(ray_internals.RAY_HANDLER, lambda data: None)])
    assert console.install_log_filter()
    noise = HARMLESS[11][1]
    dispatcher.emit({"lines": [noise, REAL[1][1]], "actor_name": "RayTrainWorker", "pid": 1})
    assert printed == [[noise, REAL[1][1]]]  # unfiltered, not dropped
    fake = types.SimpleNamespace(print_to_stdstream=lambda data, ignore_prefix: printed.append(data["lines"]))
    ray_internals.filter_error_messages(fake, console.forwarded_lines)
    fake.print_to_stdstream({"lines": [noise], "pid": "raylet"}, ignore_prefix=False)
    assert printed[-1] == [noise]


def test_an_unknown_ray_keeps_rays_own_printing_with_one_warning(monkeypatch) -> None:
    pytest.importorskip("ray")
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.delenv(ray_internals.DISABLE_ENV, raising=False)
    monkeypatch.setattr(ray_internals, "ray_version", lambda: "3.1.0")
    monkeypatch.setattr(ray_internals, "_warned", set())
    ray_handler = lambda data: None  # noqa: E731
    monkeypatch.setattr(dispatcher, "handlers", [(ray_internals.RAY_HANDLER, ray_handler)])
    with pytest.warns(ray_internals.RayPatchSkipped, match="log_filter"):
        assert not console.install_log_filter()
    assert dispatcher.handlers == [(ray_internals.RAY_HANDLER, ray_handler)]  # Ray's own, untouched
