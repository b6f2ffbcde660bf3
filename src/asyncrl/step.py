"""``loss_step``: one batch of rollouts -> one optimizer step, composed from the parts.

The learner's per-batch computation as one Ray-free function, so the Ray pipeline and a plain
PyTorch loop compose estimators and controllers identically (the pipeline adds only data
movement, weight publication and telemetry). In order::

    keep (consumption gate) -> student forward (eval mode, logits / tau; bf16 autocast when
    ``precision="bf16"``) -> log pi_theta at the generated tokens (gathered once) -> StepContext
    -> controller token weights -> estimator loss -> rescale to the global normaliser -> backward
    (DDP all-reduce) -> gradient transforms -> clip -> LR scale -> optimizer step -> update
    transforms -> after_step

Learner version ``v`` = optimizer steps applied; a sample's lag here is ``v - version_first``.
A call takes no optimizer step when every sample on every rank was dropped, or when the loss or
gradient is not finite (the step is skipped and reported, the weights are unchanged; the
version does not advance; ``NumericsGuard`` stops a run after too many in a row). When the
controllers' LR scale is 0 (e.g. ``gradient_alignment`` with ``mode: skip``) the optimizer is not
called either, so the weights *and* its state are unchanged, but the version advances: the batch
was trained at LR 0 (``lr_applied = 0``).

The policy the step computes is the sampling one: the model must be in eval mode (dropout
off: the engines sample without it) and the logits are divided by the sampling temperature
``tau``, so at lag 0 ``pi_theta`` equals the behavior policy and every importance ratio is 1
(up to engine/learner numerics). Distillation estimators therefore see ``softmax(z / tau)``;
the teacher cache is scored at the same ``tau`` (``asyncrl.caches``), so the objective
``KL(softmax(z_s / tau) || softmax(z_t / tau))`` has the same minimiser as at ``tau = 1``
(``z_s = z_t + const``) while every ratio is against the distribution that really sampled.

Composition: ``check_composition`` (called by ``StepParts`` and by ``asyncrl.plan``) refuses
estimator x controller pairings whose composed gradient would not be the one docs/controllers.md's
table states (e.g. an importance weight ``pi/pi_b`` applied to a loss that already carries it).

Why the rescale: an estimator's ``token_mean`` divides by its *local* token count, and DDP then
averages ranks, so without it a token on a rank with few valid tokens weighs more than one on
a busy rank. ``loss_step`` multiplies the loss by ``n_local * world / n_global`` (the
estimator's ``EstimatorOutput.normalizer``), which makes every valid token (or sample, for
``seq_mean``) count the same over all ranks, and a rank whose samples were all dropped
contributes nothing instead of halving the gradient.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.collectives import LOCAL, Collectives
from asyncrl.controllers.base import SampleInfo, StepContext
from asyncrl.controllers.chain import importance_levels, transforms_gradients, transforms_updates
from asyncrl.estimators import accepts_token_logprobs
from asyncrl.estimators.functional import gather_logprobs
from asyncrl.logratio import kl_qp_k3

#: columns ``loss_step`` reads besides those of ``asyncrl.records.COLUMNS`` (bookkeeping, numpy)
META_COLUMNS = (R.SAMPLE_ID, R.GROUP_ID, R.VERSION_FIRST, R.VERSION_LAST)


@dataclass(frozen=True)
class StepOptions:
    """How the step computes: clipping, chunking and the sampling temperature.

    ``temperature`` is the rollout engine's tau: the behavior policy is ``softmax(z / tau)``, so
    the learner's ``pi_theta`` is computed at the same tau, or lag-0 importance ratios are not 1.
    """

    grad_clip: float = 1.0
    logits_chunk: int = 0
    temperature: float = 1.0
    #: ``"bf16"``: the student's forward under ``torch.autocast(dtype=bfloat16)`` (``autocast``)
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"StepOptions.precision={self.precision!r}: use one of {sorted(PRECISIONS)}")

    @classmethod
    def from_config(cls, cfg: Any) -> StepOptions:
        """A ``RunConfig``'s ``train.grad_clip``, ``train.logits_chunk``, ``train.precision`` and
        ``sampling.temperature``."""
        tc = cfg.train
        return cls(
            grad_clip=tc.grad_clip,
            logits_chunk=tc.logits_chunk,
            temperature=cfg.sampling.temperature,
            precision=tc.precision,
        )


#: ``train.precision`` -> the autocast dtype of the student's forward (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    """The context the learner's forward runs in: mixed precision for ``precision="bf16"``.

    Autocast runs matmuls (linear layers, attention) in bf16 and keeps the weights, their
    gradients and the optimizer state in fp32 (the master copy): on CPUs with AVX512-BF16 a
    bf16 matmul takes 0.35-0.6x an fp32 one, and the learner step is mostly matmuls. The logits
    come out in bf16; every estimator and ``gather_logprobs`` compute their log-softmax in fp32
    from them (``asyncrl.estimators.functional``), so only the logits' rounding (8 mantissa bits,
    an absolute error of about 2^-8 |z|) reaches the loss. Backward runs outside the context, as
    autocast requires; its matmuls follow the forward's dtypes."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


