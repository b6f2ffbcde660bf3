"""A user controller with an admission hook, run through the real pipeline.

``AdmissionTokenBucket`` throttles how far generation may run ahead of the learner, below what
``pipeline.max_lag`` allows: a bucket of ``burst`` rollout batches' worth of samples, refilled
with ``rate`` batches per learner version (an optimizer step); a block may start only if the
bucket holds its samples. With ``rate=1, burst=2`` generation settles one rollout batch ahead
of the learner (every block is admitted at most one version before the version that trains it)
however many generators there are and however large ``max_lag`` is.

The controller sees only ``admit(req)`` calls, not whether the rest of the chain agreed. It
infers its grants from the ordering rule: blocks are admitted strictly in stream order, so once
a request for block ``i`` arrives, every block before ``i`` was admitted, at the version of its
last request. A retried block (its generator died) keeps its admission and is not asked again.

The PolicyStore builds the chain from config, in its own process, so the class is named by
dotted path and its module must be importable there: Ray puts the directory of the script it
was started from on the workers' path, which is how ``python examples/admission_throttle.py``
finds ``admission_throttle:AdmissionTokenBucket``. Run (Ray, tiny preset, about a minute)::

    python examples/admission_throttle.py                          # rate 1, burst 2, max_lag 3
    python examples/admission_throttle.py pipeline.generators=2    # any key=value override
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import RunConfig, load_config
from asyncrl.configurable import check, field
from asyncrl.controllers import AdmissionRequest

CONFIG = Path(__file__).resolve().parent / "configs" / "opd_tiny.yaml"
#: how the run config names the controller (dotted path: this file's directory is on the path)
NAME = "admission_throttle:AdmissionTokenBucket"


@dataclass(frozen=True)
class AdmissionTokenBucketConfig:
    rate: float = field(1.0, help="rollout batches' worth of samples added per learner version (>= 1)")
    burst: float = field(2.0, help="bucket size in rollout batches: how far generation may run ahead")

    def __post_init__(self) -> None:
        # a rollout batch takes at least one version, so a slower refill would starve the learner
        check(self.rate >= 1, "rate", self.rate, "use >= 1 batch per version (less starves the learner)")
        check(self.burst >= 1, "burst", self.burst, "use >= 1 (a whole rollout batch must fit)")


class AdmissionTokenBucket:
    """Admit a block only if the bucket holds its ``n`` samples (see the module docstring)."""

    name = "admission_token_bucket"
    Config = AdmissionTokenBucketConfig

    def __init__(self, rate: float = 1.0, burst: float = 2.0) -> None:
        self.config = AdmissionTokenBucketConfig(rate=rate, burst=burst)
        self.tokens = float(burst)  # in rollout batches
        self.version = 0  # learner version the bucket was last refilled at
        self.asked: tuple[int, float] | None = None  # (block, cost) of the latest request
        self.granted = 0
        self.waited = 0  # blocks the bucket held back at least once
        self._held: int | None = None

    def admit(self, req: AdmissionRequest) -> bool:
        cost = req.n / req.batch_size
        if self.asked is not None:
            block, asked_cost = self.asked
            if block < req.block_index:  # a later block is asked about: the earlier one was admitted
                self.tokens -= asked_cost
                self.granted += 1
            elif block > req.block_index:  # the stream restarted (a restore): that request is void
                self._held = None
        if req.learner_version > self.version:
            gained = self.config.rate * (req.learner_version - self.version)
            self.tokens = min(self.config.burst, self.tokens + gained)
            self.version = req.learner_version
        self.asked = (req.block_index, cost)
        ok = self.tokens >= cost - 1e-9
        if not ok and self._held != req.block_index:
            self.waited += 1
            self._held = req.block_index
        return ok

    def metrics(self) -> dict[str, float]:
        return {
            "token_bucket/tokens": self.tokens,
            "token_bucket/granted": float(self.granted),
            "token_bucket/waited": float(self.waited),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "version": self.version,
            "granted": self.granted,
            "waited": self.waited,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens = float(state["tokens"])
        self.version = int(state["version"])
        self.granted = int(state["granted"])
        self.waited = int(state["waited"])
        self.asked = self._held = None


def build_config(argv: list[str] | None = None) -> RunConfig:
    """The tiny OPD config, 3 generators at ``max_lag=3``, throttled by the bucket; plus overrides."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    base = [
        "run_dir=runs/admission_throttle",
        "train.steps=8",
        "train.eval_every=0",
        "telemetry.progress=false",
        "pipeline.generators=3",
        "pipeline.max_lag=3",
        f"controllers=[{{name: '{NAME}', options: {{rate: 1, burst: 2}}}}]",
    ]
    return load_config(CONFIG, [*base, *overrides])


def main(argv: list[str] | None = None) -> Any:
    """Run the throttled pipeline and print how far ahead of the learner each block was admitted."""
    import asyncrl
    from asyncrl.telemetry.summary import read_samples

    cfg = build_config(argv)
    result = asyncrl.run(cfg)
    s = read_samples(result.run_dir)
    blocks = s.groupby("block_index")[["admit_version", "expected_version", "learner_version"]].first()
    ahead = (blocks["expected_version"] - blocks["admit_version"]).value_counts().sort_index()
    print(f"max_lag={cfg.pipeline.max_lag}; blocks by versions admitted ahead of training: {ahead.to_dict()}")
    print(f"lag of trained samples: {s[s['kept']]['lag'].value_counts().sort_index().to_dict()}")
    return result


if __name__ == "__main__":
    main()
