"""``MemoryProbe``'s cadence: mem/* is sampled on the first step, then every ``every_s`` seconds."""

from __future__ import annotations

import warnings

from asyncrl.telemetry.memory import LEARNER_RSS, WORKERS_RSS, MemoryProbe


def _sample(probe: MemoryProbe) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Ray here: the Ray figures are off, the learner's RSS is not
        return probe.sample()


def test_first_sample_is_due_then_only_after_every_s() -> None:
    import ray

    probe = MemoryProbe(every_s=3600.0)
    assert probe.due()
    out = _sample(probe)
    assert out[LEARNER_RSS] > 0 and WORKERS_RSS not in out  # no Ray here: only the learner's own RSS
    assert not ray.is_initialized()  # sampling never starts a Ray instance (it did: auto-init)
    assert not probe.due()


def test_every_s_zero_samples_every_step() -> None:
    probe = MemoryProbe(every_s=0.0)
    _sample(probe)
    assert probe.due()
