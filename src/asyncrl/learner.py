"""The learner: ``train_loop_per_worker`` for Ray Train, one readable loop with parts injected.

Per step, top to bottom::

    batch (Ray Data shard) -> consumption gate (controllers.keep) -> student forward
    -> estimator loss -> backward (DDP all-reduce) -> controllers: token weights were applied
    in the loss, gradient transform, LR scale for this one step -> optimizer step
    -> rank 0 publishes weights v+1, then releases admission budget -> telemetry

Learner version ``v`` = optimizer steps applied. A sample's lag at consumption is
``v - version_first``. Nothing here knows which estimator or controllers run: they are built
from the config by name.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.backends import make_backend
from asyncrl.config import RunConfig
from asyncrl.controllers import build_chain
from asyncrl.controllers.base import SampleInfo, StepContext
from asyncrl.controllers.functional import ess_fraction
from asyncrl.estimators import accepts_token_logprobs
from asyncrl.estimators import build as build_estimator
from asyncrl.estimators.functional import gather_logprobs

STATE_FILE = "asyncrl_state.json"


@dataclass(frozen=True)
class LearnerSpec:
    """Everything a Train worker needs (picklable)."""

    cfg: RunConfig
    student_dir: str
    run_dir: str
    namespace: str
    store_name: str
    eval_prompts: list[tuple[str, str]]  # (prompt, answer) held-out split
    resume_dir: str | None = None
    fail_at_step: int | None = None  # fault injection for resume tests


def controller_specs(cfg: RunConfig) -> list[tuple[str, dict[str, Any]]]:
    """Bounded staleness at ``pipeline.max_lag`` always comes first; user controllers follow."""
    specs = [("bounded_staleness", {"max_lag": cfg.pipeline.max_lag})]
    specs += [(c.name, dict(c.options)) for c in cfg.controllers]
    return specs


# --- distributed helpers -----------------------------------------------------------------------
def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def comm_device() -> torch.device:
    """Where collective tensors must live: NCCL reduces only CUDA tensors, gloo CPU ones."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: list[float], world: int) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(t)
    return t.tolist()


def gather_rows(rows: dict[str, np.ndarray], world: int) -> dict[str, np.ndarray]:
    """Per-sample telemetry of every rank, concatenated in rank order (identical on all ranks)."""
    if world == 1:
        return rows
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, rows)
    return {k: np.concatenate([r[k] for r in out]) for k in rows}


def all_cat(x: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate a 1-D tensor of any length over ranks (rank order)."""
    if world == 1:
        return x
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, x.cpu())
    return torch.cat(out).to(x.device)


def publishable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the PolicyStore ships to engines: compact CPU copies of ``model.state_dict()``.

    Engines live in other processes, maybe on other devices, hence CPU. A copy even on CPU:
    ZeRO keeps parameters as views of one flat buffer, and pickling a view writes its whole
    storage (measured on the `small` student: 191 ms vs 13 ms per publish).
    """
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


# --- checkpoint ----------------------------------------------------------------------------------
def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    backend: Any,
    controllers: Any,
    step: int,
    ledger: np.ndarray,
    counters: dict[str, int],
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path / "model", safe_serialization=True)
    torch.save(
        {
            # sharded backends (ZeRO) write backend_rank<r>.pt on every rank instead
            "backend": None if getattr(backend, "sharded_state", False) else backend.state_dict(),
            "controllers": controllers.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        },
        path / "trainer_state.pt",
    )
    np.save(path / "ledger.npy", ledger)
    (path / STATE_FILE).write_text(json.dumps({"step": step, "counters": counters}))