_UNDECLARED = object()


def check_composition(estimator: Any, controllers: Any) -> None:
    """Refuse an estimator x controllers pairing whose composed gradient is not a documented one.

    The rule is about importance weights ``w = pi/pi_b`` (controllers with ``importance_level``,
    i.e. ``truncated_is``) meeting an estimator's own ratio (its ``behavior_ratio``,
    ``asyncrl.estimators.base.Estimator``). ``w`` is formed before the step, so it is
    ``pi_prox/pi_b`` with ``pi_prox`` the pre-step weights:

    - ratio at the generated token (``grpo``, ``reverse_kl_mc`` with ``source: token``): the
      estimator must anchor on ``pi_prox`` (``anchor: proximal``), so the composed gradient is
      ``E_b[w A grad log pi_theta]`` (decoupled PPO) instead of ``E_b[(pi/pi_b)^2 ...]``.
    - ratios at behavior draws that include the generated token (``reverse_kl_mc`` with
      ``source: mc``, ``reverse_kl_stratified``): refused, the token's ratio would count twice.
    - no ratio (a state-wise loss, e.g. the KL estimators on teacher scores): the loss at t
      does not depend on the token sampled at t, so only ``level: sequence`` (the whole
      sequence's weight, which reweights the visited prefixes to ``pi_theta``'s) corrects
      anything; ``token`` and ``geometric`` are refused.

    Two importance-weight controllers are refused (their weights would multiply). Raises
    ``ValueError`` naming the pairing and the fix.
    """
    levels = importance_levels(controllers)
    if not levels:
        return
    if len(levels) > 1:
        raise ValueError(
            f"controllers {[n for n, _ in levels]} both weight tokens by pi/pi_b: the weights multiply "
            f"(the ratio counts twice); keep one"
        )
    ctrl, level = levels[0]
    name = getattr(estimator, "name", type(estimator).__name__)
    ratio = getattr(estimator, "behavior_ratio", _UNDECLARED)
    if ratio is _UNDECLARED:
        reads = set(estimator.required_columns()) & {R.BEHAVIOR_LOGPROBS, R.MC_BEHAVIOR_LOGPROBS}
        if reads:
            raise ValueError(
                f"estimator {name!r} reads {sorted(reads)} but does not declare behavior_ratio, so "
                f"{ctrl!r} (importance weights pi/pi_b) cannot be composed with it safely; declare "
                f"behavior_ratio (None, 'token' or 'draws', see asyncrl.estimators.base.Estimator)"
            )
        ratio = None
    if ratio == "draws":
        raise ValueError(
            f"{ctrl!r} weights each token by pi/pi_b, but estimator {name!r} already importance-weights "
            f"its behavior draws, which include the generated token: that ratio would count twice. Remove "
            f"{ctrl!r} (bound the estimator's ratios with its clip_eps), or use reverse_kl_mc with "
            f"source=token and anchor=proximal"
        )
    if ratio == "token":
        if getattr(estimator, "anchor", "behavior") != "proximal":
            raise ValueError(
                f"estimator {name!r} carries rho = pi_theta/pi_b in its loss and {ctrl!r} weights the same "
                f"tokens by pi/pi_b: the ratio would count twice. Set estimator option anchor=proximal "
                f"(decoupled PPO: rho = pi_theta/pi_prox, {ctrl!r} weights pi_prox/pi_b), with clip_eps=null"
            )
        return
    if ratio is None and level != "sequence":
        raise ValueError(
            f"{ctrl!r} level={level} with estimator {name!r}: its loss at position t does not depend on the "
            f"token sampled there, so that token's ratio corrects nothing (it only adds variance); use "
            f"level=sequence, which reweights the visited prefixes to pi_theta's, or remove {ctrl!r}"
        )


