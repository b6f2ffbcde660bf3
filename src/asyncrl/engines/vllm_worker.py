"""vLLM worker extension: in-place weight reload for ``VLLMEngine.load_weights``.

vLLM mixes this class into every worker process (``LLM(worker_extension_cls=...)``), so its
methods become callable by name through ``LLM.collective_rpc``. That is the supported way
to run our code next to the model: no pickled callables, hence no
``VLLM_ALLOW_INSECURE_SERIALIZATION``.

Weights travel as ``torch.save`` bytes. ``collective_rpc`` arguments go through vLLM's
msgpack IPC, which carries ``bytes`` intact but turns a dict of tensors into nested lists.
The bytes are decoded with ``torch.load(weights_only=True)``, which only rebuilds tensors and
plain containers, never arbitrary objects.

This module runs inside the vLLM worker process and must import only torch and stdlib.
"""

from __future__ import annotations

import io
from typing import Any

import torch

#: name of the RPC method ``VLLMEngine`` calls; keep in sync with the method below
RELOAD_METHOD = "asyncrl_reload_weights"


def serialize_state_dict(state_dict: dict[str, torch.Tensor]) -> bytes:
    """Tensors -> ``torch.save`` bytes (moved to CPU and made contiguous, so any device works).
    Tied keys stay one tensor (``torch.save`` writes a shared storage once). Runs in the engine's
    process, never in a vLLM worker, hence the import here."""
    from asyncrl.tied import copy_once

    buf = io.BytesIO()
    torch.save(copy_once(state_dict, lambda v: v.detach().to("cpu").contiguous()), buf)
    return buf.getvalue()


def deserialize_state_dict(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of ``serialize_state_dict``; refuses anything but tensors in a flat dict."""
    sd = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
    ):
        raise TypeError("weight payload must be a flat dict[str, Tensor] (serialize_state_dict output)")
    return sd


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (it owns ``model_runner``)."""

    reload_weights: Any  # provided by the vLLM worker this class is mixed into

    def asyncrl_reload_weights(self, blob: bytes) -> int:
        """Load a full HF-named state dict in place; return the number of tensors received.

        The worker's ``reload_weights`` (-> ``model_runner.reload_weights``) maps checkpoint
        names onto vLLM's fused layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj) exactly as
        at load time and keeps the parameters' storage, so captured graphs and the KV-cache
        layout stay valid.
        """
        sd = deserialize_state_dict(blob)
        self.reload_weights(weights_iterator=iter(sd.items()))
        return len(sd)
