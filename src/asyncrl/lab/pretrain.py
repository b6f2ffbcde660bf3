"""Supervised pretraining of the built-in teacher and student, cached on disk.

``pretrain(task, preset)`` trains a teacher to its ``stop_at`` greedy exact match on the task's
eval split (0.97 for the char presets) and a deliberately weaker student (a smaller model
stopped early, inside a band such as 20-50 %), so on-policy distillation has a real gap to
close. Both are saved as plain HF checkpoints under
``cache_dir/<task>-<preset>-s<seed>/{teacher,student}`` and reused by later calls (each role
by its own fingerprint: model spec, schedule, tokenizer).

Objective (teacher forcing on ``prompt answer <eos>``, loss on answer + EOS only; the prompt
tokens are ``<bos>`` + text for the char tokenizer, a ChatML user turn for Qwen's):
    L(theta) = - mean over answer tokens y_t of log pi_theta(y_t | prompt, y_<t)
Sequences are right-padded and run without an attention mask: under causal attention no
valid token sees the trailing pads, and their positions are excluded from the loss.

Prompts are encoded as every consumer encodes them (``tasks.prompt_token_ids``: through the
tokenizer's chat template when it has one), and generation budgets are the task's longest
answer in tokens + EOS (``tasks.answer_token_budget``).

Stopping rules (evaluated every ``eval_every`` steps on the eval split, greedy): the teacher
stops once accuracy >= ``stop_at``; the student stops at the first accuracy in ``[stop_at, cap]``.
Exact match on long answers rises steeply (all tokens must be right), so it can jump over the
band between two evaluations: the student's weights after every step since the last evaluation
are kept, and on an overshoot they are bisected for the earliest step inside the band. A teacher below
``stop_at`` or a student that never lands in the band raises ``PretrainError`` naming the preset
knob to change; nothing outside the target is cached. Deterministic given the seed
(single-process CPU training).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.lab.presets import Preset, Schedule, build_model, get_preset, num_parameters
from asyncrl.tied import copy_once
from asyncrl.workloads.checkpoints import load_pair, missing_parts, read_meta, run_dir_for, save_checkpoint
from asyncrl.workloads.evaluate import exact_match
from asyncrl.workloads.models import workload_tokenizer
from asyncrl.workloads.tasks import Example, Task, answer_token_budget, get_task, prompt_token_ids
from asyncrl.workloads.tokenizer import TOKENIZERS

__all__ = [
    "PretrainError",
    "PretrainResult",
    "exact_match",
    "load_pair",
    "pretrain",
    "run_dir_for",
    "train_supervised",
    "workload_tokenizer",
]

TRAIN_POOL = 16384  # distinct training draws per run; batches are sampled from this pool
#: above this vocabulary the LM head runs only at the supervised positions (answer + EOS): at
#: V = 151,936 full [B, L, V] logits (and their gradient) would dominate time and memory. Below it
#: the full head runs, which keeps the trained-and-cached small-vocabulary pairs bit-identical.
SPARSE_HEAD_MIN_VOCAB = 4096


class PretrainError(RuntimeError):
    """A pretrained model missed its target; the message names the preset knob to change."""


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
    task_obj = get_task(task)
    try:
        preset_obj = get_preset(preset).for_task(task_obj.name)
    except ValueError as err:
        raise PretrainError(str(err)) from None
    root = run_dir_for(task_obj.name, preset_obj.name, seed, cache_dir)
    teacher_dir, student_dir = root / "teacher", root / "student"
    log = _printer(progress)
    # one trainer per pair: a concurrent caller (a second `asyncrl pretrain`, a test fixture while the
    # test command warms the cache in the background) waits here, then reuses what the first cached
    with cache_lock(root):
        cached = {
            role: not force
            and not missing_parts(root / role, require_meta=True)
            and _fingerprint_matches(read_meta(root / role), preset_obj, role)
            for role in ("teacher", "student")
        }
        if all(cached.values()):
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
            return _pretrain(task_obj, preset_obj, root, seed, log, t0, cached, show=progress)
        finally:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def cache_lock(root: Path) -> Any:
    """An exclusive lock on one pair's cache entry (``CACHE/.locks/<entry>.lock``, beside the entry so a
    refused or failed pretraining leaves the entry itself absent), held while it is checked and trained."""
    locks = root.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{root.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pretrain(
    task_obj: Task,
    preset_obj: Preset,
    root: Path,
    seed: int,
    log: Any,
    t0: float,
    cached: dict[str, bool],
    *,
    show: bool = True,
) -> PretrainResult:
    """Train the roles not ``cached`` (a teacher that is, e.g. after a student missed its band and
    its schedule was changed, is reused: each role has its own fingerprint); ``show`` draws a
    progress row per trained role."""
    from asyncrl.telemetry.progress import SUPERVISED_FIELDS, Progress

    teacher_dir, student_dir = root / "teacher", root / "student"
    builtin = TOKENIZERS.get(preset_obj.tokenizer)
    tokenizer = builtin.build()
    ids = {
        "pad_id": tokenizer.pad_token_id,
        "bos_id": tokenizer.bos_token_id,
        "eos_id": tokenizer.eos_token_id,
    }
    train = task_obj.make_examples("train", TRAIN_POOL, seed)
    evals = task_obj.make_examples("eval", preset_obj.eval_size, seed)
    where = f"`asyncrl pretrain --task {task_obj.name} --preset {preset_obj.name}`"
    results = {}
    for role, spec, schedule, model_seed in (
        ("teacher", preset_obj.teacher, preset_obj.teacher_schedule, seed),
        ("student", preset_obj.student, preset_obj.student_schedule, seed + 1),
    ):
        if cached[role]:
            meta = read_meta(root / role)
            results[role] = (float(meta["accuracy"]), int(meta.get("steps", 0)))
            log(f"{role}: reusing {root / role} (accuracy {results[role][0]:.3f})")
            continue
        model = build_model(spec, builtin.vocab_size(tokenizer), model_seed, **ids)
        log(
            f"{role}: {spec.arch} {num_parameters(model) / 1e6:.2f}M params, up to {schedule.max_steps} steps"
        )
        ts = time.perf_counter()
        try:
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
                    log=log,
                    progress=bar,
                )
        except PretrainError as err:
            raise PretrainError(f"{where}: {err} (asyncrl/lab/presets.py, Preset.per_task)") from None
        if role == "teacher" and acc < schedule.stop_at:
            raise PretrainError(
                f"{where}: the teacher reached exact match {acc:.3f} < teacher_schedule.stop_at="
                f"{schedule.stop_at} after {steps} steps; raise teacher_schedule.max_steps or use a larger "
                f"teacher (asyncrl/lab/presets.py, Preset.per_task)"
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
    log: Any = None,
    progress: Any = None,
) -> tuple[torch.nn.Module, float, int]:
    """Teacher-forced training with the stopping rule ``stop`` ("reach" or "band").

    Returns ``(model, eval accuracy, steps)``; for "band" the model is the step found inside
    ``[stop_at, cap]`` (``PretrainError`` when there is none, naming the knob to change).
    ``progress`` (an ``asyncrl.telemetry.progress.Progress``) gets the loss every step and the
    eval accuracy at every eval; without one, ``log`` gets a line per eval. ``log`` also gets
    the band bisection's evaluations.
    """
    from asyncrl.telemetry import names

    log = log or (lambda msg: None)

    ids, labels = _encode_supervised(tokenizer, train)  # [N, L] each
    gen = torch.Generator().manual_seed(seed)
    # foreach: each elementwise op over all tensors at once instead of a loop per parameter (torch's
    # CPU default), bit for bit the same update, 3x cheaper here (a `qwen-tiny` teacher step: 0.060 ->
    # 0.021 s of 0.43 s; its tied 151,936 x 64 embedding is most of the parameters). Not fused=True
    # (0.007 s): its rounding differs, and the tiny student then stayed under its band (0.098 after
    # 1,200 steps; 0.213 at 875 with this update), so every cached pair would change
    opt = torch.optim.AdamW(
        model.parameters(), lr=schedule.lr, betas=(0.9, 0.98), weight_decay=0.0, foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, schedule))
    max_new = answer_token_budget(task, tokenizer)
    sparse_head = model.get_output_embeddings().weight.shape[0] >= SPARSE_HEAD_MIN_VOCAB

    def accuracy() -> float:
        return exact_match(model, tokenizer, task, evals, max_new)

    # band: weights after every step since the last evaluation (bisected on an overshoot)
    since_eval: list[tuple[int, dict[str, torch.Tensor]]] = []
    below = (0, 0.0)  # last evaluated (step, accuracy) under the band
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
        width = int((y != -100).nonzero()[:, 1].max()) + 1  # trim to the longest row (its EOS)
        x, y = x[:, :width], y[:, :width]
        loss = _supervised_loss(model, x, y, sparse_head)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if stop == "band":
            since_eval.append((step, _snapshot(model)))
        if step % schedule.eval_every and step != schedule.max_steps:
            if progress is not None:
                progress.update(step, {names.LOSS: loss.item()})
            continue
        acc = accuracy()
        if progress is not None:
            progress.update(step, {names.LOSS: loss.item(), names.EVAL_ACCURACY: acc})
        else:
            log(f"  step {step:5d} loss {loss.item():.4f} eval exact-match {acc:.3f}")
        if stop == "reach":
            if acc >= schedule.stop_at:
                break
            continue
        if schedule.stop_at <= acc <= schedule.cap:
            return model.eval(), acc, step
        if acc > schedule.cap:  # overshot between two evaluations: bisect the steps in between
            return _bisect_band(model, since_eval[:-1], accuracy, schedule, below, (step, acc), log)
        below = (step, acc)
        since_eval.clear()
    if stop == "band":
        raise PretrainError(
            f"the student reached exact match {acc:.3f} after student_schedule.max_steps={step}, below "
            f"the band [{schedule.stop_at}, {schedule.cap}]; raise student_schedule.max_steps or "
            f"student_schedule.lr, or give the student more capacity"
        )
    return model.eval(), acc, step


def _supervised_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, sparse_head: bool
) -> torch.Tensor:
    """Mean cross-entropy of the labelled next tokens (``y[:, 1:]``, -100 = unlabelled).

    ``sparse_head``: run the LM head only at the labelled positions (the decoder's last hidden
    states gathered first): the same loss without the [b, L, V] logits of a large vocabulary.
    """
    target = y[:, 1:]  # position t scores token t + 1
    if not sparse_head:
        logits = model(input_ids=x, use_cache=False).logits[:, :-1]  # [b, L-1, V]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
        )
    hidden = model.get_decoder()(input_ids=x, use_cache=False).last_hidden_state[:, :-1]  # [b, L-1, h]
    keep = target != -100
    logits = model.get_output_embeddings()(hidden[keep])  # [n, V] at the n labelled positions
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state, tied weights copied once (``asyncrl.tied.copy_once``): a `qwen-tiny`
    student's tied 151,936-row embedding and LM head are one tensor under two keys (half its state),
    copied every step of the band search (``load_state_dict`` writes the one copy into the one parameter)."""
    return copy_once(model.state_dict(), lambda v: v.detach().clone())


