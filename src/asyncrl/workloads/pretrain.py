"""Supervised pretraining of the built-in teacher and student, cached on disk.

``pretrain(task, preset)`` trains a teacher to >= 95 % greedy exact match on the task's eval
split and a deliberately weaker student (a smaller model stopped early, at roughly 20-50 %),
so on-policy distillation has a real gap to close. Both are saved as plain HF checkpoints
under ``cache_dir/<task>-<preset>-s<seed>/{teacher,student}`` and reused by later calls.

Objective (teacher forcing on ``<bos> prompt answer <eos>``, loss on answer + EOS only):
    L(theta) = - mean over answer tokens y_t of log pi_theta(y_t | <bos>, prompt, y_<t)
Sequences are right-padded and run without an attention mask: under causal attention no
valid token sees the trailing pads, and their positions are excluded from the loss.

Stopping rules (evaluated every ``eval_every`` steps on the eval split, greedy): the teacher
stops once accuracy >= ``stop_at``; the student stops at the first accuracy in
``[stop_at, cap]``, else the evaluated snapshot closest to that band is kept. Deterministic
given the seed (single-process CPU training).
"""

from __future__ import annotations

import copy
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.workloads.checkpoints import load_pair, missing_parts, read_meta, save_checkpoint
from asyncrl.workloads.evaluate import exact_match
from asyncrl.workloads.presets import Preset, Schedule, build_model, get_preset, num_parameters
from asyncrl.workloads.tasks import Example, Task, get_task
from asyncrl.workloads.tokenizer import char_tokenizer

__all__ = ["PretrainResult", "exact_match", "load_pair", "pretrain", "run_dir_for", "train_supervised"]

TRAIN_POOL = 16384  # distinct training draws per run; batches are sampled from this pool


@dataclass(frozen=True)
class PretrainResult:
    """Where the pair lives and how good it is. ``reused``: loaded from the cache, not trained."""

    teacher_dir: Path
    student_dir: Path
    teacher_accuracy: float
    student_accuracy: float
    wall_time_s: float
    reused: bool = False
    teacher_steps: int = 0
    student_steps: int = 0


def run_dir_for(task: str, preset: str, seed: int, cache_dir: str | Path = ".asyncrl_cache") -> Path:
    """``cache_dir/<task>-<preset>-s<seed>``: where ``pretrain`` puts (and looks for) a pair."""
    return Path(cache_dir) / f"{task}-{preset}-s{seed}"


