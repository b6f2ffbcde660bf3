"""Metric correctness with two learner ranks and uneven drops (issue 12 item 5).

Two ranks run ``loss_step`` in two threads with in-process collectives (the same
``Collectives`` interface ``torch.distributed`` serves in a run: all_sum, all_cat, gather_rows)
and a DDP-style gradient mean. What rank 0 logs (``step_metrics``, ``bucket_metrics``) must equal
what the written ``samples.parquet`` says, and the step both ranks take must equal one
single-process step on the union of their kept samples: every valid token counts the same, a
rank whose samples were all dropped contributes nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from tabular import RecordingBackend, TabularLM, ess_fraction_np, rollout_batch, sequences, states_along

from asyncrl import records as R
from asyncrl.caches import DenseCache
from asyncrl.collectives import Collectives
from asyncrl.controllers import build, chain
from asyncrl.estimators import build as build_estimator
from asyncrl.step import StepOptions, StepParts, loss_step
from asyncrl.telemetry import names as N
from asyncrl.telemetry.sinks import RunWriter
from asyncrl.telemetry.steps import bucket_metrics, sample_rows, step_metrics
from asyncrl.telemetry.summary import read_samples

torch.set_num_threads(1)
f64 = torch.float64
V, T, VERSION, MAX_LAG = 4, 2, 5, 1
_g = torch.Generator().manual_seed(21)
THETA = torch.randn(5, V, dtype=f64, generator=_g)
TEACHER = 2 * torch.randn(5, V, dtype=f64, generator=_g)
OLD = {lag: THETA + 0.6 * lag * torch.randn(5, V, dtype=f64, generator=_g) for lag in range(3)}


class Hub:
    """Where two threads meet: each deposits its value and gets every rank's, in rank order."""

    def __init__(self, world: int) -> None:
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


