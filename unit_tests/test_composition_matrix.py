"""Composition matrix: every built-in estimator x every built-in controller (and chains of two),
through ``loss_step``, by exact enumeration (issue 12).

World: a tabular causal LM over V = 5 tokens, completions of T = 2 tokens (6 states), fp64. The
behavior policy is the current one (lag 0) or a perturbed table two versions old (lag 2); the
teacher is another table; GRPO rewards are a fixed function of the completion. Each batch holds
every outcome once (completions, and the behavior / teacher draws an estimator reads, and for
GRPO every pair of completions as a group of G = 2), weighted by its probability through a test
controller, so the gradient the optimizer receives is the *expected* gradient.

For every pairing the test either expects ``StepParts`` to refuse it (``check_composition``)
or checks, to 1e-9 relative, that the received gradient and LR scale equal the claim of the
The table "What the composed gradient is" (docs/controllers.md), recomputed here from the tables alone:

    gradient = GAC( E_b[ (1/T) Σ_t f(lag) · w_t · ∇u_t ] ),   LR = base · Π scales

with ``u_t`` the estimator's per-token integrand (a state-wise loss ``L(s_t)`` for the KL
estimators, ``sg(c_t) log π_θ(y_t)`` for the policy-gradient ones), ``w_t`` the importance
weight of ``truncated_is`` (1 without it), ``f`` the lag decay of ``lag_bucket_decay``'s
sample weights and GAC the ``gradient_alignment`` cap against its previous direction.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from tabular import (
    ProbabilityWeights,
    RecordingBackend,
    TabularLM,
    ess_fraction_np,
    n_states,
    rel_err,
    rollout_batch,
    sequences,
    states_along,
)

from asyncrl import records as R
from asyncrl.caches import BehaviorMCCache, DenseCache, TokenCache, TopKCache
from asyncrl.controllers import build as build_controller
from asyncrl.controllers import chain
from asyncrl.controllers.bucket_decay import LagBucketDecay
from asyncrl.controllers.functional import align_gradient
from asyncrl.estimators import build as build_estimator
from asyncrl.logratio import LOG_RATIO_CLAMP
from asyncrl.step import StepOptions, StepParts, loss_step

torch.set_num_threads(1)
f64 = torch.float64
V, T, K, G = 5, 2, 3, 2
S = n_states(V, T)
VERSION, STALE = 4, 2
_g = torch.Generator().manual_seed(12)
THETA = torch.randn(S, V, dtype=f64, generator=_g)
BETA_STALE = THETA + 0.8 * torch.randn(S, V, dtype=f64, generator=_g)  # the policy 2 versions ago
PHI = 1.5 * torch.randn(S, V, dtype=f64, generator=_g)  # the teacher
REWARD = torch.rand(V**T, dtype=f64, generator=_g)  # GRPO reward of each completion
YS = sequences(V, T)
STATES = states_along(YS, V)
BASE_LR = 1e-2


# --- the estimators: name, options, how their rows are enumerated, the claimed integrand -------------
@dataclass(frozen=True)
class Est:
    name: str
    options: dict[str, Any]
    rows: str  # "plain" | "behavior_draws" | "teacher_draws" | "pairs"
    ratio: str  # "state" (no π_b in the loss) | "token" | "draws"  (as the docs table)
    integrand: str  # "fkl" | "fkl_bucket" | "rkl" | "rkl_bucket" | "pg_rkl" | "pg_reward"

    @property
    def anchor(self) -> str:
        return self.options.get("anchor", "behavior")


ESTIMATORS = {
    "forward_kl/dense": Est("forward_kl", {"dense": True}, "plain", "state", "fkl"),
    "forward_kl/topk_bucket": Est("forward_kl", {"tail": "bucket"}, "plain", "state", "fkl_bucket"),
    "reverse_kl/topk_bucket": Est("reverse_kl", {"tail": "bucket"}, "plain", "state", "rkl_bucket"),
    "reverse_kl/dense": Est("reverse_kl", {"dense": True}, "plain", "state", "rkl"),
    "reverse_kl_mc": Est("reverse_kl_mc", {}, "behavior_draws", "draws", "rkl"),
    "reverse_kl_mc/token": Est("reverse_kl_mc", {"source": "token"}, "plain", "token", "pg_rkl"),
    "reverse_kl_mc/token/proximal": Est(
        "reverse_kl_mc", {"source": "token", "anchor": "proximal"}, "plain", "token", "pg_rkl"
    ),
    "reverse_kl_stratified": Est("reverse_kl_stratified", {}, "behavior_draws", "draws", "rkl"),
    "forward_kl_mc": Est("forward_kl_mc", {}, "teacher_draws", "state", "fkl"),
    "grpo": Est("grpo", {"clip_eps": None, "scale": "none"}, "pairs", "token", "pg_reward"),
    "grpo/clipped": Est("grpo", {"clip_eps": 0.2, "scale": "none"}, "pairs", "token", "pg_reward"),
    "grpo/proximal": Est(
        "grpo", {"clip_eps": None, "scale": "none", "anchor": "proximal"}, "pairs", "token", "pg_reward"
    ),
}

# --- the controllers: every built-in, with the options that change what it does -------------------
CONTROLLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "bounded_staleness": ("bounded_staleness", {"max_lag": STALE}),
    "truncated_is/token": ("truncated_is", {"level": "token", "upper": 2.0}),
    "truncated_is/sequence": ("truncated_is", {"level": "sequence", "upper": math.inf}),
    "truncated_is/geometric": ("truncated_is", {"level": "geometric", "upper": 2.0}),
    "ess_lr": ("ess_lr", {}),
    "gradient_alignment": ("gradient_alignment", {"tau": 0.5, "mode": "cap"}),
    "staleness_lr_law": ("staleness_lr_law", {}),
    "lag_bucket_decay": ("lag_bucket_decay", {}),
    "lag_bucket_decay/sample_weight": ("lag_bucket_decay", {"mode": "sample_weight"}),
}
SINGLES = [()] + [(c,) for c in CONTROLLERS]
PAIRS = list(itertools.combinations(CONTROLLERS, 2))


# --- rows: every outcome an estimator's batch can hold, with its probability -------------------------
@dataclass
class Rows:
    ys: torch.Tensor  # [N, T] completions
    states: torch.Tensor  # [N, T]
    prob: torch.Tensor  # [N] probability of the row's outcome / rows per outcome
    draws: torch.Tensor | None = None  # [N, T] the extra behavior or teacher draw per position
    partner: torch.Tensor | None = None  # [N] index (into YS) of the other member of a GRPO pair


def enumerate_rows(kind: str, beta: torch.Tensor) -> Rows:
    lb, lp = torch.log_softmax(beta, -1), torch.log_softmax(PHI, -1)
    seq_lb = lb[STATES, YS].sum(-1)  # [V^T] log P_b(y)
    if kind == "plain":
        return Rows(YS, STATES, seq_lb.exp())
    if kind in ("behavior_draws", "teacher_draws"):
        lq = lb if kind == "behavior_draws" else lp
        idx = list(itertools.product(range(len(YS)), range(len(YS))))  # (completion, draws d_1..d_T)
        y_i = torch.tensor([i for i, _ in idx])
        d_i = torch.tensor([j for _, j in idx])
        draws = YS[d_i]  # the draw at position t is d_t, drawn in the completion's state s_t
        states = STATES[y_i]
        prob = (seq_lb[y_i] + lq[states, draws].sum(-1)).exp()
        return Rows(YS[y_i], states, prob, draws=draws)
    assert kind == "pairs"
    idx = list(itertools.product(range(len(YS)), range(len(YS))))
    a = torch.tensor([i for i, _ in idx])
    b = torch.tensor([j for _, j in idx])
    rows = torch.stack([a, b], 1).reshape(-1)  # group g = rows 2g, 2g+1
    partner = torch.stack([b, a], 1).reshape(-1)
    prob = (seq_lb[a] + seq_lb[b]).exp().repeat_interleave(G) / G
    return Rows(YS[rows], STATES[rows], prob, partner=partner)


def make_batch(est: Est, rows: Rows, beta: torch.Tensor, lag: int) -> dict[str, Any]:
    """The record columns the estimator reads, built the way the pipeline builds them."""
    lb = torch.log_softmax(beta, -1)
    N = len(rows.ys)
    groups = np.arange(N) // G if est.rows == "pairs" else np.arange(N)
    batch = rollout_batch(rows.ys, lb[rows.states, rows.ys], version=VERSION, lag=lag, group_ids=groups)
    zt = PHI[rows.states]  # teacher logits aligned to the completion tokens [N, T, V]
    if est.rows == "behavior_draws":
        mc = torch.stack([rows.ys, rows.draws], -1)  # column 0 = the generated token
        batch[R.MC_IDS] = mc
        batch[R.MC_BEHAVIOR_LOGPROBS] = lb[rows.states[..., None].expand_as(mc), mc]
        batch.update(BehaviorMCCache().build(zt, batch))
    if est.rows == "teacher_draws":
        batch[R.TEACHER_MC_IDS] = rows.draws[..., None]
        batch[R.TEACHER_MC_LOGPROBS] = torch.log_softmax(PHI, -1)[rows.states, rows.draws][..., None]
    if est.options.get("dense"):
        batch.update(DenseCache().build(zt, batch))
    elif est.integrand.endswith("bucket") or est.name == "reverse_kl_stratified":
        batch.update(TopKCache(k=K).build(zt, batch))
    if est.options.get("source") == "token":
        batch.update(TokenCache().build(zt, batch))
    if est.rows == "pairs":
        batch[R.REWARD] = REWARD[_seq_index(rows.ys)]
    return batch


def _seq_index(ys: torch.Tensor) -> torch.Tensor:
    return ys[:, 0] * V + ys[:, 1]


# --- the claims, from the tables alone -------------------------------------------------------------------
def per_state_loss(kind: str, lq: torch.Tensor) -> torch.Tensor:
    """[S] the state-wise loss the KL estimators estimate, with π_θ = exp(lq) [S, V] (differentiable)."""
    lp = torch.log_softmax(PHI, -1)
    if kind == "fkl":
        return (lp.exp() * (lp - lq)).sum(-1)
    if kind == "rkl":
        return (lq.exp() * (lq - lp)).sum(-1)
    top = PHI.topk(K, -1).indices  # the teacher's top-k in each state
    head = torch.zeros(S, V, dtype=torch.bool).scatter(-1, top, True)
    lt_q = torch.logsumexp(lq.masked_fill(head, -math.inf), -1)
    lt_p = torch.logsumexp(lp.masked_fill(head, -math.inf), -1)
    hq, hp = lq.gather(-1, top), lp.gather(-1, top)
    if kind == "fkl_bucket":
        return (hp.exp() * (hp - hq)).sum(-1) + lt_p.exp() * (lt_p - lt_q)
    assert kind == "rkl_bucket"
    return (hq.exp() * (hq - hp)).sum(-1) + lt_q.exp() * (lt_q - lt_p)


def is_weight(spec: dict[str, Any], log_ratio: torch.Tensor) -> torch.Tensor:
    """[N, T] truncated-IS weight at its level (log-ratio clamped as the library documents)."""
    level, upper = spec["level"], spec["upper"]
    if level == "token":
        lw = log_ratio
    else:
        total = log_ratio.sum(-1, keepdim=True)
        lw = (total if level == "sequence" else total / T).expand_as(log_ratio)
    return lw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=upper)


def claimed_gradient(
    est: Est, rows: Rows, beta: torch.Tensor, lag: int, ctrls: tuple[str, ...]
) -> torch.Tensor:
    """E_b[(1/T) Σ_t f(lag) w_t ∇u_t] before any gradient transform."""
    theta = THETA.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    lb, lp = torch.log_softmax(beta, -1), torch.log_softmax(PHI, -1)
    s, y = rows.states, rows.ys
    log_ratio = (lq[s, y] - lb[s, y]).detach()  # [N, T] log π_θ/π_b at the generated tokens
    w = torch.ones_like(log_ratio)
    for c in ctrls:
        name, spec = CONTROLLERS[c]
        if name == "truncated_is":
            w = w * is_weight(spec, log_ratio)
        if c == "lag_bucket_decay/sample_weight":
            w = w * LagBucketDecay().factor(lag)
    if est.integrand in ("fkl", "rkl", "fkl_bucket", "rkl_bucket"):
        u = per_state_loss(est.integrand, lq)[s]  # a function of the state only
    else:
        ratio = log_ratio.exp() if est.anchor == "behavior" else torch.ones_like(log_ratio)
        if est.integrand == "pg_rkl":  # A = log p − log π_θ at the token; loss −A ρ
            coef = -(lp[s, y] - lq[s, y]).detach() * ratio
        else:  # GRPO, G = 2, scale none: A_i = (R_i − R_j) / 2
            adv = ((REWARD[_seq_index(y)] - REWARD[rows.partner]) / 2)[:, None]
            coef = -adv * ratio
            eps = est.options.get("clip_eps")
            if eps is not None:  # the PPO clip passes no gradient where it binds
                binds = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))
                coef = torch.where(binds, 0.0, coef)
        u = coef * lq[s, y]
    surrogate = (rows.prob[:, None] * w * u).sum() / T
    (grad,) = torch.autograd.grad(surrogate, theta)
    return grad


def claimed_lr_scale(ctrls: tuple[str, ...], lag: int, seq_log_ratio: np.ndarray) -> float:
    scale = 1.0
    for c in ctrls:
        name, _ = CONTROLLERS[c]
        if name == "ess_lr":  # VCPO: sqrt(min(1, rho / 1)) over the batch's sequence weights
            scale *= math.sqrt(min(1.0, ess_fraction_np(seq_log_ratio)))
        if name == "staleness_lr_law":  # inverse lag: min(1, s_ref / S_max)
            scale *= min(1.0, 1.0 / lag) if lag else 1.0
        if c == "lag_bucket_decay":  # batch_lr: f(mean lag) from the default table
            scale *= {0: 1.0, STALE: 0.75}[lag]
    return scale


def refusal(est: Est, ctrls: tuple[str, ...]) -> str | None:
    """The docs' rule (docs/controllers.md) for which pairings are refused at build time."""
    levels = [CONTROLLERS[c][1]["level"] for c in ctrls if CONTROLLERS[c][0] == "truncated_is"]
    if not levels:
        return None
    if len(levels) > 1:
        return "twice"
    if est.ratio == "draws":
        return "twice"
    if est.ratio == "token":
        return None if est.anchor == "proximal" else "anchor=proximal"
    return None if levels[0] == "sequence" else "level=sequence"


