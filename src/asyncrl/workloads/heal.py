"""Healing a pruned student: offline distillation on the teacher's own responses, before any OPD.

Why: a student made by dropping most of a teacher's layers (``real.prune_layers``) keeps the
teacher's vocabulary and token geometry but not its computation: its greedy responses are a
repeated word-piece, and a few on-policy steps from there teach it to repeat one token (the teacher
finds the next repeat likely), not to answer. Pruning papers *heal* the pruned model by
distillation before using it; this is that step, sized for a CPU: a fixed corpus of the teacher's
sampled responses, and word-level knowledge distillation on it (Hinton et al. 2015; Kim & Rush
2016), the off-policy end of the spectrum OPD sits on.

The math. Responses are drawn once, y ~ p(· | x) at temperature τ_h, for prompts x of the train
split, and the student q_θ is fitted by full-vocabulary forward KL, teacher-forced on them:

    L(θ) = Σ_{x,y} Σ_t KL( p(· | x, y_<t) ‖ q_θ(· | x, y_<t) ) / Σ_{x,y} |y|

(the token-mean over each batch; the teacher's p is recomputed per batch, not stored: 49k logits per
token do not fit a cache). Its minimiser is the teacher on the states the teacher visits, which is
where an answering student must be close before on-policy training can refine it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: a preset's HealSpec is read without it
    import torch

    #: one corpus batch: prompt ids, prompt mask, response ids, response mask (left-padded prompts)
    Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class HealSpec:
    """How a real preset heals its pruned student (``heal``); every field is recorded in its meta.

    Args:
        prompts: train-split prompts whose teacher responses form the corpus (the first ones).
        epochs: passes over the corpus.
        lr: AdamW learning rate (constant; no weight decay).
        batch_size: prompts per step (and per generation batch).
        max_new_tokens: the teacher's response budget (the preset's runs use 64).
        temperature: τ_h, the teacher's sampling temperature for the corpus (< 1: fewer of the
            rare tokens a 135M teacher samples at 1.0, which the student would be fitted to).
        seed: the corpus draws and the batch order.
        clip: gradient-norm clip.
    """

    prompts: int = 1024
    epochs: int = 3
    lr: float = 3e-4
    batch_size: int = 16
    max_new_tokens: int = 64
    temperature: float = 0.7
    seed: int = 0
    clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prompts", "epochs", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"HealSpec.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"HealSpec.lr must be > 0, got {self.lr}")
        if not self.temperature > 0:
            raise ValueError(
                f"HealSpec.temperature must be > 0 (the corpus is sampled), got {self.temperature}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def teacher_corpus(
    teacher: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
) -> list[Batch]:
    """The teacher's sampled responses to ``prompts``, batched as they will be trained on.

    Batch i is drawn with seed ``seed + i``, so the corpus is a function of (teacher, prompts, seed)."""
    import torch

    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.hf import HFEngine
    from asyncrl.workloads.agreement import left_pad

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = HFEngine(teacher.eval(), tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    corpus: list[Batch] = []
    with torch.no_grad():
        for i, start in enumerate(range(0, len(prompts), batch_size)):
            ids, mask = left_pad([list(p) for p in prompts[start : start + batch_size]], int(pad))
            res = engine.generate(ids, mask, params, seed=seed + i)
            corpus.append((ids, mask, res["completion_ids"], res["completion_mask"]))
    return corpus


def forward_kl_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Token-mean of KL(p ‖ q_θ) over the full vocabulary: ``[B, T, V]`` logits, ``[B, T]`` mask
    (the estimators' exact E1, ``forward_kl_dense``, averaged over the response's tokens)."""
    from asyncrl.estimators.functional import forward_kl_dense
    from asyncrl.logratio import masked_mean

    return masked_mean(forward_kl_dense(student_logits, teacher_logits), mask)


def heal(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    corpus: Sequence[Batch],
    *,
    epochs: int,
    lr: float,
    seed: int,
    clip: float = 1.0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fit ``student`` to ``teacher`` on ``corpus`` by ``L(θ)`` (module docstring), in place.

    Returns what a checkpoint's meta records: tokens per epoch, the mean loss of each epoch (as
    trained: each batch's loss before its step), steps and seconds."""
    import torch

    from asyncrl import records as R

    if not corpus:
        raise ValueError("heal needs a non-empty corpus")
    teacher.eval()
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    epoch_loss: list[float] = []
    tokens = int(sum(int(b[3].sum()) for b in corpus))
    steps = 0
    try:
        for epoch in range(epochs):
            total, weight = 0.0, 0.0
            for j in torch.randperm(len(corpus), generator=gen).tolist():
                ids, mask, y, ym = corpus[j]
                with torch.no_grad():
                    p = R.completion_logits(teacher, ids, mask, y, ym)
                q = R.completion_logits(student, ids, mask, y, ym)
                loss = forward_kl_loss(q, p, ym)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(student.parameters(), clip)
                opt.step()
                steps += 1
                n = float(ym.sum())
                total, weight = total + float(loss.detach()) * n, weight + n
            epoch_loss.append(total / max(weight, 1.0))
            if log is not None:
                log(
                    f"healing: epoch {epoch + 1}/{epochs}, KL(teacher||student) {epoch_loss[-1]:.3f} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
    finally:
        student.eval()
    return {
        "corpus_tokens": tokens,
        "epoch_loss": [round(v, 6) for v in epoch_loss],
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
    }
