"""DeepSpeedBackend in one process (a 1-rank gloo group, no Ray): LR scale/restore, parity with
the torch backend, the pre-step gradient norm, and a checkpoint round trip.

Skipped only when deepspeed is not installed and ``CI`` is unset; under CI a missing extra fails.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from asyncrl.backends import TorchBackend, make_backend, scheduled_lr
from asyncrl.checkpoint import read_state, write_state
from asyncrl.config import TrainConfig
from asyncrl.step import autocast

pytestmark = pytest.mark.deepspeed

if importlib.util.find_spec("deepspeed") is None and not os.environ.get("CI"):
    pytest.skip(
        "deepspeed extra not installed (DS_BUILD_OPS=0 pip install 'asyncrl[deepspeed]')",
        allow_module_level=True,
    )

REPO = Path(__file__).resolve().parents[1]
#: DeepSpeed JIT-builds its CPU comm op once (~25 s); keep it with the test model cache
EXTENSIONS = Path(os.environ.get("ASYNCRL_TEST_CACHE", REPO / ".asyncrl_cache")) / "torch_extensions"
B, T, V = 8, 12, 64

torch.set_num_threads(1)


from ds_group import process_group  # noqa: E402, F401  (autouse: the module's process group)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def ds_backend(tc: TrainConfig, model: torch.nn.Module | None = None, stage: int = 2):
    return make_backend(
        "deepspeed", model or tiny_model(), tc, 1, zero_stage=stage, extensions_dir=EXTENSIONS
    )


def batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(T).expand(B, -1),
        "use_cache": False,
    }


def train_steps(
    backend, tc: TrainConfig, steps: range, scales=None, precision: str = "fp32"
) -> list[tuple[float, float, float]]:
    """(loss, grad norm, applied lr) per step, driven exactly like the learner does (the forward
    under ``train.precision``'s autocast, as ``loss_step`` runs it)."""
    out = []
    for s in steps:
        b = batch(s)
        with autocast("cpu", precision):
            loss = backend.model(**b, labels=b["input_ids"]).loss
        backend.backward(loss)
        norm = backend.clip_and_norm(tc.grad_clip)
        applied = backend.step(s, 1.0 if scales is None else scales[s])
        out.append((float(loss.detach()), norm, applied))
    return out


def test_lr_scale_is_applied_for_one_step_and_restored():
    tc = TrainConfig(batch_size=B, lr=1e-2, warmup_steps=4, grad_clip=1.0)
    backend = ds_backend(tc)
    assert backend.supports_gradient_transform is False and backend.sharded_state is True
    groups = backend.engine.optimizer.param_groups
    for step, scale in [(0, 0.5), (1, 2.0), (5, 0.25)]:
        b = batch(step)
        backend.backward(backend.model(**b, labels=b["input_ids"]).loss)
        backend.clip_and_norm(tc.grad_clip)
        applied = backend.step(step, scale)
        assert applied == pytest.approx(scheduled_lr(tc, step) * scale)
        assert all(g["lr"] == pytest.approx(scheduled_lr(tc, step)) for g in groups)
    # scale 0 is a no-op update (AdamW with lr 0 moves nothing, weight decay included)
    before = {k: v.clone() for k, v in backend.module.state_dict().items()}
    b = batch(9)
    backend.backward(backend.model(**b, labels=b["input_ids"]).loss)
    backend.clip_and_norm(tc.grad_clip)
    backend.step(6, 0.0)
    after = backend.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(g["lr"] == pytest.approx(tc.lr) for g in groups)


@pytest.mark.parametrize("stage", [1, 2])
def test_matches_torch_backend_with_clipping(stage):
    # lr large and grad_clip small so clipping is active on every step
    tc = TrainConfig(batch_size=B, lr=1e-2, warmup_steps=2, grad_clip=0.5, weight_decay=0.01)
    scales = [1.0, 0.5, 2.0, 1.0, 0.0]
    ds = ds_backend(tc, tiny_model(), stage)
    got = train_steps(ds, tc, range(5), scales)
    want = train_steps(TorchBackend(tiny_model(), tc, 1), tc, range(5), scales)
    for (l_ds, n_ds, lr_ds), (l_t, n_t, lr_t) in zip(got, want):
        assert l_ds == pytest.approx(l_t, abs=1e-5)
        assert n_ds == pytest.approx(n_t, rel=1e-5)
        assert lr_ds == pytest.approx(lr_t)
    assert all(n > tc.grad_clip for _, n, _ in got)  # the clip mattered
    # the pre-step norm is the one DeepSpeed clipped with (the engine exposes it only after step)
    assert got[-1][1] == pytest.approx(float(ds.engine.get_global_grad_norm()), rel=1e-6)


def test_bf16_autocast_through_the_engine_matches_the_torch_backend():
    """``train.precision=bf16`` with ZeRO: the learner's autocast wraps the DeepSpeed engine's forward;
    its fp32 partitions, gradients and optimizer step see what the torch backend's see (the same bf16
    forward), and the run stays off its fp32 trajectory (the forward did run in bf16)."""
    tc = TrainConfig(batch_size=B, lr=1e-2, warmup_steps=2, grad_clip=0.5, precision="bf16")
    ds = ds_backend(tc, tiny_model(), 2)
    got = train_steps(ds, tc, range(4), precision="bf16")
    want = train_steps(TorchBackend(tiny_model(), tc, 1), tc, range(4), precision="bf16")
    fp32 = train_steps(TorchBackend(tiny_model(), tc, 1), tc, range(4))
    for (l_ds, n_ds, _), (l_t, n_t, _) in zip(got, want):
        assert l_ds == pytest.approx(l_t, abs=1e-4)
        assert n_ds == pytest.approx(n_t, rel=1e-3)
    assert got[-1][0] != fp32[-1][0]
    assert all(p.dtype == torch.float32 for p in ds.module.parameters())


def test_checkpoint_round_trip_continues_identically(tmp_path):
    tc = TrainConfig(batch_size=B, lr=1e-2, grad_clip=1.0)
    first = ds_backend(tc)
    train_steps(first, tc, range(3))
    first.module.save_pretrained(tmp_path / "model", safe_serialization=True)
    write_state(tmp_path, "backend_rank0", first.state_dict())  # JSON + safetensors: no pickle
    want = train_steps(first, tc, range(3, 6))

    from transformers import AutoModelForCausalLM

    resumed = ds_backend(tc, AutoModelForCausalLM.from_pretrained(tmp_path / "model"))
    resumed.load_state_dict(read_state(tmp_path, "backend_rank0"))
    assert resumed.engine.global_steps == 3
    got = train_steps(resumed, tc, range(3, 6))
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-6)

    # a fresh optimizer (no state loaded) would diverge: the test can tell the difference
    fresh = ds_backend(tc, AutoModelForCausalLM.from_pretrained(tmp_path / "model"))
    fresh_losses = [g[0] for g in train_steps(fresh, tc, range(3, 6))]
    assert max(abs(a - b[0]) for a, b in zip(fresh_losses, want)) > 1e-4