@dataclass(frozen=True)
class ThreadCollectives(Collectives):
    hub: Any = None

    def all_sum(self, values: list[float]) -> list[float]:
        return [float(sum(col)) for col in zip(*self.hub.exchange(self.rank, list(values)))]

    def all_cat(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.hub.exchange(self.rank, x.detach().cpu())).to(x.device)

    def gather_rows(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        parts = self.hub.exchange(self.rank, rows)
        return {k: np.concatenate([p[k] for p in parts]) for k in rows}

    def barrier(self) -> None:
        self.hub.exchange(self.rank, None)


class DDPBackend(RecordingBackend):
    """AdamW on one replica; the gradient is averaged over ranks after backward, as DDP does."""

    def __init__(self, model: torch.nn.Module, comm: ThreadCollectives) -> None:
        super().__init__(model, lr=0.05)
        self.comm = comm

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        for p in self.params:
            grads = self.comm.hub.exchange(self.comm.rank, p.grad.detach().clone())
            p.grad.copy_(torch.stack(grads).mean(0))


def rank_batch(lags: list[int], lengths: list[int], id_offset: int) -> dict[str, Any]:
    """Samples of the given head lags (behavior = the table that many versions old) and lengths."""
    pick = torch.tensor([3, 6, 9, 12, 14, 1, 7, 10])[: len(lags)]
    ys = sequences(V, T)[pick]
    st = states_along(ys, V)
    lb = torch.stack([torch.log_softmax(OLD[lag], -1)[st[i], ys[i]] for i, lag in enumerate(lags)])
    batch = rollout_batch(ys, lb, version=VERSION, lag=0)
    batch[R.COMPLETION_MASK] = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    batch[R.VERSION_FIRST] = VERSION - np.asarray(lags)
    batch[R.VERSION_LAST] = batch[R.VERSION_FIRST]
    batch[R.TOKEN_VERSIONS] = torch.as_tensor(batch[R.VERSION_FIRST])[:, None].expand(-1, T).clone()
    batch[R.SAMPLE_ID] = id_offset + np.arange(len(lags))
    batch[R.GROUP_ID] = id_offset + np.arange(len(lags))
    batch[R.PROMPT_ID] = np.zeros(len(lags), dtype=np.int64)
    batch.update(DenseCache().build(TEACHER[st], batch))
    return batch


def _controllers() -> Any:
    return chain(build("bounded_staleness", {"max_lag": MAX_LAG}), build("ess_lr", {}))


def _estimator() -> Any:
    return build_estimator("forward_kl", {"dense": True})


def run_two_ranks(
    batches: list[dict[str, Any]], run_dir: Any
) -> tuple[list[Any], dict[str, float], list[Any]]:
    hub = Hub(2)
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            comm = ThreadCollectives(rank=rank, world=2, hub=hub)
            model = TabularLM(THETA, T)
            parts = StepParts(
                DDPBackend(model, comm), _estimator(), _controllers(), StepOptions(grad_clip=0.0), comm
            )
            result = loss_step(batches[rank], parts, VERSION)
            rows = comm.gather_rows(sample_rows(batches[rank], result, VERSION, step=VERSION + 1))
            out[rank] = (result, rows, model)
        except BaseException as err:
            errors.append(err)
            hub.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    (result, rows, _), _ = out
    writer = RunWriter(run_dir, tensorboard=False)  # rank 0 writes, as the learner does
    writer.log_samples(rows)
    logged = {**step_metrics(result), **bucket_metrics(rows)}
    writer.log_step(VERSION + 1, logged)
    writer.close()
    return [o[0] for o in out], logged, [o[2] for o in out]


SCENARIOS = {
    "uneven": ([0, 0, 1, 2, 2, 1], [2, 1, 2, 2, 1, 1], [2, 2, 2, 2, 0, 1], [1, 2, 2, 1, 2, 2]),
    "rank 1 all dropped": ([0, 1, 0, 2, 1, 0], [2, 2, 1, 2, 1, 2], [2, 2, 2, 2, 2, 2], [2, 1, 2, 2, 1, 2]),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_logged_figures_equal_samples_parquet_and_the_single_process_step(scenario: str, tmp_path) -> None:
    lags0, len0, lags1, len1 = SCENARIOS[scenario]
    batches = [rank_batch(lags0, len0, 0), rank_batch(lags1, len1, 100)]
    results, logged, models = run_two_ranks(batches, tmp_path)

    df = read_samples(tmp_path)
    assert len(df) == 12 and sorted(df["sample_id"]) == sorted([*range(6), *range(100, 106)])
    kept = df[df["kept"]]
    n_tok = kept["completion_len"].to_numpy()
    assert logged[N.SAMPLES_KEPT] == len(kept) and logged[N.DROPPED] == len(df) - len(kept)
    assert logged[N.TOKENS] == n_tok.sum()
    assert logged[N.LAG_MEAN] == pytest.approx(kept["lag"].mean(), rel=1e-12)
    assert logged[N.LAG_MAX] == kept["lag"].max()
    assert logged[N.ESS_RHO] == pytest.approx(ess_fraction_np(kept["seq_log_ratio"].to_numpy()), rel=1e-9)
    # token_mean: every valid token of every rank weighs the same
    assert logged[N.LOSS] == pytest.approx((kept["loss"] * n_tok).sum() / n_tok.sum(), rel=1e-9)
    kl = (kept["kl_behavior_current"] * n_tok).sum() / n_tok.sum()
    assert logged[N.KL_BEHAVIOR_CURRENT] == pytest.approx(kl, rel=1e-9)
    for lag, group in kept.groupby("lag"):
        assert logged[N.bucket_key(str(lag), "n")] == len(group)
        assert logged[N.bucket_key(str(lag), "loss")] == pytest.approx(group["loss"].mean(), rel=1e-9)
    # both ranks took the same LR scale (from the global ESS) and reached the same weights
    assert results[0].metrics["ess/rho"] == results[1].metrics["ess/rho"] == pytest.approx(logged[N.ESS_RHO])
    assert torch.equal(models[0].table, models[1].table)

    # ... which are the weights of one process stepping on the union of the kept samples
    union = {k: _cat(batches[0][k], batches[1][k]) for k in batches[0]}
    keep = np.array(df.set_index("sample_id").loc[union[R.SAMPLE_ID], "kept"], dtype=bool)
    sub = {k: v[keep] for k, v in union.items()}
    model = TabularLM(THETA, T)
    one = loss_step(
        sub,
        StepParts(RecordingBackend(model, lr=0.05), _estimator(), _controllers(), StepOptions(grad_clip=0.0)),
        VERSION,
    )
    assert one.loss == pytest.approx(logged[N.LOSS], rel=1e-12)
    assert one.lr_applied == pytest.approx(results[0].lr_applied, rel=1e-12)
    torch.testing.assert_close(models[0].table, model.table, rtol=0, atol=1e-14)


def _cat(a: Any, b: Any) -> Any:
    return torch.cat([a, b]) if isinstance(a, torch.Tensor) else np.concatenate([a, b])