# --- the run -------------------------------------------------------------------------------------
_ROWS: dict[tuple[str, int], tuple[Rows, dict[str, Any]]] = {}


def _rows_and_batch(key: str, lag: int) -> tuple[Rows, dict[str, Any]]:
    est = ESTIMATORS[key]
    if (key, lag) not in _ROWS:
        beta = THETA if lag == 0 else BETA_STALE
        rows = enumerate_rows(est.rows, beta)
        _ROWS[key, lag] = (rows, make_batch(est, rows, beta, lag))
    return _ROWS[key, lag]


def run_pairing(key: str, ctrls: tuple[str, ...], lag: int) -> None:
    est = ESTIMATORS[key]
    beta = THETA if lag == 0 else BETA_STALE
    rows, batch = _rows_and_batch(key, lag)
    n = len(rows.ys)
    prob = ProbabilityWeights((n * rows.prob)[:, None])
    built = [build_controller(*CONTROLLERS[c]) for c in ctrls]
    model = TabularLM(THETA, T)
    backend = RecordingBackend(model, lr=BASE_LR)
    parts_args = dict(backend=backend, estimator=build_estimator(est.name, est.options))
    why = refusal(est, ctrls)
    if why is not None:
        with pytest.raises(ValueError, match=why):
            StepParts(**parts_args, controllers=chain(prob, *built))
        return
    parts = StepParts(**parts_args, controllers=chain(prob, *built), options=StepOptions(grad_clip=0.0))
    want = claimed_gradient(est, rows, beta, lag, ctrls)
    if "gradient_alignment" in ctrls:  # its previous direction: leaning on the claim (cos ~ 0.9 > tau)
        noise = torch.randn(S, V, dtype=f64, generator=torch.Generator().manual_seed(1))
        ref = want + 0.5 * want.norm() * noise / noise.norm()
        parts.controllers["gradient_alignment"].reference = [ref.clone()]
        if lag >= 1:  # min_lag 1: the synchronous path is untouched
            want = align_gradient(want.flatten(), ref.flatten(), tau=0.5, mode="cap").view(S, V)
            assert rel_err(want, claimed_gradient(est, rows, beta, lag, ctrls)) > 1e-3  # it acted
    result = loss_step(batch, parts, VERSION)
    assert result.stepped and result.n_kept == n
    (got,), scale = backend.seen[-1]
    assert rel_err(got, want) < 1e-9, (key, ctrls, lag, rel_err(got, want))
    seq_lr = np.asarray(result.seq_log_ratio_global)
    want_scale = claimed_lr_scale(ctrls, lag, seq_lr)
    assert scale == pytest.approx(want_scale, rel=1e-12), (key, ctrls, lag)
    assert result.lr_applied == pytest.approx(BASE_LR * want_scale, rel=1e-12)


