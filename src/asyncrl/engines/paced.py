"""``PacedEngine``: any engine with generation padded to a set latency, optionally heavy-tailed.

A study tool for the pipeline's own scheduling. On a small machine real generation cannot
scale with the number of generators (they share the cores), so the generation-dominated regime
of a cluster (generation several times slower than a learner step) is emulated: each
``generate`` call runs the inner engine (``inner``, default ``hf``) and then sleeps until
``latency_s`` has passed. Sleeping uses no CPU, so N generators really do produce N times as
many blocks per second and what is measured is the pipeline's scaling (admission, in-order
delivery, weight publication), not the machine's.

Heavy tails: each sample independently "has a long completion" with probability ``tail_prob``;
a batched call runs until its longest completion is done, so a call holding one takes
``tail_factor`` times ``latency_s``. Draws are seeded from ``(tail_seed, seed of the call)``,
so the same block straggles in every run. The tokens, log-probabilities and versions are the
inner engine's, unchanged: only time is emulated, so every contract check still applies.

By dotted path (it is not registered)::

    pipeline.engine=asyncrl.engines.paced:PacedEngine
    pipeline.engine_options={latency_s: 0.5, tail_prob: 0.02, tail_factor: 10}
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.engines.base import SamplingParams


class PacedEngine:
    """Wraps ``inner`` (a registered engine name or dotted path); ``generate`` takes at least
    ``latency_s`` seconds, ``tail_factor`` times that when one of its samples is in the tail."""

    name = "paced"

    def __init__(
        self,
        inner: Any,
        *,
        latency_s: float,
        tail_prob: float = 0.0,
        tail_factor: float = 10.0,
        tail_seed: int = 0,
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s}")
        if not 0.0 <= tail_prob <= 1.0:
            raise ValueError(f"tail_prob must be a probability in [0, 1], got {tail_prob}")
        if tail_factor < 1.0:
            raise ValueError(
                f"tail_factor must be >= 1 (a tail sample is that many times longer), got {tail_factor}"
            )
        self.inner = inner
        self.latency_s = latency_s
        self.tail_prob = tail_prob
        self.tail_factor = tail_factor
        self.tail_seed = tail_seed
        self.last_tail = False  # whether the last call held a tail sample (for tests and studies)

    @property
    def supports_mc(self) -> bool:
        return bool(getattr(self.inner, "supports_mc", False))

    @property
    def pad_id(self) -> int:
        return int(getattr(self.inner, "pad_id", 0))

    @classmethod
    def _inner_class(cls, inner: str) -> Any:
        from asyncrl.engines import ENGINES

        return ENGINES.get(inner)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        version: int = 0,
        latency_s: float = 1.0,
        tail_prob: float = 0.0,
        tail_factor: float = 10.0,
        tail_seed: int = 0,
        inner: str = "hf",
        **inner_options: Any,
    ) -> PacedEngine:
        """Build the inner engine from ``path`` with ``inner_options`` and pace it."""
        engine = cls._inner_class(inner).from_pretrained(path, version=version, **inner_options)
        return cls(
            engine, latency_s=latency_s, tail_prob=tail_prob, tail_factor=tail_factor, tail_seed=tail_seed
        )

    @classmethod
    def check_supported(cls, path: str | Path | None, params: SamplingParams, **options: Any) -> None:
        """The pacing options' ranges, then the inner engine's own checks with its options."""
        pacing = {
            k: options.pop(k) for k in ("latency_s", "tail_prob", "tail_factor", "tail_seed") if k in options
        }
        inner = options.pop("inner", "hf")
        cls(None, **{"latency_s": 1.0, **pacing})
        cls._inner_class(inner).check_supported(path, params, **options)

    @property
    def version(self) -> int:
        return self.inner.version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)

    @property
    def fingerprints(self) -> Any:
        """The inner engine's provenance fingerprints (version -> fingerprint; None if it keeps none)."""
        return getattr(self.inner, "fingerprints", None)

    def duration(self, n: int, seed: int) -> float:
        """Seconds a call of ``n`` samples with sampling seed ``seed`` takes (deterministic)."""
        if self.tail_prob <= 0:
            self.last_tail = False
            return self.latency_s
        rng = np.random.default_rng([self.tail_seed, seed % (2**63)])
        self.last_tail = bool((rng.random(n) < self.tail_prob).any())
        return self.latency_s * (self.tail_factor if self.last_tail else 1.0)

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
    ) -> dict[str, torch.Tensor]:
        """The inner engine's rollout, returned once ``duration(B, seed)`` seconds have passed."""
        t0 = time.perf_counter()
        out = self.inner.generate(prompt_ids, prompt_mask, params, seed=seed)
        remaining = self.duration(int(prompt_ids.shape[0]), seed) - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return out