def _bisect_band(
    model: torch.nn.Module,
    snapshots: list[tuple[int, dict[str, torch.Tensor]]],
    accuracy: Any,
    schedule: Schedule,
    below: tuple[int, float],
    above: tuple[int, float],
    log: Any,
) -> tuple[torch.nn.Module, float, int]:
    """The earliest step strictly between ``below`` and ``above`` with accuracy >= ``stop_at``, if it
    is inside the band (so the student is as weak as the band allows: room for distillation).

    Exact match is close to monotone over a few steps of a rising curve, so bisection finds the
    crossing in log2(steps) evaluations.
    """
    lo, hi = 0, len(snapshots)  # the crossing is snapshots[lo:hi] or `above`
    found: tuple[int, float, dict[str, torch.Tensor]] | None = None
    while lo < hi:
        mid = (lo + hi) // 2
        step, weights = snapshots[mid]
        model.load_state_dict(weights)
        acc = accuracy()
        log(f"  step {step:5d} (bisecting an overshoot) eval exact-match {acc:.3f}")
        if acc >= schedule.stop_at:
            hi, above, found = mid, (step, acc), (step, acc, weights)
        else:
            lo, below = mid + 1, (step, acc)
    if found is not None and found[1] <= schedule.cap:
        model.load_state_dict(found[2])
        return model.eval(), found[1], found[0]
    raise PretrainError(
        f"the student jumped over the band [{schedule.stop_at}, {schedule.cap}] in one step (exact match "
        f"{below[1]:.3f} at step {below[0]}, {above[1]:.3f} at step {above[0]}); lower student_schedule.lr "
        f"or widen the band (student_schedule.stop_at / cap)"
    )


