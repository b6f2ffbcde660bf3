"""``asyncrl sweep``: a grid of runs over config keys x seeds, resumable, aggregated into tables, PNG
plots and one HTML report.

Why: a staleness study compares runs that differ in one or two settings, over several seeds,
and takes hours; it must be checked before the first run starts, survive an interruption
without redoing finished runs, and end in a table and a plot rather than forty run directories.

A sweep file (YAML; every field in ``SweepSpec``)::

    name: kl_direction_x_lag                  # default: the file's stem
    base: ../configs/opd_async.yaml           # run config; relative to this file, or absolute
    output_dir: runs/sweeps/kl_direction      # relative to the working directory, like run_dir
    overrides: {train.steps: 60}              # fixed for every cell
    grid:                                     # every combination of these values
      pipeline.max_lag: [0, 1, 2, 4, 8]
    variants:                                 # named sets of overrides, crossed with the grid
      forward_kl: {estimator.name: forward_kl, estimator.options: {tail: bucket}}
      reverse_kl_mc_stale: {estimator.name: reverse_kl_mc, estimator.options: {advantage: stale}}
    seeds: [0, 1, 2]
    aggregate: {x: pipeline.max_lag, group_by: [variant], y: [eval_accuracy_final]}

Keys are dotted as in ``asyncrl run KEY=VALUE`` and set that node (a mapping value replaces the
node: ``estimator.options: {...}`` replaces the options). A **cell** is one variant x one grid
point x one seed; it runs ``base + overrides + variant + grid point + seed`` in
``OUTPUT/runs/<cell key>``, e.g. ``variant=forward_kl__pipeline.max_lag=4__seed=1``.

- Validation: ``load_sweep`` builds and checks every cell's config (``load_config`` and the
  pipeline's build checks) before anything runs; errors name the sweep file, the cell and the field.
- Resume: a cell whose run directory holds ``summary.json`` (the pipeline writes it only when a
  run completes) is done and not rerun; any other cell is (re)run, and the pipeline resumes it from
  its checkpoint. A run directory holding a different config is refused, never silently reused.
- Execution: one after another in this process, sharing one Ray instance (``asyncrl.run`` leaves a
  Ray it did not start running), or ``parallel`` cells at a time, each cell's pipeline driven by its
  own Ray task, capped at what the cluster's CPUs/GPUs hold.
- Outputs in OUTPUT: ``cells.csv|parquet`` (one row per cell), ``seeds.csv|parquet`` (mean, std, n
  over seeds per setting), ``plots/*.png``, ``report.html`` and ``sweep.json`` (cells and statuses).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncrl.config import RunConfig, load_config, parse_override
from asyncrl.configurable import ConfigError, field, from_dict, to_dict
from asyncrl.lab.sweep_report import SweepOutputs
from asyncrl.registry import RegistryError
from asyncrl.telemetry import names
from asyncrl.telemetry.sinks import read_summary

__all__ = [
    "AggregateSpec",
    "Cell",
    "CellResult",
    "Sweep",
    "SweepError",
    "SweepSpec",
    "aggregate_sweep",
    "cell_key",
    "cell_state",
    "load_sweep",
    "run_sweep",
    "select_cells",
]

VARIANT = "variant"
SEED = "seed"
RUNS_DIR = "runs"
MANIFEST = "sweep.json"
#: what a sweep sets on every cell before the sweep file's overrides: the grid shows the progress
CELL_DEFAULTS: dict[str, Any] = {"telemetry.progress": False}
#: fields that say where or how a run executes, not what it computes: a finished cell whose stored
#: config differs from the sweep's only in these is still the same cell
EXECUTION_ONLY = (
    "run_dir",
    "workload.cache_dir",
    "telemetry.progress",
    "telemetry.tensorboard",
    "pipeline.resume",
    "pipeline.ray_address",
    "pipeline.num_cpus",
)
DEFAULT_METRICS = (
    names.LOSS,
    names.EVAL_ACCURACY,
    names.KL_BEHAVIOR_CURRENT,
    names.ESS_RHO,
    names.GRAD_NORM,
    names.LAG_MEAN,
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._,+-]+")
_MAX_LABEL = 48


class SweepError(ValueError):
    """A bad sweep file, cell or sweep directory; the message names the file, the cell and the field."""


@dataclass(frozen=True)
class AggregateSpec:
    x: str | None = field(None, help="swept key on the x axis of the plots (default: the first grid key)")
    group_by: tuple[str, ...] | None = field(
        None,
        help="swept keys with one line each (default: every swept key but x; a swept key must be x or here)",
    )
    y: tuple[str, ...] = field(
        ("eval_accuracy_final",),
        help="cell-table columns plotted against x: summary.json figures or final:<metric> / mean:<metric>",
    )
    metrics: tuple[str, ...] = field(
        DEFAULT_METRICS, help="metrics.jsonl keys tabulated as final:<key> and mean:<key> per cell"
    )
    curves: tuple[str, ...] = field(
        (names.EVAL_ACCURACY, names.LOSS), help="metrics.jsonl keys plotted against step, per group"
    )
    log_x: bool = field(False, help="log-scale x axis (e.g. for a learning-rate grid)")


@dataclass(frozen=True)
class SweepSpec:
    """A sweep file."""

    base: str = field(
        "", help="run config YAML every cell starts from: relative to the sweep file, or absolute"
    )
    name: str | None = field(None, help="sweep name (default: the sweep file's stem)")
    output_dir: str | None = field(
        None, help="sweep directory, relative to the working directory (default: runs/sweeps/<name>)"
    )
    overrides: dict[str, Any] = field(default_factory=dict, help="dotted key -> value set on every cell")
    grid: dict[str, Any] = field(default_factory=dict, help="dotted key -> list of values; every combination")
    variants: dict[str, Any] = field(
        default_factory=dict, help="name -> {dotted key: value}: named override sets, crossed with the grid"
    )
    seeds: tuple[int, ...] | None = field(
        None, help="run seeds, one cell each (default: the base config's seed)"
    )
    aggregate: AggregateSpec = field(default_factory=AggregateSpec, help="tables and plots")


@dataclass(frozen=True)
class Cell:
    """One run of the sweep."""

    key: str  # directory name: variant=...__<grid key>=<value>__...__seed=<s>
    settings: dict[str, Any]  # swept key ("variant" for the variant's name) -> value, without the seed
    seed: int
    overrides: dict[str, Any]  # every dotted override applied to the base config, in order
    config: RunConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: every cell's config built and checked."""

    path: Path
    spec: SweepSpec
    name: str
    base: Path
    output_dir: Path
    swept: tuple[str, ...]  # "variant" (if any variants) then the grid keys, in file order
    x: str | None
    group_by: tuple[str, ...]
    cells: tuple[Cell, ...]

    @property
    def runs_dir(self) -> Path:
        return self.output_dir / RUNS_DIR


