"""Rollout engines behind one protocol: ``HFEngine`` (CPU default) and ``VLLMEngine`` (GPU)."""

from asyncrl.engines.base import RolloutEngine, SamplingParams
from asyncrl.registry import Registry

ENGINES: Registry = Registry("engine")

__all__ = ["ENGINES", "RolloutEngine", "SamplingParams"]
