"""Mixed precision: the learner's bf16 autocast (``train.precision``) and a bf16 teacher
(``pipeline.teacher_dtype``). Each must change the arithmetic (else the option does nothing), stay
close to fp32, and keep what must stay fp32 in fp32: weights, gradients, optimizer state, the
teacher cache's columns."""

from __future__ import annotations

import copy

import pytest
import torch
from tabular import rollout_batch

from asyncrl import records as R
from asyncrl.backends.ddp import TorchBackend
from asyncrl.caches import DenseCache, TopKCache, score_teacher
from asyncrl.config import ConfigError, TrainConfig, load_config
from asyncrl.controllers import chain
from asyncrl.estimators import build as build_estimator
from asyncrl.lab.presets import PRESETS, build_model
from asyncrl.step import StepOptions, StepParts, autocast, loss_step

torch.set_num_threads(1)
V, N, P, T = 19, 16, 5, 6


def _model(seed: int, spec: str = "student") -> torch.nn.Module:
    return build_model(getattr(PRESETS.get("tiny"), spec), V, seed, pad_id=0, bos_id=1, eos_id=2).eval()


def _batch(teacher: torch.nn.Module) -> dict:
    g = torch.Generator().manual_seed(3)
    ys = torch.randint(3, V, (N, T), generator=g)
    batch = rollout_batch(ys, torch.full((N, T), -2.0), version=0, lag=0)
    batch[R.PROMPT_IDS] = torch.randint(3, V, (N, P), generator=g)
    batch[R.PROMPT_MASK] = torch.ones(N, P, dtype=torch.bool)
    batch.update(score_teacher(teacher, batch, DenseCache()))
    return batch


def _step(precision: str, student: torch.nn.Module, batch: dict) -> tuple[float, dict, TorchBackend]:
    model = copy.deepcopy(student)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    backend = TorchBackend(model, TrainConfig(lr=1e-2, warmup_steps=1), world=1)
    est = build_estimator("forward_kl", {"dense": True})
    parts = StepParts(backend, est, chain(), StepOptions(grad_clip=0.0, precision=precision))
    result = loss_step(batch, parts, 0)
    assert result.stepped
    update = {k: v.detach() - before[k] for k, v in model.named_parameters()}
    return result.loss, update, backend


def test_bf16_autocast_changes_the_forward_but_not_the_step_direction() -> None:
    """The same step at fp32 and at bf16 autocast: the loss differs (the matmuls did run in bf16)
    by under 1 %, the update points the same way (cosine > 0.99), and the weights, their gradients
    and AdamW's moments stay fp32 (the master copy)."""
    student, teacher = _model(0), _model(1, "teacher")
    batch = _batch(teacher)
    loss32, up32, _ = _step("fp32", student, batch)
    loss16, up16, backend = _step("bf16", student, batch)
    assert loss16 != loss32
    assert abs(loss16 - loss32) / loss32 < 1e-2, (loss16, loss32)
    a = torch.cat([u.flatten() for u in up32.values()])
    b = torch.cat([u.flatten() for u in up16.values()])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    for p in backend.module.parameters():
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
    for state in backend.optimizer.state.values():
        assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step")


def test_autocast_runs_matmuls_in_bf16_only_when_asked() -> None:
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast("cpu", "fp32"):
        assert lin(x).dtype == torch.float32
    with autocast("cpu", "bf16"):
        assert lin(x).dtype == torch.bfloat16


def test_unknown_precision_names_the_field() -> None:
    with pytest.raises(ValueError, match="precision='fp16'"):
        StepOptions(precision="fp16")
    with pytest.raises(ConfigError, match=r"train\.precision"):
        load_config(None, ["train.precision=fp16"])
    with pytest.raises(ConfigError, match=r"pipeline\.teacher_dtype"):
        load_config(None, ["pipeline.teacher_dtype=bf16"])


@pytest.mark.parametrize("cache", [DenseCache(), TopKCache(k=4)], ids=["dense", "topk"])
def test_a_bf16_teacher_writes_fp32_columns_close_to_the_fp32_teachers(cache) -> None:
    """``score_teacher`` casts a half-precision teacher's logits to fp32 before the cache's
    log-softmax, so the columns are fp32 and differ from the fp32 teacher's only by the forward's
    rounding (log-probabilities within 0.1 nats here), not by a bf16 log-softmax."""
    teacher = _model(1, "teacher")
    batch = _batch(teacher)
    cols32 = score_teacher(teacher, batch, cache)
    cols16 = score_teacher(copy.deepcopy(teacher).to(torch.bfloat16), batch, cache)
    assert cols32.keys() == cols16.keys()
    changed = False
    for key, v32 in cols32.items():
        v16 = cols16[key]
        assert v16.dtype == v32.dtype, key
        if v32.is_floating_point():
            assert v16.dtype == torch.float32, key
            finite = torch.isfinite(v32)
            assert torch.equal(finite, torch.isfinite(v16)), key
            diff = (v16[finite] - v32[finite]).abs()
            assert diff.max() < 0.1, (key, float(diff.max()))
            changed |= bool(diff.max() > 0)
    assert changed, "the bf16 teacher scored exactly as the fp32 one: it did not run in bf16"