def pretrain(
    task: str = "addition",
    preset: str = "small",
    cache_dir: str | Path = ".asyncrl_cache",
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
) -> PretrainResult:
    """Train (or reuse) the teacher/student pair for ``task`` with ``preset``; see the module doc."""
    t0 = time.perf_counter()
    task_obj, preset_obj = get_task(task), get_preset(preset)
    root = run_dir_for(task_obj.name, preset_obj.name, seed, cache_dir)
    teacher_dir, student_dir = root / "teacher", root / "student"
    log = _printer(progress)

    if (
        not force
        and not missing_parts(teacher_dir, require_meta=True)
        and not missing_parts(student_dir, require_meta=True)
        and _fingerprint_matches(read_meta(teacher_dir), preset_obj.teacher, preset_obj.teacher_schedule)
        and _fingerprint_matches(read_meta(student_dir), preset_obj.student, preset_obj.student_schedule)
    ):
        tm, sm = read_meta(teacher_dir), read_meta(student_dir)
        log(
            f"reusing {root} (teacher {tm['accuracy']:.3f}, student {sm['accuracy']:.3f}); "
            "force=True retrains"
        )
        return PretrainResult(
            teacher_dir,
            student_dir,
            float(tm["accuracy"]),
            float(sm["accuracy"]),
            time.perf_counter() - t0,
            reused=True,
            teacher_steps=int(tm.get("steps", 0)),
            student_steps=int(sm.get("steps", 0)),
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and faster than 2 threads for models this small
    try:
        return _pretrain(task_obj, preset_obj, root, seed, log, t0, show=progress)
    finally:
        torch.set_num_threads(threads)


def _pretrain(
    task_obj: Task, preset_obj: Preset, root: Path, seed: int, log: Any, t0: float, *, show: bool = True
) -> PretrainResult:
    from asyncrl.telemetry.progress import SUPERVISED_FIELDS, Progress

    teacher_dir, student_dir = root / "teacher", root / "student"
    tokenizer = char_tokenizer()
    train = task_obj.make_examples("train", TRAIN_POOL, seed)
    evals = task_obj.make_examples("eval", preset_obj.eval_size, seed)
    results = {}
    for role, spec, schedule, model_seed in (
        ("teacher", preset_obj.teacher, preset_obj.teacher_schedule, seed),
        ("student", preset_obj.student, preset_obj.student_schedule, seed + 1),
    ):
        model = build_model(spec, len(tokenizer), model_seed)
        log(
            f"{role}: {spec.arch} {num_parameters(model) / 1e6:.2f}M params, up to {schedule.max_steps} steps"
        )
        ts = time.perf_counter()
        with Progress(
            schedule.max_steps, enabled=show, title=f"pretrain {role}", fields=SUPERVISED_FIELDS
        ) as bar:
            model, acc, steps = train_supervised(
                model,
                tokenizer,
                task_obj,
                train,
                evals,
                schedule,
                seed=model_seed,
                stop="reach" if role == "teacher" else "band",
                progress=bar,
            )
        meta = _meta(task_obj, preset_obj, role, spec, schedule, seed, acc, steps, time.perf_counter() - ts)
        save_checkpoint(model, tokenizer, root / role, meta)
        log(
            f"{role}: accuracy {acc:.3f} after {steps} steps "
            f"({time.perf_counter() - ts:.1f}s) -> {root / role}"
        )
        results[role] = (acc, steps)
    (root / "pretrain.json").write_text(
        json.dumps({r: {"accuracy": a, "steps": s} for r, (a, s) in results.items()}, indent=2) + "\n"
    )
    if results["teacher"][0] < 0.95:
        log(f"warning: teacher accuracy {results['teacher'][0]:.3f} < 0.95; consider a larger preset")
    band = preset_obj.student_schedule
    if not band.stop_at <= results["student"][0] <= band.cap:
        log(
            f"warning: student accuracy {results['student'][0]:.3f} is outside the target band "
            f"[{band.stop_at}, {band.cap}]; the closest evaluated snapshot was kept"
        )
    return PretrainResult(
        teacher_dir,
        student_dir,
        results["teacher"][0],
        results["student"][0],
        time.perf_counter() - t0,
        teacher_steps=results["teacher"][1],
        student_steps=results["student"][1],
    )


def train_supervised(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    train: list[Example],
    evals: list[Example],
    schedule: Schedule,
    *,
    seed: int,
    stop: str = "reach",
    progress: Any = None,
) -> tuple[torch.nn.Module, float, int]:
    """Teacher-forced training with the stopping rule ``stop`` ("reach" or "band").

    Returns ``(model, eval accuracy, steps)``; for "band" the model is the kept snapshot.
    ``progress`` (an ``asyncrl.telemetry.progress.Progress``) gets the loss every step and the
    eval accuracy at every eval.
    """
    from asyncrl.telemetry import names

    ids, labels = _encode_supervised(tokenizer, train)  # [N, L] each
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, schedule))
    max_new = task.max_answer_chars + 1
    best: tuple[float, float, int, dict[str, torch.Tensor] | None] = (math.inf, 0.0, 0, None)
    order = torch.randperm(len(ids), generator=gen)
    cursor = 0
    model.train()
    acc, step = 0.0, 0
    for step in range(1, schedule.max_steps + 1):
        if cursor + schedule.batch_size > len(order):
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        idx = order[cursor : cursor + schedule.batch_size]
        cursor += schedule.batch_size
        x, y = ids[idx], labels[idx]
        width = int((x != tokenizer.pad_token_id).sum(1).max())  # trim to the longest row
        x, y = x[:, :width], y[:, :width]
        logits = model(input_ids=x, use_cache=False).logits[:, :-1]  # [b, L-1, V] scores tokens 1..L-1
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % schedule.eval_every and step != schedule.max_steps:
            if progress is not None:
                progress.update(step, {names.LOSS: loss.item()})
            continue
        acc = exact_match(model, tokenizer, task, evals, max_new)
        if progress is not None:
            progress.update(step, {names.LOSS: loss.item(), names.EVAL_ACCURACY: acc})
        if stop == "reach":
            if acc >= schedule.stop_at:
                break
            continue
        distance = max(schedule.stop_at - acc, acc - schedule.cap, 0.0)
        if distance == 0.0:
            return model.eval(), acc, step
        if distance <= best[0]:  # ties keep the later (more trained) snapshot
            best = (distance, acc, step, copy.deepcopy(model.state_dict()))
        if acc > schedule.cap:  # overshot the band: later snapshots only get stronger
            break
    if stop == "band" and best[3] is not None:
        model.load_state_dict(best[3])
        return model.eval(), best[1], best[2]
    return model.eval(), acc, step


def _lr_factor(step: int, schedule: Schedule) -> float:
    """Linear warmup, then cosine decay from 1 to ``schedule.final_lr_frac`` at ``max_steps``."""
    if step < schedule.warmup:
        return (step + 1) / schedule.warmup
    frac = min(1.0, (step - schedule.warmup) / max(1, schedule.max_steps - schedule.warmup))
    lo = schedule.final_lr_frac
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _encode_supervised(tokenizer: Any, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """``<bos> prompt answer <eos>`` right-padded ids [N, L] and labels (-100 outside answer+EOS)."""
    prompts = tokenizer([e.prompt for e in examples], add_special_tokens=True)["input_ids"]
    answers = tokenizer([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    L = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers))
    ids = torch.full((len(examples), L), tokenizer.pad_token_id, dtype=torch.int64)
    labels = torch.full((len(examples), L), -100, dtype=torch.int64)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq = [*p, *a, tokenizer.eos_token_id]
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = ids[i, len(p) : len(seq)]
    return ids, labels


def _fingerprint_matches(meta: dict[str, Any], spec: Any, schedule: Schedule) -> bool:
    """A cached model is reused only if it was built from the preset as it is now (a changed preset
    or schedule would otherwise silently serve stale checkpoints)."""
    return meta.get("model") == asdict(spec) and meta.get("schedule") == asdict(schedule)


def _meta(
    task: Task,
    preset: Preset,
    role: str,
    spec: Any,
    schedule: Schedule,
    seed: int,
    acc: float,
    steps: int,
    seconds: float,
) -> dict[str, Any]:
    import transformers

    from asyncrl import __version__

    return {
        "role": role,
        "task": task.name,
        "preset": preset.name,
        "seed": seed,
        "accuracy": acc,
        "steps": steps,
        "train_seconds": round(seconds, 2),
        "model": asdict(spec),
        "schedule": asdict(schedule),
        "eval_size": preset.eval_size,
        "versions": {
            "asyncrl": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }


def _printer(progress: bool):
    def log(msg: str) -> None:
        if progress:
            print(f"[pretrain] {msg}", file=sys.stderr, flush=True)

    return log