@pytest.mark.parametrize("lag", [0, STALE])
@pytest.mark.parametrize("key", list(ESTIMATORS))
def test_estimator_with_each_controller(key: str, lag: int) -> None:
    for ctrls in SINGLES:
        run_pairing(key, ctrls, lag)


@pytest.mark.parametrize("lag", [0, STALE])
@pytest.mark.parametrize("key", list(ESTIMATORS))
def test_estimator_with_chains_of_two(key: str, lag: int) -> None:
    for ctrls in PAIRS:
        run_pairing(key, ctrls, lag)


# --- what the claims mean: the headline identities, independent of the formulas above --------------
def _step_gradient(key: str, ctrls: tuple[str, ...], lag: int) -> torch.Tensor:
    est = ESTIMATORS[key]
    rows, batch = _rows_and_batch(key, lag)
    prob = ProbabilityWeights((len(rows.ys) * rows.prob)[:, None])
    backend = RecordingBackend(TabularLM(THETA, T), lr=BASE_LR)
    parts = StepParts(
        backend=backend,
        estimator=build_estimator(est.name, est.options),
        controllers=chain(prob, *[build_controller(*CONTROLLERS[c]) for c in ctrls]),
        options=StepOptions(grad_clip=0.0),
    )
    loss_step(batch, parts, VERSION)
    return backend.seen[-1][0][0]


