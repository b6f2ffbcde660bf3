"""Composition (spec 7.7 a-c): the S=0 stack is an exact no-op; one LR product; replayable verdicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.controllers import (
    ESSLR,
    BoundedStaleness,
    GradientAlignment,
    LagBucketDecay,
    SampleInfo,
    StalenessLRLaw,
    StepContext,
    TruncatedIS,
    chain,
    scaled_lr,
)
from asyncrl.lab.simulator import SimConfig, simulate

torch.set_num_threads(1)
V, D, T, B = 8, 6, 5, 6


class Bigram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(prev)))


@torch.no_grad()
def sample(model: Bigram, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prev = torch.zeros(B, dtype=torch.long)
    toks = []
    for _ in range(T):
        probs = torch.softmax(model(prev), -1)
        prev = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        toks.append(prev)
    ids = torch.stack(toks, 1)  # [B, T]
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    inputs = torch.cat([torch.zeros(B, 1, dtype=torch.long), ids[:, :-1]], 1)
    return inputs, ids, mask


def token_logprobs(model: Bigram, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(inputs), -1).gather(-1, ids[..., None]).squeeze(-1)  # [B, T]


def train(
    controllers=None, steps: int = 6, behavior_noise: float = 0.0
) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    gen = torch.Generator().manual_seed(1)
    scales = []
    for step in range(steps):
        inputs, ids, mask = sample(model, gen)
        reward = (ids == 3).float().sum(1)
        adv = (reward - reward.mean())[:, None]
        logp = token_logprobs(model, inputs, ids)
        per_tok = -adv * logp
        if controllers is None:  # the plain on-policy trainer
            loss = (per_tok * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            with torch.no_grad():  # pi_b computed by the learner itself, at the same version
                behavior = token_logprobs(model, inputs, ids) + behavior_noise
            info = SampleInfo(np.arange(B), np.arange(B), np.full(B, step), np.full(B, step))
            keep = controllers.keep(info, step)
            assert keep.all()
            ctx = StepContext.local(
                step=step,
                base_lr=sched.get_last_lr()[0],
                mask=mask,
                logprobs=logp,
                behavior_logprobs=behavior,
                lags=info.lag(step),
            )
            w = controllers.token_weights(ctx)
            loss = (per_tok * w * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            controllers.transform_gradient([p.grad for p in model.parameters()], ctx)
            scale = controllers.lr_scale(ctx)
            scales.append(scale)
            with scaled_lr(opt, scale):
                opt.step()
            controllers.after_step(ctx)
        sched.step()
    return [p.detach().clone() for p in model.parameters()], scales


def stack():
    return chain(
        BoundedStaleness(max_lag=0),
        TruncatedIS(),
        ESSLR(),
        LagBucketDecay(),
        StalenessLRLaw(),
        GradientAlignment(min_lag=1),
    )


def test_s0_stack_is_an_exact_no_op():  # 7.7 a
    plain, _ = train()
    controlled, scales = train(stack())
    assert scales == [1.0] * len(scales)
    assert all(torch.equal(a, b) for a, b in zip(plain, controlled))
    # negative control: a behaviour policy that is not the learner's makes the stack act
    off, _ = train(stack(), behavior_noise=0.3)
    assert not all(torch.equal(a, b) for a, b in zip(plain, off))


def test_lr_scale_product_applied_once_and_logged():  # 7.7 b
    c = chain(ESSLR(), LagBucketDecay(), StalenessLRLaw(s_ref=2))
    mask = torch.ones(4, 3, dtype=torch.bool)
    logp = torch.zeros(4, 3)
    behavior = logp - torch.tensor([0.0, 1.0, 2.0, 0.5])[:, None]
    ctx = StepContext.local(
        step=9, base_lr=0.1, mask=mask, logprobs=logp, behavior_logprobs=behavior, lags=[4, 4, 4, 4]
    )
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = c.lr_scale(ctx)
    expected = c["ess_lr"].metrics()["ess/lr_scale"] * 0.5 * 0.5  # ESS * bucket f(4) * law 2/4
    assert scale == pytest.approx(expected) and scale < 0.25
    with scaled_lr(opt, scale) as applied:
        pass
    m = c.metrics()
    assert applied[0] == pytest.approx(m["lr/applied"]) and m["lr/applied"] == 0.1 * scale
    assert opt.param_groups[0]["lr"] == 0.1


class LooseAdmission:
    """Admits two rollout batches in flight (AReaL's capacity rule for S = 1), blind to the two
    mini-batch steps per batch, and gates with ``BoundedStaleness(1)``: the gate has work to do."""

    def __init__(self) -> None:
        self.bound = BoundedStaleness(max_lag=1)

    def admit(self, req) -> bool:
        return req.in_flight + req.n <= 2 * req.batch_size

    def keep(self, info, learner_version):
        return self.bound.keep(info, learner_version)


def test_replaying_recorded_verdicts_reproduces_them():  # 7.7 c
    cfg = SimConfig(
        max_lag=1,
        batch_size=4,
        group_size=2,
        minibatches=2,
        generators=6,
        steps=16,
        gen_dist="pareto",
        step_sigma=0.5,
        seed=3,
    )
    result = simulate(cfg, controller=chain(LooseAdmission()))
    assert any((~call["keep"]).any() for call in result.keep_calls)  # the trace has drops to replay
    fresh = chain(BoundedStaleness(max_lag=1))
    for call in result.keep_calls:
        info = SampleInfo(call["sample_id"], call["group_id"], call["version_first"], call["version_last"])
        assert np.array_equal(fresh.keep(info, call["learner_version"]), call["keep"])
