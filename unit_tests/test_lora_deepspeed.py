"""A LoRA student behind the DeepSpeed ZeRO backend (one process, a 1-rank gloo group): only the
adapters are optimised and published, and the steps match the torch backend's."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from asyncrl.backends import TorchBackend, make_backend
from asyncrl.config import TrainConfig
from asyncrl.coordinator import publishable_state
from asyncrl.lora import LoRAConfig, adapter_state, apply_lora

pytestmark = pytest.mark.deepspeed

if importlib.util.find_spec("deepspeed") is None and not os.environ.get("CI"):
    pytest.skip("deepspeed extra not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
EXTENSIONS = Path(os.environ.get("ASYNCRL_TEST_CACHE", REPO / ".asyncrl_cache")) / "torch_extensions"
B, T, V = 8, 12, 64
LORA = LoRAConfig(r=4, alpha=8.0)

torch.set_num_threads(1)


from ds_group import process_group  # noqa: E402, F401  (autouse: the module's process group)


def lora_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return apply_lora(LlamaForCausalLM(config), LORA, seed=1)


def steps(backend, n: int) -> list[float]:
    losses = []
    for s in range(n):
        ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(s))
        loss = backend.model(input_ids=ids, labels=ids, use_cache=False).loss
        backend.backward(loss)
        backend.clip_and_norm(0.5)
        backend.step(s, 1.0)
        losses.append(float(loss.detach()))
    return losses


def test_deepspeed_trains_and_publishes_adapters_only_like_the_torch_backend():
    tc = TrainConfig(batch_size=B, lr=1e-2, warmup_steps=0, grad_clip=0.5)
    model = lora_model()
    base = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    ds = make_backend("deepspeed", model, tc, 1, zero_stage=2, extensions_dir=EXTENSIONS)
    ref = TorchBackend(lora_model(), tc, 1)
    got, want = steps(ds, 4), steps(ref, 4)
    assert got == pytest.approx(want, abs=1e-5)
    after = ds.module.get_base_model().state_dict()
    assert all(torch.equal(base[k], after[k]) for k in base)  # the base is frozen
    a, b = adapter_state(ds.module), adapter_state(ref.module)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert all(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # the adapters trained
    published = publishable_state(ds.module)
    assert published.keys() == a.keys()
