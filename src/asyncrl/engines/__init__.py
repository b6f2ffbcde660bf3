"""Rollout engines behind one protocol: ``HFEngine`` (CPU default) and ``VLLMEngine`` (GPU);
``ContinuousBatcher`` decodes several ``HFEngine`` rollouts in shared steps."""

from asyncrl.engines.base import EngineDeadError, RolloutEngine, SamplingParams
from asyncrl.engines.continuous import BatchedRollout, ContinuousBatcher
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.vllm import VLLMEngine  # cheap: vllm itself is imported in from_pretrained
from asyncrl.registry import Registry

ENGINES: Registry = Registry("engine")

ENGINES.add("hf", HFEngine)
ENGINES.add("vllm", VLLMEngine)

__all__ = [
    "ENGINES",
    "BatchedRollout",
    "ContinuousBatcher",
    "EngineDeadError",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
]