@dataclass
class StepParts:
    """The parts a step composes, bound once per run (``check_composition`` runs here).

    ``backend``: the ``asyncrl.backends.LearnerBackend`` seam (model, optimizer, LR schedule).
    ``controllers``: a ``chain(...)`` (or any object with every controller hook).
    """

    backend: Any
    estimator: Any
    controllers: Any
    options: StepOptions = field(default_factory=StepOptions)
    comm: Collectives = LOCAL
    #: the estimator takes the learner's token log-probs (signature inspected once, here)
    hand_logprobs: bool = field(init=False)
    #: some controller transforms the optimizer's updates (the step snapshots the weights)
    update_transforms: bool = field(init=False)

    def __post_init__(self) -> None:
        check_composition(self.estimator, self.controllers)
        self.hand_logprobs = accepts_token_logprobs(self.estimator)
        self.update_transforms = transforms_updates(self.controllers)
        partitioned = not getattr(self.backend, "supports_gradient_transform", True)
        if partitioned and (transforms_gradients(self.controllers) or self.update_transforms):
            raise ValueError(
                f"backend {getattr(self.backend, 'name', self.backend)!r} partitions gradients (ZeRO), but "
                f"a controller transforms gradients or updates (e.g. gradient_alignment), which needs them "
                f"whole on every rank; use pipeline.backend=ddp"
            )


@dataclass(frozen=True)
class StepResult:
    """What one ``loss_step`` did. Counts and ``*_global`` tensors cover every DP rank;
    ``samples`` holds this rank's per-sample values (NaN where a sample was dropped)."""

    stepped: bool  # the learner version advanced by one (at lr_applied 0 the weights did not move)
    nonfinite: bool  # the loss or the gradient was not finite: no step taken
    version: int  # learner version after the call
    n_kept: int
    n_dropped: int
    loss: float  # global loss: sum over ranks of the estimator's numerator / global normaliser
    grad_norm: float
    lr_scheduled: float
    lr_applied: float
    kl_behavior_current: float  # KL(pi_b || pi_theta) per valid token (k3), global mean
    tokens: int  # valid completion tokens of kept samples, all ranks
    lags_global: torch.Tensor  # [N_kept_global] head lags of the kept samples
    seq_log_ratio_global: torch.Tensor  # [N_kept_global] log pi_theta(y) / pi_b(y)
    metrics: dict[str, float]  # the estimator's and controllers' own metrics (their keys)
    samples: dict[str, np.ndarray]  # per local sample: kept, lag, loss, kl_behavior_current, seq_log_ratio

    @property
    def consumed(self) -> tuple[int, int]:
        """(trained, dropped) samples, all ranks: a non-finite step trains none of its samples."""
        trained = 0 if self.nonfinite else self.n_kept
        return trained, self.n_dropped + self.n_kept - trained


