"""How a rollout samples (``SamplingParams``): the run config's ``sampling`` section.

Its own torch-free module, so the run config (``asyncrl.config``) parses without importing torch:
``asyncrl run`` starts Ray's processes while the driver imports the rest (``asyncrl.pipeline``).
Re-exported by ``asyncrl.engines`` and ``asyncrl.engines.base``, where engines use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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

    def __post_init__(self) -> None:
        check(
            self.max_new_tokens == "auto" or self.max_new_tokens >= 1,
            "max_new_tokens",
            self.max_new_tokens,
            "use an integer >= 1 or auto",
        )
        check(self.temperature >= 0, "temperature", self.temperature, "use 0 (greedy) or a positive value")
        check(self.mc_samples >= 0, "mc_samples", self.mc_samples, "use 0 (off) or m >= 1")