def backend_shard_name(rank: int) -> str:
    """Per-rank backend state file of sharded backends (ZeRO partitions optimizer state by rank)."""
    return f"backend_rank{rank}.pt"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint directory with the highest step under RUN/checkpoints, or None."""
    best, best_step = None, -1
    for state in Path(run_dir, "checkpoints").glob(f"**/{STATE_FILE}"):
        step = json.loads(state.read_text())["step"]
        if step > best_step:
            best, best_step = state.parent, step
    return best


# --- the loop --------------------------------------------------------------------------------------
def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. ``config["spec"]`` is a ``LearnerSpec``."""
    import ray.train
    import ray.train.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.coordinator import PolicyStoreClient
    from asyncrl.telemetry.sinks import RunWriter
    from asyncrl.telemetry.staleness import per_bucket

    spec: LearnerSpec = config["spec"]
    cfg = spec.cfg
    tc, pc = cfg.train, cfg.pipeline
    torch.set_num_threads(pc.torch_threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    rank, world = _dist()
    local_batch = tc.batch_size // world

    model_dir = Path(spec.resume_dir, "model") if spec.resume_dir else Path(spec.student_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec.student_dir, local_files_only=True)
    # pipeline.device=cuda: this worker's GPU (Ray Train sets CUDA_VISIBLE_DEVICES and the index)
    device = ray.train.torch.get_device() if pc.device == "cuda" else torch.device("cpu")
    if pc.backend == "deepspeed":
        os.environ["DS_ACCELERATOR"] = pc.device  # DeepSpeed picks its accelerator (and NCCL/gloo) from it
    model.to(device).train()
    backend = make_backend(
        cfg.pipeline.backend,
        model,
        tc,
        world,
        zero_stage=pc.zero_stage,
        # DeepSpeed's JIT-op build cache goes with the model cache when that path is absolute (a
        # relative one would resolve against this worker's cwd); else TORCH_EXTENSIONS_DIR or ~/.cache
        extensions_dir=(
            str(Path(cfg.workload.cache_dir, "torch_extensions"))
            if Path(cfg.workload.cache_dir).is_absolute()
            else None
        ),
    )
    raw_model = backend.module
    estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
    # once per run (signature inspection): may the estimator be handed the learner's token log-probs?
    hand_logprobs = accepts_token_logprobs(estimator)
    controllers = build_chain(controller_specs(cfg))

    step = 0
    ledger_parts: list[np.ndarray] = []
    counters = {"trained": 0, "dropped": 0}
    if spec.resume_dir:
        state = torch.load(Path(spec.resume_dir, "trainer_state.pt"), weights_only=False)
        if getattr(backend, "sharded_state", False):
            shard = Path(spec.resume_dir, backend_shard_name(rank))
            if not shard.is_file():
                raise FileNotFoundError(
                    f"checkpoint {spec.resume_dir} has no {shard.name}: it was written with fewer learner "
                    f"workers or a different backend; resume with the same pipeline.learner_workers/backend"
                )
            backend.load_state_dict(torch.load(shard, weights_only=False))
        else:
            backend.load_state_dict(state["backend"])
        controllers.load_state_dict(state["controllers"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        meta = json.loads(Path(spec.resume_dir, STATE_FILE).read_text())
        step = int(meta["step"])
        counters.update(meta["counters"])
        ledger_parts.append(np.load(Path(spec.resume_dir, "ledger.npy")))

    store = PolicyStoreClient.connect(spec.namespace, timeout_s=pc.rpc_timeout_s, name=spec.store_name)
    writer = (
        RunWriter(
            spec.run_dir,
            tensorboard=cfg.telemetry.tensorboard,
            resume=spec.resume_dir is not None,
            truncate_after_step=step,
        )
        if rank == 0
        else None
    )
    progress = None
    if rank == 0:
        from asyncrl.telemetry.progress import Progress

        progress = Progress(total=tc.steps, enabled=cfg.telemetry.progress, start=step)

    def publish() -> None:
        if rank == 0:
            store.publish(publishable_state(raw_model), step)

    evaluator = _Evaluator(cfg, tokenizer, spec.eval_prompts) if rank == 0 else None
    eval_time = 0.0
    if rank == 0 and step == 0 and tc.eval_every > 0:
        acc, dt = evaluator(raw_model)
        eval_time += dt
        writer.log_step(0, {"eval/accuracy": acc, "time_s": 0.0})
    publish()  # weights v=step open admission

    it = ray.train.get_dataset_shard("train").iter_batches(
        batch_size=local_batch, prefetch_batches=0, batch_format="numpy"
    )
    t_run0 = time.perf_counter()
    t_prev = time.perf_counter()
    for batch_np in it:
        if step >= tc.steps:
            break
        if len(batch_np[R.SAMPLE_ID]) == 0:
            continue
        t_got = time.perf_counter()
        batch_np["consumed_at"] = np.full(len(batch_np[R.SAMPLE_ID]), time.time())
        metrics, sample_rows, consumed_ids, n_kept, n_drop = _learner_step(
            backend, estimator, hand_logprobs, controllers, batch_np, step, cfg, world, rank, device
        )
        t_computed = time.perf_counter()
        if n_kept > 0:
            step += 1
        counters["trained"] += n_kept
        counters["dropped"] += n_drop
        ledger_parts.append(all_cat(torch.from_numpy(consumed_ids), world).numpy())
        sample_rows = gather_rows(sample_rows, world)
        publish()
        if rank == 0:
            store.consumed(n_kept, n_drop)
        t_done = time.perf_counter()
        if rank == 0:
            dt = t_done - t_prev
            metrics["throughput/samples_per_s"] = n_kept / max(dt, 1e-9)
            metrics["throughput/learner_idle_frac"] = (t_got - t_prev) / max(dt, 1e-9)
            metrics["time/step_s"] = dt
            metrics["time/data_wait_s"] = t_got - t_prev
            metrics["time/compute_s"] = t_computed - t_got  # forward, loss, backward, optimizer step
            metrics["time/publish_s"] = t_done - t_computed  # gathers, weights to the store, release
            metrics.update(per_bucket_metrics(per_bucket, sample_rows))
            if tc.eval_every > 0 and (step % tc.eval_every == 0 or step >= tc.steps) and n_kept > 0:
                acc, edt = evaluator(raw_model)
                eval_time += edt
                metrics["eval/accuracy"] = acc
            metrics["time_s"] = time.perf_counter() - t_run0
            metrics["time/eval_total_s"] = eval_time
            writer.log_step(step, metrics)
            writer.log_samples(sample_rows)
            progress.update(step, metrics)
        t_prev = time.perf_counter()
        want_ckpt = step >= tc.steps or (
            tc.checkpoint_every > 0 and n_kept > 0 and step % tc.checkpoint_every == 0
        )
        if want_ckpt:
            _report_checkpoint(
                ray,
                rank,
                step,
                raw_model,
                backend,
                controllers,
                ledger_parts,
                counters,
                store,
            )
        if spec.fail_at_step is not None and step >= spec.fail_at_step:
            raise RuntimeError(f"fault injected at step {step} (pipeline fail_at_step)")
        if step >= tc.steps:
            break
    if rank == 0:
        store.close()
        progress.close()
        writer.close()
    if step < tc.steps:
        raise RuntimeError(
            f"the rollout stream ended after {step} of {tc.steps} steps: too few prompts for the drops seen "
            f"(dropped {counters['dropped']}); raise workload.train_size"
        )


def per_bucket_metrics(per_bucket: Any, rows: dict[str, np.ndarray]) -> dict[str, float]:
    """``bucket/<lag>/<metric>`` over the kept samples: loss, KL(behavior || current), reward, the
    count ``n`` and ``ess``, the ESS fraction of the bucket's sequence weights ``exp(seq_log_ratio)``
    (how far importance weighting would thin that staleness bucket out)."""
    kept = rows["kept"].astype(bool)
    out: dict[str, float] = {}
    if not kept.any():
        return out
    lags = rows["lag"][kept]
    for name in ("loss", "kl_behavior_current", "reward"):
        out.update(per_bucket(rows[name][kept], lags, name=name))
    out.update(per_bucket(np.ones(int(kept.sum())), lags, name="n", reduce="sum"))
    out.update(per_bucket(rows["seq_log_ratio"][kept], lags, reduce=_ess, name="ess"))
    return out


def _ess(log_weights: np.ndarray) -> float:
    return float(ess_fraction(torch.as_tensor(log_weights, dtype=torch.float64)))


def _learner_step(
    backend, estimator, hand_logprobs, controllers, batch_np, step, cfg: RunConfig, world, rank, device
):
    """One consumption + (maybe) one optimizer step. Returns metrics, per-sample rows, counts.

    Tensors live on ``device`` (the model's); per-sample rows go back to numpy on the CPU.
    ``hand_logprobs``: the estimator takes the token log-probs gathered here (with grad)."""
    tc = cfg.train
    info = SampleInfo(
        sample_id=np.asarray(batch_np[R.SAMPLE_ID]),
        group_id=np.asarray(batch_np[R.GROUP_ID]),
        version_first=np.asarray(batch_np[R.VERSION_FIRST]),
        version_last=np.asarray(batch_np[R.VERSION_LAST]),
    )
    keep = np.asarray(controllers.keep(info, step), dtype=bool)
    n_kept, n_drop = (int(v) for v in all_sum([float(keep.sum()), float((~keep).sum())], world))
    tb = R.to_torch({k: v for k, v in batch_np.items() if k in R.COLUMNS})
    tb = {k: v.to(device) for k, v in R.trim_to_longest(tb).items()}
    keep_t = torch.from_numpy(keep).to(device)
    mask = tb[R.COMPLETION_MASK] & keep_t[:, None]
    lags = torch.from_numpy(info.lag(step)).to(device)
    metrics: dict[str, float] = {}
    rows = {
        "sample_id": info.sample_id,
        "prompt_id": np.asarray(batch_np[R.PROMPT_ID]),
        "group_id": info.group_id,
        "version_first": info.version_first,
        "version_last": info.version_last,
        "learner_version": np.full(len(keep), step),
        "lag": lags.cpu().numpy(),
        "kept": keep,
        "reward": np.asarray(batch_np.get(R.REWARD, np.full(len(keep), np.nan)), dtype=np.float64),
        "completion_len": tb[R.COMPLETION_MASK].sum(1).cpu().numpy(),
        # the optimizer step that consumed the sample (1-based, = metrics.jsonl "step"); a batch
        # dropped whole is attributed to the next step
        "step": np.full(len(keep), step + 1),
    }
    for extra in (
        "gen_node",
        "score_node",
        "gen_time_s",
        "gen_wait_s",
        "gen_done_at",
        "score_time_s",
        "score_done_at",
        "consumed_at",
    ):
        if extra in batch_np:
            rows[extra] = np.asarray(batch_np[extra])
    if n_kept == 0:  # everything stale on every rank: count it, no optimizer step
        rows["loss"] = np.full(len(keep), np.nan)
        rows["kl_behavior_current"] = np.full(len(keep), np.nan)
        rows["seq_log_ratio"] = np.full(len(keep), np.nan)
        metrics.update({**controllers.metrics(), "staleness/dropped": float(n_drop)})
        return metrics, rows, info.sample_id, 0, n_drop

    logits = R.completion_logits(
        backend.model, tb[R.PROMPT_IDS], tb[R.PROMPT_MASK], tb[R.COMPLETION_IDS], tb[R.COMPLETION_MASK]
    )
    # log pi_theta at the generated tokens, gathered once: with grad only if the estimator takes
    # it, detached for the controllers and telemetry
    with torch.set_grad_enabled(hand_logprobs):
        logp_grad = gather_logprobs(logits, tb[R.COMPLETION_IDS], chunk_size=tc.logits_chunk)
    logp = logp_grad.detach()
    behavior = tb[R.BEHAVIOR_LOGPROBS]
    log_ratio = torch.where(mask, logp - behavior, torch.zeros_like(logp))
    seq_log_ratio = log_ratio.sum(1)
    kept_idx = keep_t.nonzero().squeeze(1)
    sctx = StepContext(
        step=step,
        base_lr=backend.base_lr(step),
        mask=mask,
        logprobs=logp,
        behavior_logprobs=behavior,
        token_versions=tb[R.TOKEN_VERSIONS],
        lags=lags,
        group_ids=torch.from_numpy(info.group_id).to(device),
        seq_log_ratio=all_cat(seq_log_ratio[kept_idx], world),
        lags_global=all_cat(lags[kept_idx], world),
        world_size=world,
        rank=rank,
    )
    weights = controllers.token_weights(sctx)
    est_batch = dict(tb)
    est_batch[R.COMPLETION_MASK] = mask
    given = {"token_logprobs": logp_grad} if hand_logprobs else {}
    out = estimator(logits, est_batch, token_weights=weights, **given)
    backend.backward(out.loss)
    if backend.supports_gradient_transform:
        controllers.transform_gradient(backend.gradients(), sctx)
    grad_norm = backend.clip_and_norm(tc.grad_clip)
    scale = float(controllers.lr_scale(sctx))
    applied_lr = backend.step(step, scale)
    controllers.after_step(sctx)

    # telemetry: per-sample k3 KL(behavior || current) over valid tokens, per-sample loss
    valid = mask.float()
    r = torch.exp(torch.clamp(log_ratio, -20, 20))
    k3_tok = torch.where(mask, r - log_ratio - 1, torch.zeros_like(r))
    n_tok = valid.sum(1).clamp_min(1)
    # log of the sequence importance weight pi_theta(y) / pi_b(y) (ESS per staleness bucket)
    rows["seq_log_ratio"] = torch.where(keep_t, seq_log_ratio, float("nan")).double().cpu().numpy()
    rows["kl_behavior_current"] = (
        torch.where(keep_t, k3_tok.sum(1) / n_tok, torch.full_like(n_tok, float("nan"))).cpu().numpy()
    )
    per_sample_loss = out.per_sample.get("loss")
    rows["loss"] = (
        torch.where(keep_t, per_sample_loss.detach().float(), float("nan")).cpu().numpy()
        if per_sample_loss is not None
        else np.full(len(keep), np.nan)
    )
    kept_lags = lags[kept_idx].float()
    metrics.update(out.metrics)
    metrics.update(controllers.metrics())  # per-rank views; the global figures below take precedence
    metrics.update(
        {
            "loss": float(out.loss.detach()),
            "staleness/lag_mean": float(kept_lags.mean()),
            "staleness/lag_max": float(kept_lags.max()),
            "staleness/dropped": float(n_drop),
            "ess/rho": float(ess_fraction(sctx.seq_log_ratio.double())),
            "lr/scheduled": float(sctx.base_lr),
            "lr/applied": float(applied_lr),
            "kl/behavior_current": float(k3_tok.sum() / valid.sum().clamp_min(1)),
            "grad/norm": grad_norm,
            "samples/kept": float(n_kept),
            "tokens/completion_mean": float(tb[R.COMPLETION_MASK].sum(1).float().mean()),
        }
    )
    return metrics, rows, info.sample_id, n_kept, n_drop


def _report_checkpoint(ray, rank, step, model, backend, controllers, ledger_parts, counters, store):
    """Rank 0 writes the checkpoint; with a sharded backend (ZeRO) every rank adds its own shard.

    Ray Train copies each worker's reported directory into the same ``step_<n>`` folder, so the
    per-rank ``backend_rank<r>.pt`` files land next to rank 0's files.
    """
    import tempfile

    from ray.train import Checkpoint

    ledger = np.concatenate(ledger_parts) if ledger_parts else np.zeros(0, dtype=np.int64)
    sharded = getattr(backend, "sharded_state", False)
    name = f"step_{step:06d}"
    if rank != 0 and not sharded:
        ray.train.report({"step": step}, checkpoint=None, checkpoint_dir_name=name)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if rank == 0:
            save_checkpoint(
                Path(tmp),
                model=model,
                backend=backend,
                controllers=controllers,
                step=step,
                ledger=ledger,
                counters=counters,
            )
            (Path(tmp) / "coordinator.json").write_text(json.dumps(store.state_dict(), default=str))
        if sharded:
            torch.save(backend.state_dict(), Path(tmp) / backend_shard_name(rank))
        ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    if sharded and torch.distributed.is_initialized():
        # every shard is on storage before any rank moves on (and might fail)
        torch.distributed.barrier()


class _Evaluator:
    """Greedy exact match on the held-out split (rank 0)."""

    def __init__(self, cfg: RunConfig, tokenizer: Any, prompts: list[tuple[str, str]]) -> None:
        from asyncrl.workloads.tasks import Example, get_task

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.task = get_task(cfg.workload.task)
        self.examples = [Example(prompt=p, answer=a, prompt_id=i) for i, (p, a) in enumerate(prompts)]

    def __call__(self, model: torch.nn.Module) -> tuple[float, float]:
        from asyncrl.workloads.evaluate import exact_match

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        acc = exact_match(
            model,
            self.tokenizer,
            self.task,
            self.examples,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            batch_size=64,
        )
        model.train(was_training)
        return float(acc), time.perf_counter() - t0


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