def _on_policy(kind: str) -> torch.Tensor:
    """∇ (1/T) Σ_t E_{s_t ~ d_θ}[L(s_t)]: the state-wise objective under the current policy."""
    theta = THETA.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    p_y = lq.detach()[STATES, YS].sum(-1).exp()
    (g,) = torch.autograd.grad((p_y[:, None] * per_state_loss(kind, lq)[STATES]).sum() / T, theta)
    return g


def _grad_expected_reward() -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    (g,) = torch.autograd.grad((lq[STATES, YS].sum(-1).exp() * REWARD).sum(), theta)
    return g


def test_grpo_is_the_policy_gradient_at_lag_0_and_decoupled_sequence_is_recovers_it_when_stale() -> None:
    """Unclipped GRPO (G = 2, centred rewards) at lag 0: the loss gradient is -(1 - 1/G)/T ∇E_θ[R].
    Stale, with anchor=proximal and sequence IS (C = ∞): the same on-policy gradient at the same weights."""
    target = -(1 - 1 / G) / T * _grad_expected_reward()
    assert rel_err(_step_gradient("grpo", (), 0), target) < 1e-12
    stale = _step_gradient("grpo/proximal", ("truncated_is/sequence",), STALE)
    assert rel_err(stale, target) < 1e-12
    assert rel_err(_step_gradient("grpo", (), STALE), target) > 0.01  # token-level IS alone is not it