def test_refuses_what_zero_cannot_do():
    tc = TrainConfig(batch_size=B, lr=1e-3, grad_clip=1.0)
    backend = ds_backend(tc)
    with pytest.raises(RuntimeError, match="gradient-transform"):
        backend.gradients()
    with pytest.raises(ValueError, match="gradient_clipping"):
        backend.clip_and_norm(2.0)
    state = backend.state_dict()
    with pytest.raises(ValueError, match="learner_workers"):
        backend.load_state_dict({**state, "world": 2})
    with pytest.raises(ValueError, match="zero_stage"):
        ds_backend(tc, stage=3)


def test_published_weights_are_compact_copies_of_zero_views():
    """ZeRO keeps parameters as views of a flat buffer; what the learner publishes must pickle (as
    the Ray object store does) to about the parameters' own bytes, not once per view the whole
    buffer, and equal them."""
    import pickle

    from asyncrl.coordinator import publishable_state

    backend = ds_backend(TrainConfig(lr=1e-3, warmup_steps=0))
    state = backend.module.state_dict()
    own_bytes = sum(v.numel() * v.element_size() for v in state.values())

    def pickled(sd) -> int:
        return len(pickle.dumps(sd))

    published = publishable_state(backend.module)
    assert published.keys() == state.keys()
    assert all(torch.equal(published[k], state[k]) and published[k].device.type == "cpu" for k in state)
    assert pickled(published) < 1.2 * own_bytes + 100_000
    # the guard is needed: the raw state dict's views carry their flat buffer along
    assert pickled({k: v.detach() for k, v in state.items()}) > 3 * own_bytes
