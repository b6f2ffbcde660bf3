"""How a rollout samples (``SamplingParams``): the run config's ``sampling`` section.

Its own torch-free module, so the run config (``asyncrl.config``) parses without importing torch:
``asyncrl run`` starts Ray's processes while the driver imports the rest (``asyncrl.pipeline``).
Re-exported by ``asyncrl.engines`` and ``asyncrl.engines.base``, where engines use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from asyncrl.configurable import check, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. No top-k / top-p: importance ratios need the untruncated distribution."""

    max_new_tokens: int | Literal["auto"] = field(
        "auto",
        help="generation stops after this many tokens (or at EOS); auto = the task's longest answer in "
        "tokens of the run's tokenizer + 1 (EOS), resolved when the run config is loaded",
    )
    temperature: float = field(1.0, help="softmax temperature tau; 0 means greedy (eval only)")
    mc_samples: int = field(
        0, help="m: MC draws per position from pi_b (column 0 = generated token); 0 disables"
    )

    heavy_tail: float = field(
        0.0,
        help="alpha > 0: each completion also stops at its own token budget, drawn from a Pareto law of "
        "shape alpha (heavy-tailed lengths for scheduling studies; smaller alpha = heavier tail; a "
        "completion that ends at EOS first is unchanged); 0 = off",
    )

    def __post_init__(self) -> None:
        check(
            self.max_new_tokens == "auto" or self.max_new_tokens >= 1,
            "max_new_tokens",
            self.max_new_tokens,
            "use an integer >= 1 or auto",
        )
        check(self.temperature >= 0, "temperature", self.temperature, "use 0 (greedy) or a positive value")
        check(self.mc_samples >= 0, "mc_samples", self.mc_samples, "use 0 (off) or m >= 1")
        check(
            self.heavy_tail >= 0 and math.isfinite(self.heavy_tail),
            "heavy_tail",
            self.heavy_tail,
            "use 0 (off) or a Pareto shape alpha > 0, e.g. 1.0",
        )

    def token_budgets(self, n: int, seed: int) -> np.ndarray | None:
        """Per-completion token budgets ``L_i`` for ``heavy_tail = alpha > 0`` (None when off).

        ``L_i = min(N, floor(L_0 U_i^(-1/alpha)))`` with ``U_i ~ Uniform(0, 1]``, ``N = max_new_tokens``
        and ``L_0 = ceil(N / 16)``: a Pareto law truncated at ``N``, so ``P(L_i >= x) = (L_0 / x)^alpha``
        (at alpha = 1: median ``2 L_0 = N / 8``, one completion in 16 reaches ``N``). A completion
        stops at EOS or at its budget, whichever comes first. Truncation does not change the
        per-token distribution (it is ``max_new_tokens`` per row), so behavior log-probs, the
        importance ratios and the estimators stay exact. Why: a rollout batch waits for its longest
        completion, and real models' lengths are heavy-tailed; this makes that regime reproducible
        with any model. Drawn from ``seed`` alone (the block's seed), in a stream apart from the
        token draws, so the same block gets the same budgets in every engine and every run.
        """
        if not self.heavy_tail:
            return None
        if self.max_new_tokens == "auto":
            raise ValueError("token_budgets needs a resolved sampling.max_new_tokens (not 'auto')")
        cap = int(self.max_new_tokens)
        u = 1.0 - np.random.default_rng([int(seed) & (2**63 - 1), 0x7A11]).random(n)  # (0, 1]
        l0 = math.ceil(cap / 16)
        return np.minimum(cap, np.floor(l0 * u ** (-1.0 / self.heavy_tail))).astype(np.int64)