def test_decoupled_token_is_with_infinite_cap_equals_the_bypass_ratio() -> None:
    """anchor=proximal + token IS (C = ∞) gives exactly what the estimator's own π_θ/π_b gives."""
    tis_inf = ("truncated_is", {"level": "token", "upper": math.inf})
    CONTROLLERS["truncated_is/token_inf"] = tis_inf
    try:
        for plain, proximal in (
            ("grpo", "grpo/proximal"),
            ("reverse_kl_mc/token", "reverse_kl_mc/token/proximal"),
        ):
            bypass = _step_gradient(plain, (), STALE)
            decoupled = _step_gradient(proximal, ("truncated_is/token_inf",), STALE)
            assert rel_err(decoupled, bypass) < 1e-12
    finally:
        del CONTROLLERS["truncated_is/token_inf"]


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("forward_kl/dense", "fkl"),
        ("reverse_kl/dense", "rkl"),
        ("forward_kl_mc", "fkl"),
        ("reverse_kl_mc/token/proximal", "rkl"),
    ],
)
def test_state_losses_are_on_policy_at_lag_0_and_with_sequence_is_when_stale(key: str, kind: str) -> None:
    target = _on_policy(kind)
    assert rel_err(_step_gradient(key, (), 0), target) < 1e-12
    assert rel_err(_step_gradient(key, ("truncated_is/sequence",), STALE), target) < 1e-12
    if ESTIMATORS[key].ratio == "state":  # uncorrected: the behavior's state distribution
        assert rel_err(_step_gradient(key, (), STALE), target) > 1e-3


def test_the_old_composition_counted_the_ratio_twice() -> None:
    """The issue's evidence, now refused: GRPO's own π_θ/π_b times truncated_is's weight."""
    est = build_estimator("grpo", {"clip_eps": None, "scale": "none"})
    with pytest.raises(ValueError, match="anchor=proximal"):
        StepParts(
            backend=RecordingBackend(TabularLM(THETA, T)),
            estimator=est,
            controllers=chain(*[build_controller("truncated_is", {})]),
        )