def _lr_factor(step: int, schedule: Schedule) -> float:
    """Linear warmup, then cosine decay from 1 to ``schedule.final_lr_frac`` at ``max_steps``."""
    if step < schedule.warmup:
        return (step + 1) / schedule.warmup
    frac = min(1.0, (step - schedule.warmup) / max(1, schedule.max_steps - schedule.warmup))
    lo = schedule.final_lr_frac
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _encode_supervised(tokenizer: Any, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompt answer <eos>`` right-padded ids [N, L] and labels (-100 outside answer+EOS).

    The prompt is encoded as the engine will see it (``prompt_token_ids``: ``<bos>`` + text for
    the char tokenizer, the chat template's user turn and assistant header for Qwen's)."""
    prompts = prompt_token_ids(tokenizer, [e.prompt for e in examples])
    answers = tokenizer([e.answer for e in examples], add_special_tokens=False)["input_ids"]
    L = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers))
    ids = torch.full((len(examples), L), tokenizer.pad_token_id, dtype=torch.int64)
    labels = torch.full((len(examples), L), -100, dtype=torch.int64)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq = [*p, *a, tokenizer.eos_token_id]
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = ids[i, len(p) : len(seq)]
    return ids, labels


def _fingerprint_matches(meta: dict[str, Any], preset: Preset, role: str) -> bool:
    """A cached model is reused only if it was built from the preset as it is now (a changed preset,
    schedule or tokenizer would otherwise silently serve stale checkpoints). Metas written before
    presets named a tokenizer were all ``char``."""
    spec, schedule = getattr(preset, role), getattr(preset, f"{role}_schedule")
    return (
        meta.get("model") == asdict(spec)
        and meta.get("schedule") == asdict(schedule)
        and meta.get("tokenizer", "char") == preset.tokenizer
    )


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
        "tokenizer": preset.tokenizer,
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
