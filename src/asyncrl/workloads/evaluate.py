"""Greedy exact-match evaluation of a model on task examples, through ``HFEngine``.

Batched: one engine call per ``batch_size`` prompts, temperature 0, no per-row Python loop
inside generation. Used by pretraining (stopping rules, reported accuracy) and, through
``Evaluator``, by the learner's ``eval/accuracy`` on the held-out split.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.workloads.tasks import Example, Task, encode_prompts, get_task

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


def greedy_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
) -> list[str]:
    """Greedy (temperature 0) completions as text, special tokens removed."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            ids, mask = encode_prompts(
                tokenizer, chunk, max_positions=engine.max_positions, max_new_tokens=max_new_tokens
            )
            res = engine.generate(ids, mask, params, seed=0)
            out.extend(tokenizer.batch_decode(res["completion_ids"].tolist(), skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def exact_match(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Fraction of ``examples`` whose greedy completion passes ``task.verify``."""
    if not examples:
        raise ValueError("exact_match needs at least one example")
    texts = greedy_completions(model, tokenizer, [e.prompt for e in examples], max_new_tokens, batch_size)
    return sum(task.verify(c, e.answer) for c, e in zip(texts, examples)) / len(examples)


class Evaluator:
    """Greedy exact match on a run's held-out split (learner rank 0), timed."""

    def __init__(self, cfg: RunConfig, tokenizer: Any, prompts: list[tuple[str, str]]) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.task = get_task(cfg.workload.task)
        self.examples = [Example(prompt=p, answer=a, prompt_id=i) for i, (p, a) in enumerate(prompts)]

    def __call__(self, model: torch.nn.Module) -> tuple[float, float]:
        """(accuracy, seconds it took)."""
        t0 = time.perf_counter()
        acc = exact_match(
            model,
            self.tokenizer,
            self.task,
            self.examples,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            batch_size=64,
        )
        return float(acc), time.perf_counter() - t0


class BackgroundAgreement:
    """The agreement eval (``asyncrl.workloads.agreement``) of a run, in a Ray actor of its own.

    Why an actor: at a real model size one evaluation (two generations of the student, three
    forwards, the teacher loaded once) takes as long as several optimizer steps, and the step-0
    eval used to run before the first step. Here the learner only snapshots its weights
    (``submit``) and goes on; finished results are collected without waiting (``poll``) and logged
    on the step record at which they arrived (``eval/step`` says which version they measured).
    At most one evaluation runs and one waits (the newest request replaces a waiting one; the
    final one is never replaced), so a slow eval thins the curve instead of queueing behind it.
    ``drain`` waits for the rest (the end of the run). The actor asks for no CPU: it must never
    keep a stage or learner from being scheduled, and it runs at one torch thread.
    """

    def __init__(self, cfg: RunConfig, teacher_dir: str, student_dir: str, prompts: list[list[int]]) -> None:
        self._args = (teacher_dir, student_dir, prompts)
        self._kwargs = dict(
            max_new_tokens=int(cfg.sampling.max_new_tokens),
            seed=cfg.seed,
            dtype=cfg.pipeline.teacher_dtype,
            lora=getattr(cfg.train, "lora", None),
        )
        self._actor: Any = None  # started by ``open``: after the first step, not beside it
        self._running: tuple[int, Any] | None = None
        self._waiting: tuple[int, Any, bool] | None = None  # (version, weights ref, final)
        self.eval_time = 0.0

    def submit(
        self,
        version: int,
        model: torch.nn.Module,
        *,
        final: bool = False,
        snapshot: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Evaluate ``model``'s weights as they are now, as version ``version``. ``snapshot``: those
        weights as the learner published them (``coordinator.publishable_state``; nobody mutates it),
        which saves a copy; without one they are copied here."""
        import ray

        if self._waiting is not None and self._waiting[2] and not final:
            return  # a final request waits: keep it
        from asyncrl.coordinator import pack_weights, publishable_state

        # every tensor that defines the policy (a LoRA student's adapters; else the whole state dict),
        # loaded strictly by the actor: keys that differ fail loudly instead of evaluating the checkpoint.
        # Packed as byte buffers: they travel out of band, not through torch's pickling
        state = snapshot if snapshot is not None else publishable_state(model)
        self._waiting = (version, ray.put(pack_weights(state)), final)
        self._start_next()

    def open(self) -> None:
        """Start the actor (a process loading the teacher and a student) and the requests waiting.
        Called once the first optimizer step is done: on a small machine its start-up would
        otherwise take cores from the first step's."""
        if self._actor is None:
            import ray

            self._actor = ray.remote(num_cpus=0)(_AgreementActor).remote(*self._args, **self._kwargs)
        self._start_next()

    def _start_next(self) -> None:
        if self._actor is not None and self._running is None and self._waiting is not None:
            version, ref, _ = self._waiting
            self._waiting = None
            self._running = (version, self._actor.evaluate.remote(version, ref))

    def poll(self, timeout: float = 0.0) -> list[dict[str, Any]]:
        """Finished evaluations (``{"step", "metrics", "seconds", "samples"}``), oldest first."""
        import ray

        out = []
        while self._running is not None:
            ready, _ = ray.wait([self._running[1]], timeout=timeout)
            if not ready:
                break
            out.append(ray.get(ready[0]))
            self._running = None
            self._start_next()
        return out

    def drain(self) -> list[dict[str, Any]]:
        """Wait for every requested evaluation; returns them in order."""
        self.open()
        out: list[dict[str, Any]] = []
        while self._running is not None or self._waiting is not None:
            out += self.poll(timeout=None)
        return out

    def close(self) -> None:
        if self._actor is not None:
            import ray

            ray.kill(self._actor, no_restart=True)


class _AgreementActor:
    """Holds the teacher, a student to load weights into, and the held-out prompts."""

    def __init__(
        self,
        teacher_dir: str,
        student_dir: str,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        seed: int,
        dtype: str = "float32",
        lora: Any = None,
    ) -> None:
        from asyncrl.workloads.agreement import AgreementEvaluator
        from asyncrl.workloads.checkpoints import load_model

        torch.set_num_threads(1)
        teacher, tokenizer = load_model(teacher_dir, role="teacher", dtype=getattr(torch, dtype))
        self.student, _ = load_model(student_dir, role="student")
        self.lora = lora is not None
        if self.lora:  # the learner's LoRA student: the same adapters on the same base weights
            from asyncrl.lora import apply_lora

            self.student = apply_lora(self.student, lora, seed=seed).eval()
        self.evaluator = AgreementEvaluator(
            teacher, tokenizer, prompts, max_new_tokens=max_new_tokens, seed=seed
        )

    def evaluate(self, version: int, packed: Mapping[str, Any]) -> dict[str, Any]:
        from asyncrl.coordinator import unpack_weights

        weights = unpack_weights(packed)
        if self.lora:
            from asyncrl.lora import load_adapter_state

            load_adapter_state(self.student, weights)
        else:
            self.student.load_state_dict(weights, strict=True)
        res = self.evaluator(self.student)
        return {"step": version, "metrics": res.metrics, "seconds": res.seconds, "samples": res.samples}
