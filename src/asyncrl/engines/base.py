"""The rollout-engine seam: what every generator backend (HF on CPU, vLLM on GPU) must provide.

An engine turns left-padded prompts into completions and records exactly what the
staleness math needs: the behavior log-probability of every generated token under the
*exact* sampling distribution (temperature-scaled, untruncated), the policy version that
produced each token, and optionally ``m`` Monte Carlo draws per position from that same
distribution (column 0 = the generated token) with their log-probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from asyncrl.configurable import check, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. No top-k / top-p: importance ratios need the untruncated distribution."""

    max_new_tokens: int = field(32, help="generation stops after this many tokens (or at EOS)")
    temperature: float = field(1.0, help="softmax temperature tau; 0 means greedy (eval only)")
    mc_samples: int = field(
        0, help="m: MC draws per position from pi_b (column 0 = generated token); 0 disables"
    )

    def __post_init__(self) -> None:
        check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "use an integer >= 1")
        check(self.temperature >= 0, "temperature", self.temperature, "use 0 (greedy) or a positive value")
        check(self.mc_samples >= 0, "mc_samples", self.mc_samples, "use 0 (off) or m >= 1")


@runtime_checkable
class RolloutEngine(Protocol):
    """Generate with versioned weights.

    ``generate`` returns a dict of tensors with the columns of ``asyncrl.records``:
    ``completion_ids`` [B, T] int64 (right-padded with pad id), ``completion_mask`` [B, T] bool
    (EOS included), ``behavior_logprobs`` [B, T] float32, ``token_versions`` [B, T] int32 and,
    when ``params.mc_samples = m > 0``, ``mc_ids`` / ``mc_behavior_logprobs`` [B, T, m].
    Deterministic given ``seed`` and the weights.
    """

    name: str
    #: True if ``mc_samples > 0`` yields exact draws from the sampling distribution
    #: (the "behavior_mc" cache needs them); the pipeline refuses the pairing otherwise
    supports_mc: bool

    @classmethod
    def from_pretrained(cls, path: str, *, version: int = 0, **options: object) -> RolloutEngine:
        """Build the engine from an HF checkpoint directory on local disk (how Ray actors build it)."""
        ...

    @property
    def version(self) -> int: ...

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
    ) -> dict[str, torch.Tensor]: ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...
