"""A tabular causal LM over a tiny vocabulary, and exact enumeration of its sequences.

For tests that check what ``asyncrl.step.loss_step`` computes against exact expectations: the
policy at each position is a row of a table indexed by the completion prefix, so every
sequence probability, every state distribution and every expected gradient is a finite sum.
A batch holds every outcome once; ``ProbabilityWeights`` (a controller) weights each row by
its probability, so a ``token_mean`` loss over the batch is the expectation of the per-token
mean loss, and the gradient loss_step applies is the expected gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.backends.ddp import TorchBackend
from asyncrl.config import TrainConfig

f64 = torch.float64
PROMPT_TOKEN = 0


def n_states(V: int, T: int) -> int:
    """States = completion prefixes of length 0 .. T-1."""
    return sum(V**n for n in range(T))


def state_of(prefix: Sequence[int], V: int) -> int:
    """Index of a completion prefix: offset of its length plus its base-V value."""
    offset = sum(V**n for n in range(len(prefix)))
    value = 0
    for y in prefix:
        value = value * V + int(y)
    return offset + value


class TabularLM(torch.nn.Module):
    """Logits at a position are ``table[state of the completion prefix so far]`` (fp64).

    Called like a HF causal LM (``input_ids`` = one prompt token + completion). ``dropout`` > 0
    adds dropout on the logits (to check train vs eval mode)."""

    def __init__(self, table: torch.Tensor, T: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.detach().clone())
        self.T = T
        self.V = table.shape[-1]
        self.dropout = torch.nn.Dropout(dropout)
        self.eval()

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        B, L = input_ids.shape
        states = torch.zeros(B, L, dtype=torch.long)
        for b in range(B):
            comp = input_ids[b, 1:].tolist()
            for i in range(1, L):  # position i has seen the completion prefix comp[:i]
                if i < self.T:
                    states[b, i] = state_of(comp[:i], self.V)
        return SimpleNamespace(logits=self.dropout(self.table[states]))


def log_policy(table: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """[S, V] log-probabilities of each state's next token at temperature ``tau``."""
    return torch.log_softmax(table / tau, -1)


def sequences(V: int, T: int) -> torch.Tensor:
    """[V^T, T] every completion."""
    return torch.tensor(list(itertools.product(range(V), repeat=T)), dtype=torch.long)


def states_along(ys: torch.Tensor, V: int) -> torch.Tensor:
    """[N, T] the state each token of each completion was drawn in."""
    return torch.tensor([[state_of(y[:t], V) for t in range(len(y))] for y in ys.tolist()], dtype=torch.long)


def token_logprobs(logpi: torch.Tensor, ys: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """[N, T] log pi(y_t | s_t)."""
    return logpi[states, ys]


class ProbabilityWeights:
    """Test controller: token weight ``n_rows * P(row) / rows_per_outcome`` on every token of a
    row, so the batch's token_mean is the expectation over outcomes (see the module docstring)."""

    name = "probability"

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def token_weights(self, ctx: Any) -> torch.Tensor:
        return self.weights.to(ctx.logprobs.dtype).expand_as(ctx.logprobs)


class RecordingBackend(TorchBackend):
    """The DDP backend on one process (AdamW), recording what each optimizer step received."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2, **train: Any) -> None:
        tc = TrainConfig(lr=lr, warmup_steps=0, grad_clip=0.0, **train)
        super().__init__(model, tc, world=1)
        self.seen: list[tuple[list[torch.Tensor], float]] = []

    def step(self, step: int, scale: float) -> float:
        self.seen.append(([g.detach().clone() for g in self.gradients()], scale))
        return super().step(step, scale)


def rollout_batch(
    ys: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    *,
    version: int,
    lag: int,
    group_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """The rollout record columns loss_step reads, one row per completion ``ys`` [N, T]."""
    N, T = ys.shape
    return {
        R.PROMPT_IDS: torch.full((N, 1), PROMPT_TOKEN, dtype=torch.long),
        R.PROMPT_MASK: torch.ones(N, 1, dtype=torch.bool),
        R.COMPLETION_IDS: ys,
        R.COMPLETION_MASK: torch.ones(N, T, dtype=torch.bool),
        R.BEHAVIOR_LOGPROBS: behavior_logprobs.detach(),
        R.TOKEN_VERSIONS: torch.full((N, T), version - lag, dtype=torch.long),
        R.SAMPLE_ID: np.arange(N),
        R.GROUP_ID: np.arange(N) if group_ids is None else group_ids,
        R.VERSION_FIRST: np.full(N, version - lag),
        R.VERSION_LAST: np.full(N, version - lag),
    }


def ess_fraction_np(log_w: np.ndarray) -> float:
    """(Σw)² / (N Σw²), for checking controllers' LR scales independently."""
    w = np.exp(np.asarray(log_w, dtype=np.float64) - np.max(log_w))
    return float(w.sum() ** 2 / (len(w) * (w**2).sum()))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


__all__ = [
    "PROMPT_TOKEN",
    "ProbabilityWeights",
    "RecordingBackend",
    "TabularLM",
    "ess_fraction_np",
    "log_policy",
    "n_states",
    "rel_err",
    "rollout_batch",
    "sequences",
    "state_of",
    "states_along",
    "token_logprobs",
]
