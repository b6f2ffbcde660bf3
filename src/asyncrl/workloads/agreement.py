"""Evaluation without a verifier: how close a student is to its teacher on held-out prompts.

Chat prompts have no reference answer to check, so the eval measures what distillation
optimises. With p the teacher's and q = π_θ the student's next-token distribution (full
vocabulary, temperature 1) at the positions of the student's **own samples** y ~ q:

* ``kl_forward``  = (1/N) Σ_t KL(p_t ‖ q_t) = (1/N) Σ_t Σ_v p_t(v) (log p_t(v) − log q_t(v))
* ``kl_reverse``  = (1/N) Σ_t KL(q_t ‖ p_t), the objective of on-policy distillation; its
  expectation over y ~ q is the sequence-level reverse KL per token
* ``top1_agree``  = (1/N) Σ_t 1[argmax p_t = argmax q_t]

where N counts every valid completion token of every prompt (a token mean: long responses weigh
more, as in the training loss). Both KLs are exact sums over the vocabulary, not estimates; only
the states y_<t are sampled (one draw per prompt, seeded, so two evaluations of one student see
the same random numbers). On the student's **greedy** response ŷ:

* ``teacher_nll`` = −(1/N̂) Σ_t log p(ŷ_t | x, ŷ_<t): how plausible the teacher finds what the
  student would answer (per token; the teacher's own greedy response is a lower reference)
* ``rouge_l``     = mean over prompts of ROUGE-L F1 between ŷ's text and the teacher's greedy
  response's text (``rouge_score``, the reference implementation's longest common subsequence
  over words).
* ``distinct_2``  = distinct token bigrams / all token bigrams over the student's greedy responses
  (distinct-n, Li et al. 2016, corpus level): near 0 when responses repeat one token or pattern.

On the teacher's **own greedy response** r (teacher-forced, the student's states are the
teacher's; N_r its tokens):

* ``kl_forward_ref`` = (1/N_r) Σ_t KL(p_t ‖ q_t) at the states x, r_<t
* ``top1_agree_ref`` = (1/N_r) Σ_t 1[argmax q_t = argmax p_t]; r is greedy, so argmax p_t = r_t
  and this is the student's next-token accuracy on the teacher's response

Why both families. The first family is measured where the student goes, so it is what on-policy
distillation minimises, and it can be lowered by a student that moves to states where the teacher
is easy to agree with: a response that repeats one token makes the teacher confident the
repetition goes on (low ``kl_reverse`` and ``teacher_nll``, high ``top1_agree``). The reference
family is measured where the teacher goes and cannot be lowered that way; ``distinct_2`` names the
degeneration when it happens.

``token_agreement`` and ``sequence_nll`` are the pure math; ``AgreementEvaluator`` runs the
generations and forwards for a list of prompts (no Ray: the pipeline runs it in its own actor,
``asyncrl.workloads.evaluate``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl import records as R
from asyncrl.engines.base import SamplingParams

#: the metric keys ``AgreementEvaluator`` returns (``eval/<name>`` in metrics.jsonl)
METRICS = (
    "kl_forward", "kl_reverse", "top1_agree", "teacher_nll", "rouge_l", "distinct_2", "kl_forward_ref",
    "top1_agree_ref",
)  # fmt: skip


def token_agreement(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over the valid positions of ``mask`` [B, T] of KL(p‖q), KL(q‖p) and 1[argmax p = argmax q].

    ``student_logits`` / ``teacher_logits``: [B, T, V] (aligned to the same completion tokens).
    Computed in float64 one row at a time (a row's [T, V] is what is held at once). Returns
    ``{"kl_forward", "kl_reverse", "top1_agree", "tokens"}`` as float64 scalars (sums, not means:
    the caller divides by the total token count over all batches)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs "
            f"{tuple(teacher_logits.shape)} (one vocabulary and the same completion tokens are needed)"
        )
    m = mask.bool()
    out = {k: torch.zeros((), dtype=torch.float64) for k in ("kl_forward", "kl_reverse", "top1_agree")}
    for b in range(student_logits.shape[0]):
        valid = m[b]
        if not valid.any():
            continue
        lq = torch.log_softmax(student_logits[b][valid].double(), -1)  # [n, V]
        lp = torch.log_softmax(teacher_logits[b][valid].double(), -1)
        diff = lp - lq
        out["kl_forward"] += (lp.exp() * diff).sum()
        out["kl_reverse"] += (lq.exp() * -diff).sum()
        out["top1_agree"] += (lp.argmax(-1) == lq.argmax(-1)).double().sum()
    out["tokens"] = m.sum().double()
    return out


def sequence_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(Σ −log p(ids), valid token count) over ``mask`` [B, T]; ``logits`` [B, T, V] aligned to ``ids``."""
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    m = mask.bool()
    return float(-(logp * m).sum()), float(m.sum())


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F1 of each prediction against its reference (``rouge_score``, no stemming).

    Two empty texts agree (1.0); one empty text against a non-empty one scores 0."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"rouge_l: {len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("rouge_l needs at least one prediction")
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    total = 0.0
    for pred, ref in zip(predictions, references):
        if not pred.strip() and not ref.strip():
            total += 1.0
            continue
        total += scorer.score(ref, pred)["rougeL"].fmeasure
    return total / len(predictions)


def distinct_n(sequences: Sequence[Sequence[int]], n: int = 2) -> float:
    """Distinct n-grams / all n-grams over ``sequences`` (token ids; corpus level, Li et al. 2016).

    1.0 when no n-gram repeats; 1 / (total) when every response repeats one token. No n-gram at
    all (every sequence shorter than ``n``) reads 0.0: there is no variety to credit."""
    if n < 1:
        raise ValueError(f"distinct_n: n must be >= 1, got {n}")
    grams = [tuple(seq[i : i + n]) for seq in sequences for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> left-padded ``prompt_ids`` [B, P] int64 and ``prompt_mask`` [B, P] bool."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.int64)
            mask[b, width - len(p) :] = True
    return ids, mask


@dataclass
class Agreement:
    """One evaluation: the metrics (``METRICS``), its time, and the texts of a few responses."""

    metrics: dict[str, float]
    seconds: float
    #: the first few prompts' student greedy responses (and the teacher's, fixed): for display
    samples: list[dict[str, str]] = field(default_factory=list)


class AgreementEvaluator:
    """The agreement metrics of a student on fixed prompts, against a frozen teacher.

    Args:
        teacher: the teacher model (frozen; put in eval mode).
        tokenizer: the pair's tokenizer (decodes responses for ROUGE-L; pad / EOS ids).
        prompts: token ids of each held-out prompt, as the models are prompted (chat-templated).
        max_new_tokens: the response budget (the run's ``sampling.max_new_tokens``).
        batch_size: prompts per generation / forward batch.
        seed: the draws of the student's samples (the same every call).
        keep_samples: how many prompts' responses ``Agreement.samples`` holds.

    The teacher's greedy responses are computed once, at the first call (the teacher is frozen).
    """

    def __init__(
        self,
        teacher: torch.nn.Module,
        tokenizer: Any,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        batch_size: int = 16,
        seed: int = 0,
        keep_samples: int = 3,
    ) -> None:
        if not prompts:
            raise ValueError("AgreementEvaluator needs at least one prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.teacher = teacher.eval()
        self.tokenizer = tokenizer
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.seed = seed
        self.keep_samples = keep_samples
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad)
        #: the teacher's greedy responses per batch (ids, mask): computed once, the teacher is frozen
        self._teacher_ref: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def from_files(
        cls, teacher_dir: str, prompts_file: str, *, n: int, max_new_tokens: int, batch_size: int = 16,
        seed: int = 0,
    ) -> AgreementEvaluator:  # fmt: skip
        """The evaluator of a teacher checkpoint on the first ``n`` prompts of a prompt file (Parquet /
        JSONL, ``prompt`` or chat ``messages`` rows, templated as the pipeline prompts them)."""
        from asyncrl.workloads import prompts as P
        from asyncrl.workloads.checkpoints import load_model

        source = P.PromptSource.open(prompts_file)
        teacher, tokenizer = load_model(teacher_dir, role="teacher")
        ids = [
            list(map(int, i))
            for f, t, _ in source.head(n)
            for i in P.prompt_token_ids(t, source.prompt_column, tokenizer, f)
        ]
        return cls(teacher, tokenizer, ids, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)

    def _batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, bs = len(self.prompts), self.batch_size
        return [left_pad(self.prompts[i : i + bs], self.pad_id) for i in range(0, n, bs)]

    def _generate(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, greedy: bool):
        from asyncrl.engines.hf import HFEngine

        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0 if greedy else 1.0)
        return HFEngine(model, self.tokenizer).generate(ids, mask, params, seed=self.seed)

    def _texts(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        rows = [row[m].tolist() for row, m in zip(ids, mask.bool())]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    @torch.no_grad()
    def teacher_responses(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The teacher's greedy responses per batch, ``(completion_ids, completion_mask)`` (computed once)."""
        if self._teacher_ref is None:
            self._teacher_ref = []
            for ids, mask in self._batches():
                res = self._generate(self.teacher, ids, mask, greedy=True)
                self._teacher_ref.append((res["completion_ids"], res["completion_mask"]))
        return self._teacher_ref

    def teacher_texts(self) -> list[str]:
        """The teacher's greedy responses' texts."""
        return [t for y, ym in self.teacher_responses() for t in self._texts(y, ym)]

    @torch.no_grad()
    def __call__(self, student: torch.nn.Module) -> Agreement:
        """Evaluate ``student`` (put in eval mode for the call; its train/eval mode is restored)."""
        t0 = time.perf_counter()
        was_training = student.training
        student.eval()
        try:
            ref = self.teacher_texts()
            sums = {"kl_forward": 0.0, "kl_reverse": 0.0, "top1_agree": 0.0, "tokens": 0.0}
            on_ref = {"kl_forward": 0.0, "top1_agree": 0.0, "tokens": 0.0}
            nll, nll_tokens = 0.0, 0.0
            greedy_texts: list[str] = []
            greedy_ids: list[list[int]] = []
            for (ids, mask), (ry, rm) in zip(self._batches(), self.teacher_responses()):
                # the student's own samples: exact full-vocabulary KLs at the states it visits
                res = self._generate(student, ids, mask, greedy=False)
                y, ym = res["completion_ids"], res["completion_mask"]
                q = R.completion_logits(student, ids, mask, y, ym)
                p = R.completion_logits(self.teacher, ids, mask, y, ym)
                for k, v in token_agreement(q, p, ym).items():
                    sums[k] += float(v)
                # the student's greedy response, scored by the teacher
                g = self._generate(student, ids, mask, greedy=True)
                gy, gm = g["completion_ids"], g["completion_mask"]
                s, n = sequence_nll(R.completion_logits(self.teacher, ids, mask, gy, gm), gy, gm)
                nll, nll_tokens = nll + s, nll_tokens + n
                greedy_texts += self._texts(gy, gm)
                greedy_ids += [row[m].tolist() for row, m in zip(gy, gm.bool())]
                # the teacher's own greedy response, teacher-forced: where the teacher goes
                q = R.completion_logits(student, ids, mask, ry, rm)
                p = R.completion_logits(self.teacher, ids, mask, ry, rm)
                for k, v in token_agreement(q, p, rm).items():
                    if k in on_ref:
                        on_ref[k] += float(v)
        finally:
            student.train(was_training)
        n = max(sums.pop("tokens"), 1.0)
        metrics = {k: v / n for k, v in sums.items()}
        metrics["teacher_nll"] = nll / max(nll_tokens, 1.0)
        metrics["rouge_l"] = rouge_l(greedy_texts, ref)
        metrics["distinct_2"] = distinct_n(greedy_ids, 2)
        n_ref = max(on_ref.pop("tokens"), 1.0)
        metrics |= {f"{k}_ref": v / n_ref for k, v in on_ref.items()}
        prompts = self.tokenizer.batch_decode(self.prompts[: self.keep_samples], skip_special_tokens=True)
        samples = [
            {"prompt": pr, "student": s, "teacher": t}
            for pr, s, t in zip(prompts, greedy_texts[: self.keep_samples], ref)
        ]
        return Agreement(metrics=metrics, seconds=time.perf_counter() - t0, samples=samples)