def sample_info(batch: Mapping[str, Any]) -> SampleInfo:
    """Bookkeeping columns of a batch as the controllers' ``SampleInfo``.

    ``version_first`` is the version of the sample's *oldest* valid token (the smaller of the
    column and ``token_versions`` over ``completion_mask`` when the batch has them), so the head
    lag that the consumption gate bounds bounds every token's lag: ``v - token_version <= v -
    version_first <= S`` (DESIGN.md section 2, in-flight updates). An engine's versions only go
    up along a row, so this is the column itself; the minimum makes the bound hold even if not."""
    first = np.asarray(batch[R.VERSION_FIRST])
    if R.TOKEN_VERSIONS in batch and R.COMPLETION_MASK in batch and len(first):
        oldest = oldest_token_version(batch[R.TOKEN_VERSIONS], batch[R.COMPLETION_MASK], first)
        if (oldest < first).any():
            first = np.minimum(first, oldest).astype(first.dtype)
    return SampleInfo(
        sample_id=np.asarray(batch[R.SAMPLE_ID]),
        group_id=np.asarray(batch[R.GROUP_ID]),
        version_first=first,
        version_last=np.asarray(batch[R.VERSION_LAST]),
    )


def oldest_token_version(token_versions: Any, mask: Any, default: np.ndarray) -> np.ndarray:
    """[B] the smallest version over each row's valid tokens (``default`` for a row with none)."""
    tv = np.asarray(token_versions.cpu() if isinstance(token_versions, torch.Tensor) else token_versions)
    m = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask).astype(bool)
    big = np.iinfo(np.int64).max
    oldest = np.where(m, tv.astype(np.int64), big).min(axis=1)
    return np.where(m.any(axis=1), oldest, np.asarray(default, dtype=np.int64))


def split_minibatches(
    batch: Mapping[str, Any], keep: np.ndarray, n: int
) -> list[tuple[dict[str, Any], np.ndarray]]:
    """Split a rollout batch (and its ``keep`` verdict) into ``n`` consecutive mini-batches of
    equal size. Groups are consecutive rows, so whole groups stay together when the batch holds
    ``n`` x whole groups (checked when the run is planned)."""
    size = len(keep)
    if n < 1 or size % n:
        raise ValueError(f"a batch of {size} samples cannot be split into {n} equal mini-batches")
    m = size // n
    return [
        ({k: v[i * m : (i + 1) * m] for k, v in batch.items()}, keep[i * m : (i + 1) * m]) for i in range(n)
    ]


def student_logits(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], tau: float) -> torch.Tensor:
    """Student logits aligned to completion tokens, at the sampling temperature: ``z / tau``."""
    logits = R.completion_logits(
        model, batch[R.PROMPT_IDS], batch[R.PROMPT_MASK], batch[R.COMPLETION_IDS], batch[R.COMPLETION_MASK]
    )
    return logits if tau == 1.0 else logits / tau


def _optimizer_step(parts: StepParts, version: int, scale: float, sctx: StepContext) -> float:
    """The optimizer step at ``base_lr * scale``, then the controllers' update transforms; returns
    the LR applied. Scale 0: no optimizer call at all (weights and optimizer state unchanged)."""
    if scale == 0.0:
        return 0.0
    backend = parts.backend
    params = [p for p in backend.module.parameters() if p.requires_grad] if parts.update_transforms else []
    before = [p.detach().clone() for p in params]
    applied = float(backend.step(version, scale))
    if params:
        with torch.no_grad():
            updates = [p.detach() - b for p, b in zip(params, before)]
            parts.controllers.transform_update(updates, sctx)
            for p, b, u in zip(params, before, updates):
                p.copy_(b + u)
    return applied


