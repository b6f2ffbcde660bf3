"""A user-written staleness controller, composed with built-ins from YAML, in a toy training loop.

``KLGuard`` zeroes the loss weights of every sample whose KL(pi_b || pi_theta) (k3 estimator,
token mean) exceeds ``max_k3``: samples the learner has drifted too far from are not worth a
(noisy) importance-weighted update. It implements only the hooks it needs (``token_weights``,
``metrics``, ``state_dict``/``load_state_dict``); ``chain`` fills in the rest.

It is registered under ``kl_guard``, so YAML can name it; a controller that lives in an
importable module can instead be named by dotted path, e.g. ``name: my_pkg.guards:KLGuard``.

The loop is a bigram policy trained with REINFORCE on "emit token 3", where each batch is
sampled by a policy snapshot 0-3 steps old (a FIFO of snapshots stands in for asynchronous
generators). Run: ``python examples/custom_controller.py``. CPU, a few seconds.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import yaml

from asyncrl.configurable import check, field
from asyncrl.controllers import CONTROLLERS, SampleInfo, StepContext, build_chain, scaled_lr
from asyncrl.logratio import kl_qp_k3, masked_mean


@dataclass(frozen=True)
class KLGuardConfig:
    max_k3: float = field(0.05, help="drop (weight 0) samples whose mean per-token k3 KL exceeds this")

    def __post_init__(self) -> None:
        check(self.max_k3 > 0, "max_k3", self.max_k3, "use a positive KL threshold, e.g. 0.05")


@CONTROLLERS.register("kl_guard")
class KLGuard:
    """Weight 0 for samples with ``mean_t k3 > max_k3``, 1 otherwise (detached, [B, T])."""

    name = "kl_guard"
    Config = KLGuardConfig

    def __init__(self, max_k3: float = 0.05) -> None:
        self.config = KLGuardConfig(max_k3=max_k3)
        self.masked_total = 0
        self._last: dict[str, float] = {}

    def token_weights(self, ctx: StepContext) -> torch.Tensor:
        k3 = masked_mean(kl_qp_k3(ctx.behavior_logprobs, ctx.logprobs), ctx.mask, dim=-1)  # KL(b||theta) [B]
        ok = k3 <= self.config.max_k3
        self.masked_total += int((~ok).sum())
        self._last = {"kl_guard/masked": float((~ok).sum()), "kl_guard/k3_max": float(k3.max())}
        return ok.to(ctx.logprobs.dtype)[:, None].expand_as(ctx.logprobs)

    def metrics(self) -> dict[str, float]:
        return {**self._last, "kl_guard/masked_total": float(self.masked_total)}

    def state_dict(self) -> dict[str, Any]:
        return {"masked_total": self.masked_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.masked_total = int(state["masked_total"])


CONFIG = """
controllers:
  - name: bounded_staleness
    options: {max_lag: 2}
  - name: truncated_is
    options: {level: token, upper: 2.0}
  - name: ess_lr
    options: {rho_base: 0.8}
  - name: kl_guard
    options: {max_k3: 0.05}
"""

VOCAB, DIM, T, B = 8, 16, 6, 16


class Bigram(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(prev)))  # [..., VOCAB]


@torch.no_grad()
def generate(policy: Bigram, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B sequences of T tokens from ``policy``: (inputs [B, T], ids [B, T], behavior logprobs [B, T])."""
    prev = torch.zeros(B, dtype=torch.long)
    ids, logps = [], []
    for _ in range(T):
        logp = torch.log_softmax(policy(prev), -1)
        prev = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        ids.append(prev)
        logps.append(logp.gather(-1, prev[:, None]).squeeze(1))
    ids_t = torch.stack(ids, 1)
    inputs = torch.cat([torch.zeros(B, 1, dtype=torch.long), ids_t[:, :-1]], 1)
    return inputs, ids_t, torch.stack(logps, 1)


def main(steps: int = 30, seed: int = 0, verbose: bool = True) -> dict[str, float]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    controllers = build_chain(yaml.safe_load(CONFIG)["controllers"])
    model = Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    snapshots: deque[tuple[int, Bigram]] = deque([(0, copy.deepcopy(model))], maxlen=4)
    trained = dropped = 0
    version = 0  # learner version = optimizer steps applied
    metrics: dict[str, float] = {}
    while version < steps:
        # a generator that loaded its weights 0-3 versions ago produced this batch
        v_behavior, policy = snapshots[-1 - int(rng.integers(0, len(snapshots)))]
        inputs, ids, behavior = generate(policy, gen)
        info = SampleInfo(np.arange(B), np.arange(B) // 2, np.full(B, v_behavior), np.full(B, v_behavior))
        keep = controllers.keep(info, version)  # consumption gate: lag > 2 is dropped, whole groups
        dropped += int((~keep).sum())
        if not keep.any():
            continue
        keep_t = torch.from_numpy(keep)
        inputs, ids, behavior = inputs[keep_t], ids[keep_t], behavior[keep_t]
        logp = torch.log_softmax(model(inputs), -1).gather(-1, ids[..., None]).squeeze(-1)  # [b, T]
        mask = torch.ones_like(ids, dtype=torch.bool)
        ctx = StepContext.local(
            step=version,
            base_lr=0.05,
            mask=mask,
            logprobs=logp,
            behavior_logprobs=behavior,
            lags=info.lag(version)[keep],
        )
        weights = controllers.token_weights(ctx)  # TruncatedIS x KLGuard, detached
        reward = (ids == 3).float().mean(1)
        adv = (reward - reward.mean())[:, None]
        loss = (-(adv * logp) * weights * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        controllers.transform_gradient([p.grad for p in model.parameters()], ctx)
        with scaled_lr(opt, controllers.lr_scale(ctx)):  # ESS-scaled for this one step
            opt.step()
        controllers.after_step(ctx)
        metrics = controllers.metrics()
        if verbose and version % 5 == 0:
            print(
                f"step {version:3d}  lag_max {metrics.get('staleness/lag_max', 0):.0f}  "
                f"ess {metrics['ess/rho']:.3f}  lr {metrics['lr/applied']:.4f}  "
                f"guarded {metrics['kl_guard/masked']:.0f}  reward {float(reward.mean()):.3f}"
            )
        trained += int(keep.sum())
        version += 1
        snapshots.append((version, copy.deepcopy(model)))
    with torch.no_grad():
        p3 = float(torch.softmax(model(torch.arange(VOCAB)), -1)[:, 3].mean())
    summary = {
        "trained": float(trained),
        "dropped": float(dropped),
        "p_token3": p3,
        "kl_guard_masked_total": metrics.get("kl_guard/masked_total", 0.0),
        "dropped_total": metrics.get("staleness/dropped_total", 0.0),
    }
    if verbose:
        print({k: round(v, 4) for k, v in summary.items()})
    return summary


if __name__ == "__main__":
    main()