CellStatus = Literal["done", "partial", "pending"]


@dataclass(frozen=True)
class CellResult:
    """What happened to a cell in this invocation: ``skipped`` (done before), ``done`` or ``failed``."""

    status: Literal["skipped", "done", "failed"]
    wall_s: float = 0.0
    error: str | None = None


# --- loading and validation ---------------------------------------------------------------------------
def _fail(path: Path, where: str, message: str) -> SweepError:
    return SweepError(f"sweep {path}{', ' + where if where else ''}: {message}")


def value_label(value: Any) -> str:
    """A value as it appears in a cell key: YAML scalars as written (``true``, ``null``, ``0.0003``),
    mappings and lists in YAML flow style without brackets (``tail-bucket``, ``1,2``); characters
    other than letters, digits and ``. _ , + -`` become ``-``; a label longer than 48 characters is
    cut and ends in a hash of the whole value."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = repr(value)
    else:
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        if isinstance(value, dict | list):
            text = text[1:-1].replace(", ", ",").replace(": ", "-")
    text = _UNSAFE.sub("-", text) or "-"
    if len(text) > _MAX_LABEL:
        digest = hashlib.sha1(repr(value).encode()).hexdigest()[:8]
        text = f"{text[: _MAX_LABEL - 9]}-{digest}"
    return text


def cell_key(settings: Mapping[str, Any], seed: int | str) -> str:
    """``variant=forward_kl__pipeline.max_lag=4__seed=1``: swept keys in order, then the seed."""
    return "__".join([*(f"{k}={value_label(v)}" for k, v in settings.items()), f"{SEED}={seed}"])


def _check_keys(path: Path, where: str, mapping: Mapping[str, Any], reserved: Iterable[str]) -> None:
    for key in mapping:
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise _fail(path, where, f"key {key!r} is not a dotted config key (e.g. pipeline.max_lag)")
        if key in reserved:
            raise _fail(path, where, f"key {key!r} is set by the sweep ({_reserved_fix(key)})")


def _reserved_fix(key: str) -> str:
    return {
        SEED: "list the seeds under 'seeds:'",
        "run_dir": "cells run in OUTPUT/runs/<cell key>; set output_dir instead",
        VARIANT: "'variant' names the variants; it is not a config key",
    }[key]


def _read_spec(path: Path) -> SweepSpec:
    if not path.is_file():
        raise SweepError(f"sweep file {path} does not exist; see examples/sweeps/")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise SweepError(f"sweep {path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise SweepError(f"sweep {path}: the YAML top level must be a mapping (base:, grid:, seeds:, ...)")
    if not data.get("base"):
        raise _fail(path, "field 'base'", "missing; name the run config every cell starts from")
    try:
        return from_dict(SweepSpec, data)
    except ConfigError as err:
        raise _fail(path, "", str(err)) from None


def _validate_spec(path: Path, spec: SweepSpec, cli: Mapping[str, Any]) -> tuple[str, ...]:
    """Checks across fields; returns the swept keys ("variant" first, then the grid keys)."""
    reserved = (SEED, "run_dir", VARIANT)
    _check_keys(path, "overrides", spec.overrides, reserved)
    _check_keys(path, "command-line overrides", cli, reserved)
    _check_keys(path, "grid", spec.grid, reserved)
    for key, values in spec.grid.items():
        if not isinstance(values, list) or not values:
            raise _fail(path, f"grid.{key}", f"got {values!r}; give a non-empty list of values, e.g. [0, 2]")
        labels = [value_label(v) for v in values]
        if len(set(labels)) < len(labels):
            raise _fail(
                path,
                f"grid.{key}",
                f"got {values!r}; each value must appear once, as it appears in cell directory names "
                f"({', '.join(labels)})",
            )
    variant_keys: set[str] = set()
    for name, overrides in spec.variants.items():
        if not isinstance(name, str) or not _NAME.match(name):  # YAML may give an int
            raise _fail(path, f"variants.{name}", "a variant name is letters, digits, '.', '_' or '-'")
        if not isinstance(overrides, dict):
            raise _fail(
                path, f"variants.{name}", f"got {overrides!r}; give a mapping of dotted keys to values"
            )
        _check_keys(path, f"variants.{name}", overrides, reserved)
        variant_keys |= set(overrides)
    for key in spec.grid:
        if key in variant_keys:
            raise _fail(path, f"grid.{key}", "also set by a variant; set each key in the grid or in variants")
    # a variant may override a fixed override (applied after it); the grid always would, and a
    # command-line value would silently lose to both: refused
    for key in spec.overrides:
        if key in spec.grid:
            raise _fail(path, f"overrides: {key}", "this key is swept in the grid; it cannot be fixed too")
    for key in cli:
        if key in spec.grid or key in variant_keys:
            raise _fail(
                path,
                f"command-line overrides: {key}",
                "this key is swept (grid or variants); it cannot be fixed",
            )
    if spec.seeds is not None:
        if not spec.seeds:
            raise _fail(path, "field 'seeds'", "got []; give at least one seed, e.g. [0, 1, 2]")
        if len(set(spec.seeds)) < len(spec.seeds):
            raise _fail(path, "field 'seeds'", f"got {list(spec.seeds)}; each seed must appear once")
    return ((VARIANT,) if spec.variants else ()) + tuple(spec.grid)


def _resolve_aggregate(
    path: Path, agg: AggregateSpec, swept: tuple[str, ...]
) -> tuple[str | None, tuple[str, ...]]:
    """x and group_by, defaulted and checked: every swept key is x or in group_by (never averaged over)."""
    grid = [k for k in swept if k != VARIANT]
    x = agg.x if agg.x is not None else (grid[0] if grid else (swept[0] if swept else None))
    if x is not None and x not in swept:
        raise _fail(path, "aggregate.x", f"got {x!r}; use a swept key: {list(swept)}")
    group_by = agg.group_by if agg.group_by is not None else tuple(k for k in swept if k != x)
    for key in group_by:
        if key not in swept or key == x:
            raise _fail(
                path, "aggregate.group_by", f"got {key!r}; use swept keys other than x: {list(swept)}"
            )
    left = [k for k in swept if k != x and k not in group_by]
    if left:
        raise _fail(
            path,
            "aggregate.group_by",
            f"swept keys {left} are neither x nor grouped; add them to group_by (plots never average over a "
            "swept key)",
        )
    figures = [k for k in names.SUMMARY_KEYS if k not in ("algo", "estimator", "run_dir")]
    for i, col in enumerate(agg.y):
        prefix, sep, metric = col.partition(":")
        if (sep and prefix in ("final", "mean") and metric) or (not sep and col in figures):
            continue
        close = difflib.get_close_matches(col, figures, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _fail(
            path,
            f"aggregate.y[{i}]",
            f"got {col!r}; {hint}use a summary.json figure ({', '.join(figures)}) or final:<metric> / "
            "mean:<metric> (e.g. final:loss)",
        )
    return x, tuple(group_by)


def _check_cell(cfg: RunConfig) -> None:
    """The pipeline's checks without models or Ray (pairings, MC samples, divisibility), as
    ``asyncrl validate`` makes them."""
    from asyncrl.plan import check_components

    check_components(cfg, None)


def load_sweep(
    path: str | Path, overrides: Sequence[str] = (), *, output_dir: str | Path | None = None
) -> Sweep:
    """Read a sweep file and build every cell's config; ``overrides`` (``key=value``) apply to every cell
    (e.g. ``train.steps=3``). Raises ``SweepError`` naming the file, the cell and the field."""
    path = Path(path)
    spec = _read_spec(path)
    try:
        cli = dict(parse_override(o) for o in overrides)
    except ConfigError as err:
        raise _fail(path, "command-line overrides", str(err)) from None
    swept = _validate_spec(path, spec, cli)
    x, group_by = _resolve_aggregate(path, spec.aggregate, swept)
    base = Path(spec.base)
    base = base if base.is_absolute() else path.parent / base
    if not base.is_file():
        raise _fail(
            path, "field 'base'", f"{base} does not exist; give a run config relative to the sweep file"
        )
    name = spec.name or path.stem
    out = Path(output_dir if output_dir is not None else spec.output_dir or Path("runs") / "sweeps" / name)
    out = out.resolve()
    variants: list[tuple[str | None, dict[str, Any]]] = list(spec.variants.items()) or [(None, {})]
    points = list(itertools.product(*spec.grid.values()))
    seeds: list[int | None] = list(spec.seeds) if spec.seeds is not None else [None]
    cells: list[Cell] = []
    for (variant, vover), point, seed in itertools.product(variants, points, seeds):
        settings = ({VARIANT: variant} if variant is not None else {}) | dict(zip(spec.grid, point))
        over = {**CELL_DEFAULTS, **spec.overrides, **cli, **vover, **dict(zip(spec.grid, point))}
        if seed is not None:
            over[SEED] = seed
        key = cell_key(settings, seed if seed is not None else "<base seed>")
        try:
            cfg = load_config(base, over)
            key = cell_key(settings, cfg.seed)  # seeds not listed: the base config's
            cfg = replace(cfg, run_dir=str(out / RUNS_DIR / key))
            _check_cell(cfg)
        except (ConfigError, RegistryError, ValueError, ImportError) as err:
            raise _fail(path, f"cell {key}", " ".join(str(err).split())) from None
        cells.append(Cell(key=key, settings=settings, seed=cfg.seed, overrides=over, config=cfg))
    return Sweep(
        path=path.resolve(),
        spec=spec,
        name=name,
        base=base.resolve(),
        output_dir=out,
        swept=swept,
        x=x,
        group_by=group_by,
        cells=tuple(cells),
    )


def select_cells(sweep: Sweep, only: Sequence[str]) -> tuple[Cell, ...]:
    """The cells that match every ``KEY=VALUE`` of ``only`` (``--only``): KEY is a swept key, ``variant``
    or ``seed``, VALUE a label as it appears in cell keys. Several values of one key (repeated, or
    comma-separated unless the whole text is one label) select any of them; different keys all hold.

    Why: filling in part of a long sweep (one lag, the new variants, more seeds) runs just those cells,
    while the manifest, the tables and the report still cover every cell of the file, so the part joins
    the whole instead of starting a sweep of its own. Raises ``SweepError`` naming the key or value and
    what the sweep has."""
    labels: dict[str, dict[str, None]] = {}  # key -> its labels in cell order
    for cell in sweep.cells:
        for key, value in cell.settings.items():
            labels.setdefault(key, {})[value_label(value)] = None
        labels.setdefault(SEED, {})[str(cell.seed)] = None
    wanted: dict[str, set[str]] = {}
    for item in only:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise _fail(
                sweep.path, "--only", f"{item!r} is not KEY=VALUE (e.g. pipeline.max_lag=2,4 or seed=0)"
            )
        if key not in labels:
            raise _fail(sweep.path, "--only", f"{key!r} is not swept; choose from {', '.join(labels)}")
        values = [text] if text in labels[key] else [v.strip() for v in text.split(",")]
        for value in values:
            if value not in labels[key]:
                raise _fail(
                    sweep.path, "--only", f"{key} has no value {value!r}; it has {', '.join(labels[key])}"
                )
        wanted.setdefault(key, set()).update(values)

    def matches(cell: Cell) -> bool:
        have = {k: value_label(v) for k, v in cell.settings.items()} | {SEED: str(cell.seed)}
        return all(have[k] in vs for k, vs in wanted.items())

    return tuple(c for c in sweep.cells if matches(c))


# --- resume -------------------------------------------------------------------------------------------
def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: d}


def _as_configured(cfg: RunConfig) -> RunConfig:
    """A run's stored config with what the run filled in itself taken out again: a real preset's
    prompt splits, which ``plan.absolute_paths`` sets from its prepared cache when the config leaves
    them unset (so a stored cell of a real preset compares equal to the cell that made it)."""
    from asyncrl.workloads import real

    w = cfg.workload
    if not real.is_real(w.preset) or w.teacher_path or w.student_path:
        return cfg
    made = real.paths(w.preset, w.cache_dir)
    return replace(
        cfg,
        workload=replace(
            w,
            prompts_path=None if w.prompts_path == made["train_prompts"] else w.prompts_path,
            eval_prompts_path=None if w.eval_prompts_path == made["eval_prompts"] else w.eval_prompts_path,
        ),
    )


def _config_diff(stored: RunConfig, wanted: RunConfig) -> list[str]:
    """Fields (not ``EXECUTION_ONLY``) whose values differ, as ``key: stored -> wanted``."""
    a, b = _flat(to_dict(_as_configured(stored))), _flat(to_dict(wanted))

    def counts(key: str) -> bool:
        return not any(key == e or key.startswith(e + ".") for e in EXECUTION_ONLY)

    keys = [k for k in dict.fromkeys([*a, *b]) if counts(k) and a.get(k) != b.get(k)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


def cell_state(cell: Cell, sweep_path: Path | None = None) -> CellStatus:
    """``done`` (summary.json of a completed or numerics-aborted run), ``partial`` (started, or failed:
    rerun, the pipeline resumes it) or ``pending``. A run directory holding another config raises
    ``SweepError``."""
    run_dir = cell.run_dir
    stored_path = run_dir / names.CONFIG_FILE
    if not stored_path.exists():
        return "pending"
    try:
        stored = load_config(stored_path)
    except (ConfigError, RegistryError) as err:
        raise SweepError(f"cell {cell.key}: cannot read {stored_path}: {err}") from None
    diff = _config_diff(stored, cell.config)
    if diff:
        shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        where = f"sweep {sweep_path}, " if sweep_path else ""
        raise SweepError(
            f"{where}cell {cell.key}: {run_dir} holds a run of another config ({shown}); "
            f"remove that directory to rerun the cell, or give the sweep another output_dir"
        )
    summary = read_summary(run_dir)
    # a run that raised (or was interrupted) writes summary.json too, with status "failed": rerun it (it
    # resumes); one the numerics guard stopped ("aborted") is an outcome of its config, like a completed one
    return "done" if summary is not None and summary.get("status") != names.STATUS_FAILED else "partial"


# --- running ------------------------------------------------------------------------------------------
Runner = Callable[[RunConfig], Any]


def _ray_settings(cfg: RunConfig) -> tuple[Any, ...]:
    """What ``asyncrl.pipeline.init_ray`` starts Ray with: cells can share Ray only if these agree."""
    p = cfg.pipeline
    return (p.ray_address, p.num_cpus, p.data_tick_s)


def cell_resources(cfg: RunConfig) -> dict[str, float]:
    """Logical CPUs (and GPUs) one cell's pipeline reserves: learner workers, generation and scoring
    actors (the driver-side task reserves none)."""
    p = cfg.pipeline
    actors = p.generators + p.teacher_scorers
    need = {"CPU": p.learner_workers * p.cpus_per_worker + actors * p.cpus_per_actor}
    if p.device == "cuda":
        scorers_gpu = p.teacher_scorers if cfg.algo == "opd" else 0
        need["GPU"] = p.learner_workers * p.gpus_per_worker + (p.generators + scorers_gpu) * p.gpus_per_actor
    return need


def _fits(cluster: Mapping[str, float], cells: Sequence[Cell]) -> int:
    """How many of the most demanding cell fit into ``cluster`` at once (at least 1)."""
    most: dict[str, float] = {}
    for cell in cells:
        for k, v in cell_resources(cell.config).items():
            most[k] = max(most.get(k, 0.0), v)
    n = min((int(cluster.get(k, 0.0) // v) for k, v in most.items() if v > 0), default=1)
    return max(1, n)


class _Follower:
    """Feeds ``progress.step`` from the running cells' metrics.jsonl, once a second, in a thread."""

    def __init__(self, progress: Any, interval_s: float = 1.0) -> None:
        from asyncrl.telemetry.progress import MetricsFollower

        self._make = MetricsFollower
        self.progress, self.interval_s = progress, interval_s
        self.cells: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="asyncrl-sweep-progress", daemon=True)
        self._thread.start()

    def add(self, cell: Cell) -> None:
        with self._lock:
            self.cells[cell.key] = self._make(cell.run_dir)

    def remove(self, key: str) -> None:
        with self._lock:
            self.cells.pop(key, None)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                items = list(self.cells.items())
            for key, follower in items:
                try:
                    rows = follower.poll()
                except (OSError, ValueError):  # a file being rewritten by a resume: next poll
                    continue
                if rows and rows[-1].get(names.STEP) is not None:
                    self.progress.step(key, int(rows[-1][names.STEP]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _error_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _run_cell_remote(cfg: RunConfig) -> dict[str, Any]:
    """Body of the Ray task that drives one cell's pipeline (``--parallel``)."""
    import asyncrl

    return asyncrl.run(cfg).summary


def run_sweep(
    sweep: Sweep,
    *,
    runner: Runner | None = None,
    parallel: int = 1,
    progress: Any = None,
    fail_fast: bool = False,
    say: Callable[[str], None] = print,
    only: Iterable[str] | None = None,
) -> dict[str, CellResult]:
    """Run every cell that is not done; returns what happened to each cell, by key.

    Args:
        only: keys of the cells to run (``select_cells``); default every cell. The manifest covers
            every cell either way.
        runner: runs one config (default ``asyncrl.run`` in this process, cells sharing one Ray
            instance when they agree on its settings). A custom runner gets no Ray (tests).
        parallel: cells at a time; > 1 drives each cell's pipeline from its own Ray task, capped at
            what the cluster's resources hold (``cell_resources``).
        progress: a ``GridProgress`` (or anything with its ``start``/``step``/``finish``); None shows nothing.
        fail_fast: stop at the first failed cell (default: run the others, report the failures).
        say: where one-line notes go (a capped ``parallel``, separate Ray instances).

    A failed cell is recorded and the sweep goes on; KeyboardInterrupt stops it (the interrupted
    cell is rerun, and resumed from its checkpoint, next time).
    """
    if parallel < 1:
        raise SweepError(f"--parallel must be >= 1; got {parallel}")
    states = {c.key: cell_state(c, sweep.path) for c in sweep.cells}  # refuses foreign run dirs first
    results: dict[str, CellResult] = {
        c.key: CellResult("skipped") for c in sweep.cells if states[c.key] == "done"
    }
    chosen = None if only is None else set(only)
    todo = [c for c in sweep.cells if states[c.key] != "done" and (chosen is None or c.key in chosen)]
    _write_manifest(sweep, results)
    if not todo:
        return results
    follower = _Follower(progress) if progress is not None else None

    def started(cell: Cell) -> None:
        if progress is not None:
            progress.start(cell.key, cell.config.train.steps)
            follower.add(cell)

    def ended(cell: Cell, result: CellResult) -> None:
        results[cell.key] = result
        _write_manifest(sweep, results)
        if progress is not None:
            follower.remove(cell.key)
            progress.finish(cell.key, ok=result.status == "done", note=result.error or "")

    try:
        if parallel > 1:
            if runner is not None:
                raise SweepError(
                    "parallel cells run as Ray tasks with asyncrl.run; a custom runner runs sequentially"
                )
            _run_parallel(todo, parallel, started, ended, fail_fast, say)
        else:
            _run_sequential(todo, runner, started, ended, fail_fast, say)
    finally:
        if follower is not None:
            follower.close()
    return results


def _run_sequential(
    todo: Sequence[Cell],
    runner: Runner | None,
    started: Callable[[Cell], None],
    ended: Callable[[Cell, CellResult], None],
    fail_fast: bool,
    say: Callable[[str], None],
) -> None:
    import asyncrl

    shared = runner is None and len({_ray_settings(c.config) for c in todo}) == 1
    if runner is None and not shared:
        say("cells differ in pipeline.ray_address / num_cpus / data_tick_s: each starts its own Ray instance")
    run = runner if runner is not None else asyncrl.run
    with _ray_session(todo[0].config) if shared else contextlib.nullcontext():
        for cell in todo:
            started(cell)
            t0 = time.perf_counter()
            try:
                run(cell.config)
            except KeyboardInterrupt:
                raise
            except Exception as err:
                ended(cell, CellResult("failed", time.perf_counter() - t0, _error_line(err)))
                if fail_fast:
                    return
                continue
            ended(cell, CellResult("done", time.perf_counter() - t0))


@contextlib.contextmanager
def _ray_session(cfg: RunConfig) -> Iterator[None]:
    """Start Ray once for the whole grid (``init_ray`` with the first cell's settings) and shut it down
    at the end if this started it; ``asyncrl.run`` joins a running Ray and leaves it up."""
    from asyncrl.pipeline import init_ray

    started = init_ray(cfg)
    try:
        yield
    finally:
        if started:
            import ray

            ray.shutdown()


def _run_parallel(
    todo: Sequence[Cell],
    parallel: int,
    started: Callable[[Cell], None],
    ended: Callable[[Cell, CellResult], None],
    fail_fast: bool,
    say: Callable[[str], None],
) -> None:
    import ray

    if len({_ray_settings(c.config) for c in todo}) != 1:
        raise SweepError(
            "--parallel runs every cell on one Ray instance: the cells must agree on pipeline.ray_address, "
            "pipeline.num_cpus and pipeline.data_tick_s"
        )
    with _ray_session(todo[0].config):
        cluster = ray.cluster_resources()
        fits = _fits(cluster, todo)
        slots = min(parallel, fits, len(todo))
        if slots < min(parallel, len(todo)):
            need = cell_resources(todo[0].config)
            say(
                f"--parallel {parallel}: the Ray cluster ({cluster.get('CPU', 0):g} CPUs) holds {fits} "
                f"cell(s) at once (each reserves {need.get('CPU', 0):g} CPUs); running {slots} at a time"
            )
        task = ray.remote(num_cpus=0, max_retries=0)(_run_cell_remote)
        waiting = list(todo)
        running: dict[Any, tuple[Cell, float]] = {}
        stop = False
        try:
            while waiting or running:
                while waiting and len(running) < slots and not stop:
                    cell = waiting.pop(0)
                    started(cell)
                    running[task.remote(cell.config)] = (cell, time.perf_counter())
                if not running:
                    break
                ready, _ = ray.wait(list(running), num_returns=1)
                cell, t0 = running.pop(ready[0])
                try:
                    ray.get(ready[0])
                except Exception as err:
                    cause = getattr(err, "cause", None) or err
                    ended(cell, CellResult("failed", time.perf_counter() - t0, _error_line(cause)))
                    stop = stop or fail_fast
                    continue
                ended(cell, CellResult("done", time.perf_counter() - t0))
        finally:
            for ref in running:
                ray.cancel(ref, force=True)


# --- outputs ------------------------------------------------------------------------------------------
def _status(cell: Cell, results: Mapping[str, CellResult]) -> tuple[str, str | None]:
    result = results.get(cell.key)
    if result is not None and result.status == "failed":
        return "failed", result.error
    summary = read_summary(cell.run_dir) if (cell.run_dir / names.SUMMARY_FILE).exists() else None
    if summary is not None and summary.get("status") == names.STATUS_FAILED:  # raised: not a result
        return "failed", summary.get("error")
    if summary is not None:  # completed, or aborted by the numerics guard: an outcome, counted
        return "done", None
    return ("partial" if (cell.run_dir / names.CONFIG_FILE).exists() else "pending"), None


def _write_manifest(sweep: Sweep, results: Mapping[str, CellResult]) -> None:
    """``sweep.json``: the sweep's cells, their settings, run directories and statuses (updated after
    every cell, so another process can follow a running sweep)."""
    sweep.output_dir.mkdir(parents=True, exist_ok=True)
    cells = []
    for cell in sweep.cells:
        status, error = _status(cell, results)
        cells.append(
            {
                "key": cell.key,
                "settings": cell.settings,
                "seed": cell.seed,
                "run_dir": str(cell.run_dir),
                "status": status,
                "error": error,
                "overrides": cell.overrides,
            }
        )
    doc = {"name": sweep.name, "sweep_file": str(sweep.path), "base": str(sweep.base), "cells": cells}
    tmp = sweep.output_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(sweep.output_dir / MANIFEST)


def _table_value(cell: Cell, key: str) -> Any:
    """A swept key's value in the tables: as the config resolved it (``3e-4`` written in YAML 1.1 is a
    string, the config's float), mappings and lists as their label; the variant's name."""
    value = cell.settings[key]
    if key != VARIANT:
        node: Any = to_dict(cell.config)
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        value = node if node is not None else value
    return value if value is None or isinstance(value, str | int | float | bool) else value_label(value)


def aggregate_sweep(sweep: Sweep, results: Mapping[str, CellResult] | None = None) -> SweepOutputs:
    """Write the tables, the plots and the HTML report of what the sweep directory holds now (cells
    not done yet are listed with their status and left out of the figures), and ``sweep.json`` for
    every cell of the file (so ``--report-only`` also brings the manifest up to the file)."""
    from asyncrl.lab.sweep_report import write_sweep_report

    results = results or {}
    _write_manifest(sweep, results)
    rows, statuses = [], {}
    for cell in sweep.cells:
        status, error = _status(cell, results)
        statuses[status] = statuses.get(status, 0) + 1
        identity = {
            "cell": cell.key,
            **{k: _table_value(cell, k) for k in cell.settings},
            SEED: cell.seed,
            "status": status,
            "error": error,
            "run_dir": str(cell.run_dir),
        }
        rows.append((identity, cell.run_dir if status == "done" else None))
    intro = [
        ("sweep file", str(sweep.path)),
        ("base config", str(sweep.base)),
        ("directory", str(sweep.output_dir)),
        ("cells", ", ".join(f"{n} {s}" for s, n in statuses.items())),
        ("fixed overrides", _flow(sweep.spec.overrides) or "—"),
        ("grid", _flow(sweep.spec.grid) or "—"),
        ("variants", _flow(sweep.spec.variants) or "—"),
        ("seeds", ", ".join(str(s) for s in dict.fromkeys(c.seed for c in sweep.cells))),
    ]
    agg = sweep.spec.aggregate
    return write_sweep_report(
        sweep.output_dir,
        title=f"asyncrl sweep: {sweep.name}",
        intro=intro,
        cells=rows,
        settings=sweep.swept,
        x=sweep.x,
        group_by=sweep.group_by,
        y=agg.y,
        metrics=agg.metrics,
        curves=agg.curves,
        log_x=agg.log_x,
    )


def _flow(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False).strip() if value else ""
    )