def loss_step(
    batch: Mapping[str, Any],
    parts: StepParts,
    version: int,
    *,
    keep: np.ndarray | None = None,
) -> StepResult:
    """One consumption and (unless nothing is kept anywhere) one optimizer step.

    ``batch``: the rollout record columns (numpy or torch) plus ``sample_id``, ``group_id``,
    ``version_first``, ``version_last``. ``version``: the learner version before the step.
    ``keep``: a precomputed consumption verdict [N] (e.g. once per rollout batch when it is
    split into mini-batches); by default ``parts.controllers.keep(info, version)``.
    """
    backend, controllers, comm, opts = parts.backend, parts.controllers, parts.comm, parts.options
    info = sample_info(batch)
    if keep is None:
        keep = controllers.keep(info, version)
    keep = np.asarray(keep, dtype=bool)
    n_kept, n_drop = (int(v) for v in comm.all_sum([float(keep.sum()), float((~keep).sum())]))
    lags_np = info.lag(version)
    nan = np.full(len(keep), np.nan)
    samples = {"kept": keep, "lag": lags_np, "loss": nan, "kl_behavior_current": nan, "seq_log_ratio": nan}
    lr_sched = float(backend.base_lr(version))
    if n_kept == 0:  # every sample on every rank dropped: consumed, counted, no step
        return StepResult(
            stepped=False, nonfinite=False, version=version, n_kept=0, n_dropped=n_drop, loss=math.nan,
            grad_norm=math.nan, lr_scheduled=lr_sched, lr_applied=0.0, kl_behavior_current=math.nan,
            tokens=0, lags_global=torch.zeros(0, dtype=torch.long),
            seq_log_ratio_global=torch.zeros(0, dtype=torch.float64), metrics=dict(controllers.metrics()),
            samples=samples,
        )  # fmt: skip

    if backend.module.training:
        raise ValueError(
            "loss_step: the model is in train mode; call model.eval() first (gradients still flow). The "
            "engines sample without dropout, so pi_theta must be computed without it, or lag-0 importance "
            "ratios are not 1"
        )
    device = next(backend.module.parameters()).device
    tb = R.to_torch({k: v for k, v in batch.items() if k in R.COLUMNS})
    tb = {k: v.to(device) for k, v in R.trim_to_longest(tb).items()}
    keep_t = torch.from_numpy(keep).to(device)
    mask = tb[R.COMPLETION_MASK] & keep_t[:, None]
    lags = torch.from_numpy(np.asarray(lags_np)).to(device)

    with autocast(device, opts.precision):
        logits = student_logits(backend.model, tb, opts.temperature)
    # log pi_theta at the generated tokens, gathered once: with grad only if the estimator takes
    # it, detached for the controllers and telemetry
    with torch.set_grad_enabled(parts.hand_logprobs):
        logp_grad = gather_logprobs(logits, tb[R.COMPLETION_IDS], chunk_size=opts.logits_chunk)
    logp = logp_grad.detach()
    behavior = tb[R.BEHAVIOR_LOGPROBS]
    log_ratio = torch.where(mask, logp - behavior, torch.zeros_like(logp))
    seq_log_ratio = log_ratio.sum(1)
    kept_idx = keep_t.nonzero().squeeze(1)
    sctx = StepContext(
        step=version,
        base_lr=lr_sched,
        mask=mask,
        logprobs=logp,
        behavior_logprobs=behavior,
        token_versions=tb[R.TOKEN_VERSIONS],
        lags=lags,
        group_ids=torch.from_numpy(info.group_id).to(device),
        seq_log_ratio=comm.all_cat(seq_log_ratio[kept_idx]),
        lags_global=comm.all_cat(lags[kept_idx]),
        world_size=comm.world,
        rank=comm.rank,
    )
    weights = controllers.token_weights(sctx)
    est_batch = dict(tb)
    est_batch[R.COMPLETION_MASK] = mask
    given = {"token_logprobs": logp_grad} if parts.hand_logprobs else {}
    out = parts.estimator(logits, est_batch, token_weights=weights, **given)

    # KL(pi_b || pi_theta) per valid token (k3 on the sampled tokens), reduced with the loss below
    k3_tok = torch.where(mask, kl_qp_k3(behavior, logp), torch.zeros_like(logp))
    n_tok_local = float(mask.sum())
    norm_local = float(out.normalizer) if getattr(out, "normalizer", None) is not None else None
    loss_local = float(out.loss.detach())
    sums = comm.all_sum(
        [
            float(k3_tok.sum()),
            n_tok_local,
            loss_local * (norm_local if norm_local is not None else 1.0),
            norm_local if norm_local is not None else 1.0,
        ]
    )
    kl_sum, n_tok, loss_num, norm_global = sums
    loss = out.loss
    if comm.world > 1 and norm_local is not None:
        # every valid token (sample) over all ranks counts the same: see the module docstring
        loss = loss * (norm_local * comm.world / max(norm_global, 1e-12))

    backend.backward(loss)
    if backend.supports_gradient_transform:  # else refused by StepParts when a controller transforms
        controllers.transform_gradient(backend.gradients(), sctx)
    grad_norm = backend.clip_and_norm(opts.grad_clip)
    nonfinite = not (math.isfinite(grad_norm) and math.isfinite(loss_num))
    if nonfinite:  # skip: the weights and the optimizer state stay as they were
        scale, applied = 0.0, 0.0
    else:
        scale = float(controllers.lr_scale(sctx))
        applied = _optimizer_step(parts, version, scale, sctx)
        sctx.lr_applied = applied
        controllers.after_step(sctx)

    n_tok_sample = mask.sum(1).clamp_min(1)
    per_sample_loss = out.per_sample.get("loss")
    samples["seq_log_ratio"] = torch.where(keep_t, seq_log_ratio, float("nan")).double().cpu().numpy()
    samples["kl_behavior_current"] = (
        torch.where(keep_t, k3_tok.sum(1) / n_tok_sample, float("nan")).double().cpu().numpy()
    )
    if per_sample_loss is not None:
        samples["loss"] = torch.where(keep_t, per_sample_loss.detach().double(), float("nan")).cpu().numpy()
    metrics = dict(out.metrics)
    metrics.update(controllers.metrics())
    return StepResult(
        stepped=not nonfinite,
        nonfinite=nonfinite,
        version=version + (0 if nonfinite else 1),
        n_kept=n_kept,
        n_dropped=n_drop,
        loss=loss_num / norm_global if norm_global > 0 else math.nan,
        grad_norm=float(grad_norm),
        lr_scheduled=lr_sched,
        lr_applied=float(applied),
        kl_behavior_current=kl_sum / n_tok if n_tok > 0 else math.nan,
        tokens=int(n_tok),
        lags_global=sctx.lags_global.cpu(),
        seq_log_ratio_global=sctx.seq_log_ratio.double().cpu(),
        metrics=metrics,
        samples=samples,
    )


class NumericsGuard:
    """Stops a run whose numerics stay broken: ``loss_step`` skips a step whose loss or gradient is
    not finite (the weights are unchanged), and ``limit`` such steps in a row (0 = never) trip the
    guard. Identical on every rank: the loss and the gradient norm are reduced over ranks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.streak = 0  # optimizer steps in a row skipped for non-finite numbers
        self.first_bad_step: int | None = None  # the 1-based step the streak started at

    def update(self, result: StepResult) -> None:
        if result.nonfinite:
            if self.streak == 0:
                self.first_bad_step = result.version + 1
            self.streak += 1
        elif result.stepped:
            self.streak = 0

    @property
    def tripped(self) -> bool:
        return self.limit > 0 and self.streak >= self.limit

    def message(self, checkpoint: Any) -> str:
        """Why the run stopped and how to resume, for the driver; ``checkpoint``: where the
        weights from before the first bad step were saved."""
        return (
            f"{self.streak} optimizer steps in a row had a non-finite loss or gradient "
            f"(from step {self.first_bad_step}; train.max_nonfinite_steps={self.limit}); the run stopped "
            f"with the weights from before step {self.first_bad_step} checkpointed in {checkpoint}: lower "
            f"train.lr or check the prompts and the teacher, then rerun the same command to resume from there"
        )
