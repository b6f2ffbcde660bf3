"""The Ray Data stages of the pipeline: callable classes that hold a model once per actor.

- ``Generate``: ``map_batches(Generate, actor pool)``, the rollout stage (below).
- ``ScoreTeacher``: ``map_batches(ScoreTeacher, actor pool)``, the OPD scoring stage.
- ``ScoreReward``: the RL scoring stage (task reward), also used by ``ScoreTeacher`` for
  accuracy telemetry.
- ``GenerateAndScore``: both in one actor (``pipeline.fuse_scoring``).

Generation:

Each call turns one block of prompt rows (one learner step's worth of samples for one
learner worker) into rollouts. Before generating it asks the PolicyStore for admission
(the staleness budget) and, in the same call, for the weights to use if the version moved,
and it tags every token with the version that produced it. Sampling seeds derive from
``(seed, first sample_id)`` so a batch is reproducible regardless of which actor runs it or when.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.caches import CACHES, score_teacher
from asyncrl.coordinator import CoordinatorError, LocalWeights, PolicyStoreClient, VersionWatch
from asyncrl.engines import ENGINES
from asyncrl.engines.base import EngineDeadError, SamplingParams
from asyncrl.engines.continuous import ContinuousBatcher
from asyncrl.faults import NO_FAULTS, Faults
from asyncrl.provenance import NO_FINGERPRINT, NOT_REPORTED, combine, row_versions
from asyncrl.records import pad_to
from asyncrl.registry import RegistryError


def batch_seed(seed: int, sample_ids: np.ndarray) -> int:
    """A 63-bit seed from the run seed and the batch's first sample id (order-independent of actors)."""
    first = int(np.min(sample_ids)) if len(sample_ids) else 0
    return (seed * 1_000_003 + first * 7919 + 17) % (2**63 - 1)


def node_id() -> str:
    """The Ray node this actor runs on (recorded per sample: placement is part of telemetry)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def engine_identity(engine: object) -> str:
    """Who generated a block (``records.GEN_ENGINE``): the engine kind, its Ray actor, process and node."""
    import ray

    actor = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    where = f"actor {actor[:12]}" if actor else "no actor"
    kind = getattr(engine, "name", type(engine).__name__)
    return f"{kind} ({where}, pid {os.getpid()}, node {node_id()[:12]})"


def sample_fingerprints(
    engine: object, versions: torch.Tensor, mask: torch.Tensor, first: torch.Tensor
) -> np.ndarray:
    """Per sample, the fingerprint of the weights its tokens came from, as the engine measured them
    after loading (``engine.fingerprints``: version -> fingerprint; ``asyncrl.provenance``), combined
    over the versions of its tokens; ``NOT_REPORTED`` from an engine that keeps none at all."""
    fps = getattr(engine, "fingerprints", None)
    rows = row_versions(versions.numpy(), mask.numpy(), first.numpy())
    if fps is None:
        return np.full(len(rows), NOT_REPORTED, dtype=np.int64)
    memo: dict[tuple[int, ...], int] = {}
    out = np.empty(len(rows), dtype=np.int64)
    for i, vs in enumerate(rows):
        if vs not in memo:
            memo[vs] = combine(fps.get(v, NO_FINGERPRINT) for v in vs)
        out[i] = memo[vs]
    return out


def pad_rollout(out: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad every per-token column an engine returned to ``length`` with its column's filler."""
    fill = {R.COMPLETION_IDS: pad_id, R.MC_IDS: pad_id, R.COMPLETION_MASK: False, R.TOKEN_VERSIONS: -1}
    return {k: pad_to(v, length, fill.get(k, 0.0)) for k, v in out.items()}


#: held by the thread that reports this process's engine death and exits (``Generate._restart_or_fail``)
_DYING = threading.Lock()


def _exit_process(code: int) -> None:
    """Exit now, without cleanup (a dead engine may hang it); Ray restarts the actor."""
    os._exit(code)


class Generate:
    """Ray Data actor UDF holding one rollout engine for the actor's lifetime."""

    #: pipeline.inflight_updates / inflight_poll_steps / continuous_batching (class defaults: off)
    inflight_updates = False
    inflight_poll_steps = 1
    batcher: ContinuousBatcher | None = None

    def __init__(
        self,
        *,
        engine: str,
        student_dir: str,
        sampling: dict[str, Any],
        namespace: str,
        store_name: str,
        seed: int,
        rpc_timeout_s: float,
        admit_timeout_s: float,
        torch_threads: int = 1,
        engine_options: dict[str, Any] | None = None,
        max_engine_restarts: int = 3,
        stream: int | None = None,
        faults: Faults = NO_FAULTS,
        model: torch.nn.Module | None = None,
        local_weights: LocalWeights | None = None,
        inflight_updates: bool = False,
        inflight_poll_steps: int = 1,
        continuous_batching: bool = False,
    ) -> None:
        if model is not None:  # a learner worker's own model (``pipeline.colocate``): no weights to load
            from asyncrl.engines.hf import HFEngine
            from asyncrl.workloads.checkpoints import shared_tokenizer

            # the model's device and dtype are the learner's; of the options only decode and compact apply
            opts = engine_options or {}
            self.engine = HFEngine(
                model,
                shared_tokenizer(student_dir),
                decode=opts.get("decode", "auto"),
                compact=opts.get("compact", True),
            )
        else:
            torch.set_num_threads(torch_threads)
            try:
                engine_cls = ENGINES.get(engine)
            except RegistryError as err:  # the driver imported it; this Ray worker cannot
                raise RegistryError(
                    f"{err} (in a generator actor: the module of a dotted-path pipeline.engine must be "
                    f"importable on every Ray node; install it, or put its directory on the workers' "
                    f"PYTHONPATH)"
                ) from err
            self.engine = engine_cls.from_pretrained(student_dir, version=0, **(engine_options or {}))
        self.params = SamplingParams(**sampling)
        self.store = PolicyStoreClient.connect(
            namespace, timeout_s=rpc_timeout_s, name=store_name, local=local_weights
        )
        self.seed = seed
        self.admit_timeout_s = admit_timeout_s
        self.have_version = -1
        self.admissions = 0
        self.stream = stream
        self.faults = faults
        self.max_engine_restarts = max_engine_restarts
        self.loads = 0  # weight loads asked of the engine (faults.skip_weight_load counts them)
        self.identity = engine_identity(self.engine)
        #: pipeline.inflight_updates: the engine polls the store between decode steps
        self.inflight_updates = inflight_updates
        self.inflight_poll_steps = inflight_poll_steps
        self.inflight_loads = 0  # weights loaded mid-rollout (telemetry)
        self.inflight_polls = 0  # mid-rollout checks (faults.engine_dies_mid_sequence counts them)
        #: pipeline.continuous_batching: the blocks this actor runs at once share decode steps
        if continuous_batching:
            if not inflight_updates:
                raise ValueError("continuous_batching needs inflight_updates (pipeline.continuous_batching)")
            self._watch = VersionWatch(self.store, self.engine.version)
            self.batcher = ContinuousBatcher(
                self.engine, load=self._load, poll=self._batcher_poll, poll_every=inflight_poll_steps
            )

    def _restart_or_fail(self, err: EngineDeadError) -> None:
        """Crash-only recovery: exit this actor's process so Ray Data restarts it (a fresh engine,
        the latest weights) and re-runs the block under its admission key; fail the run instead
        once the run's engine deaths exceed ``max_engine_restarts``."""
        with _DYING:  # two blocks of one actor (continuous batching) see the same death: count it once
            self._count_death_or_fail(err)

    def _count_death_or_fail(self, err: EngineDeadError) -> None:
        deaths = self.store.engine_died()
        if deaths > self.max_engine_restarts:
            raise RuntimeError(
                f"the rollout engine died {deaths} times in this run, more than "
                f"pipeline.max_engine_restarts={self.max_engine_restarts}; last error: {err}"
            ) from err
        print(
            f"asyncrl: rollout engine died ({err}); restarting this generator actor "
            f"(engine death {deaths}, at most pipeline.max_engine_restarts={self.max_engine_restarts})",
            file=sys.stderr,
            flush=True,
        )
        _exit_process(1)

    def _sync_weights(self, admitted: dict[str, Any]) -> None:
        """Load the weights the admission came with (a controller's pinned version, or the latest
        if newer than ours; None when we hold them)."""
        if admitted["weights"] is not None:
            self._load(*admitted["weights"])

    def _load(self, version: int, state: Any) -> None:
        """Load ``state`` at ``version`` into the engine (or, under the ``skip_weight_load`` fault,
        claim the version and keep the weights held)."""
        self.loads += 1
        if self.faults.once("skip_weight_load", self.loads):  # the update never arrives
            print(f"asyncrl: fault injected: skip_weight_load at load {self.loads}, v{version}", flush=True)
            self.engine.weights_updated(version)  # claims the version, keeps the weights it holds
        else:
            self.engine.load_weights(state, version)
        self.have_version = version

    def _poll_weights(self, admitted: dict[str, Any]) -> Any:
        """The ``WeightsPoll`` for this block's rollout (``pipeline.inflight_updates``), or None: off,
        or the admission pinned a behavior version (the block must use that version throughout).

        It loads newer weights itself (``_load``: load counting and faults as at admission) and
        returns None; the engine stamps later tokens with its version after the call. If the
        engine dies here (``EngineDeadError``, or the ``engine_dies_mid_sequence`` fault), the
        partial rollout is discarded and the block is regenerated whole under its admission."""
        if not self.inflight_updates or admitted.get("behavior_version") is not None:
            return None
        watch = VersionWatch(self.store, self.engine.version)

        def poll() -> None:
            self._check_alive()
            got = watch.poll()
            if got is not None:
                self.inflight_loads += 1
                self._load(*got)
            return None

        return poll

    def _check_alive(self) -> None:
        """One mid-rollout check (the ``engine_dies_mid_sequence`` fault counts them)."""
        self.inflight_polls += 1
        if self.faults.once("engine_dies_mid_sequence", self.inflight_polls):
            what = f"engine_dies_mid_sequence at check {self.inflight_polls}"
            print(f"asyncrl: fault injected: {what}", flush=True)
            raise EngineDeadError(f"fault injected: {what} (the engine died mid-rollout)")

    def _batcher_poll(self) -> tuple[int, Any] | None:
        """The ``ContinuousBatcher``'s check for newer weights (its thread loads what this returns)."""
        self._check_alive()
        self._watch.have = max(self._watch.have, self.engine.version)  # admissions load too
        got = self._watch.poll()
        if got is not None and got[0] > self.engine.version:
            self.inflight_loads += 1
        return got

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch[R.SAMPLE_ID])
        t_wait = time.perf_counter()
        # blocks are admitted in stream order by index; a retry of this block (the actor died and
        # Ray Data re-ran it on a restarted actor) gets its admission back instead of new budget
        block = int(np.asarray(batch[R.BLOCK_INDEX])[0])
        admitted = self.store.acquire(
            n, block, timeout_s=self.admit_timeout_s, stream=self.stream, have=self.have_version
        )
        if admitted is None:  # the run finished (or its stream was replaced) while we waited
            return {k: v[:0] for k, v in batch.items()}
        self.admissions += 1
        self.faults.exit_if("generator_exit", self.admissions)
        self.faults.delay(self.seed, block)
        t_start = time.perf_counter()
        seed = batch_seed(self.seed, batch[R.SAMPLE_ID])
        prompts = R.to_torch({k: batch[k] for k in (R.PROMPT_IDS, R.PROMPT_MASK)})
        try:
            if self.batcher is not None:  # shares decode steps with this actor's other block
                if admitted.get("behavior_version") is not None:
                    raise ValueError(
                        f"block {block} was admitted with a pinned behavior version "
                        f"{admitted['behavior_version']}, which continuous batching cannot keep (the "
                        f"blocks share one engine's weights): use pipeline.lag_mode=bound"
                    )
                batched = self.batcher.submit(
                    prompts[R.PROMPT_IDS], prompts[R.PROMPT_MASK], self.params, seed=seed,
                    weights=admitted["weights"],
                ).result()  # fmt: skip
                out, shared = batched.columns, batched.shared_frac
            else:
                shared = 0.0
                self._sync_weights(admitted)
                poll = self._poll_weights(admitted)
                inflight = (
                    {} if poll is None else {"poll_weights": poll, "poll_every": self.inflight_poll_steps}
                )
                out = self.engine.generate(
                    prompts[R.PROMPT_IDS],
                    prompts[R.PROMPT_MASK],
                    self.params,
                    seed=seed,
                    **inflight,
                )
        except EngineDeadError as err:
            self._restart_or_fail(err)
        out = pad_rollout(out, self.params.max_new_tokens, getattr(self.engine, "pad_id", 0))
        versions, mask = out[R.TOKEN_VERSIONS], out[R.COMPLETION_MASK]
        self._check_budgets(mask, seed)
        result = dict(batch)
        result.update(out)
        # first/last version over valid tokens (a sequence can span versions with in-flight updates)
        big = torch.iinfo(torch.int32).max
        vfirst = torch.where(mask, versions, torch.full_like(versions, big)).min(dim=1).values
        vlast = torch.where(mask, versions, torch.full_like(versions, -1)).max(dim=1).values
        empty = ~mask.any(dim=1)
        vfirst = torch.where(empty, torch.full_like(vfirst, self.engine.version), vfirst)
        vlast = torch.where(empty, torch.full_like(vlast, self.engine.version), vlast)
        result[R.VERSION_FIRST] = vfirst.to(torch.int64)
        result[R.VERSION_LAST] = vlast.to(torch.int64)
        result[R.WEIGHTS_FINGERPRINT] = sample_fingerprints(self.engine, versions, mask, vfirst)
        result[R.GEN_ENGINE] = np.full(n, self.identity, dtype=object)
        result["ticket"] = np.full(n, admitted["ticket"], dtype=np.int64)
        # the admission's facts, so a run shows what the controller chain decided for each block
        result["admit_version"] = np.full(n, admitted["version"], dtype=np.int64)
        result["expected_version"] = np.full(n, admitted["expected_version"], dtype=np.int64)
        result["gen_wait_s"] = np.full(n, t_start - t_wait, dtype=np.float64)
        result["gen_time_s"] = np.full(n, time.perf_counter() - t_start, dtype=np.float64)
        result["gen_done_at"] = np.full(n, time.time(), dtype=np.float64)
        result["gen_node"] = np.full(n, node_id(), dtype=object)
        # continuous batching: the fraction of this block's decode steps another block's rows shared
        result["gen_shared_frac"] = np.full(n, shared, dtype=np.float64)
        return R.to_numpy(result)

    def _check_budgets(self, mask: torch.Tensor, seed: int) -> None:
        """With ``sampling.heavy_tail`` every completion must stop within its token budget; an engine
        that ignores the option would silently run the study without its heavy tail."""
        budgets = self.params.token_budgets(mask.shape[0], seed)
        if budgets is None:
            return
        lengths = mask.sum(dim=1).cpu().numpy()
        over = np.flatnonzero(lengths > budgets)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"engine {type(self.engine).__name__} ignored sampling.heavy_tail: completion {i} has "
                f"{int(lengths[i])} tokens, its budget is {int(budgets[i])} "
                f"(SamplingParams.token_budgets); make the engine stop each row at its budget, or set "
                f"sampling.heavy_tail=0"
            )


class ScoreReward:
    """Reward stage for RL (and task accuracy telemetry in OPD): decode, verify, score."""

    def __init__(self, *, task: str, tokenizer_dir: str, faults: Faults = NO_FAULTS) -> None:
        from asyncrl.workloads.checkpoints import shared_tokenizer
        from asyncrl.workloads.tasks import get_task, reward_function

        self.task = get_task(task)
        self.reward = reward_function(self.task)
        self.tokenizer = shared_tokenizer(tokenizer_dir)  # decodes only
        self.faults = faults
        self.blocks = 0

    def rewards(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """Task reward per sample; a prompt file's metadata columns (JSON per sample) reach it as a dict."""
        ids = np.asarray(batch[R.COMPLETION_IDS])
        mask = np.asarray(batch[R.COMPLETION_MASK]).astype(bool)
        texts = self.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True
        )
        answers = batch[R.ANSWER]
        metas = batch.get(R.METADATA)
        metas = [json.loads(m) for m in metas] if metas is not None else [{}] * len(texts)
        return np.asarray(
            [self.reward(t, str(a), m) for t, a, m in zip(texts, answers, metas)], dtype=np.float32
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.blocks += 1
        self.faults.exit_if("scorer_exit", self.blocks)
        out = dict(batch)
        out[R.REWARD] = self.rewards(batch)
        out["score_node"] = np.full(len(out[R.REWARD]), node_id(), dtype=object)
        return out


class ScoreTeacher:
    """Ray Data actor UDF holding the teacher model for the actor's lifetime.

    The teacher is frozen, so its scores never go stale: only which tokens get scored depends on
    the (possibly stale) student that generated them. One teacher forward over prompt +
    completion keeps only the finite record its TeacherCache kind declares (top-k, scores at the
    behavior MC samples, the generated token, teacher samples), never the full [B, T, V] logits.
    It also scores the task reward, for accuracy telemetry.
    """

    def __init__(
        self,
        *,
        teacher_dir: str,
        cache: str,
        cache_options: dict[str, Any],
        task: str,
        seed: int,
        torch_threads: int = 1,
        device: str = "cpu",
        dtype: str = "float32",
        faults: Faults = NO_FAULTS,
        dense_reference: dict[str, int] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(torch_threads)
        # pipeline.teacher_dtype: the forward's dtype; score_teacher builds the cache in fp32
        model = AutoModelForCausalLM.from_pretrained(
            teacher_dir, local_files_only=True, dtype=getattr(torch, dtype)
        )
        self.model = model.to(device).eval()  # score_teacher moves each batch to the model's device
        self.cache = CACHES.get(cache)(**cache_options)
        self.reward = ScoreReward(task=task, tokenizer_dir=teacher_dir)
        self.seed = seed
        self.faults = faults
        self.blocks = 0
        #: telemetry.grad_reference=dense: {every, workers, minibatches} of dense_reference_due
        self.dense_reference = dense_reference

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from asyncrl.telemetry.gradients import WithDenseLogits, dense_reference_due

        if len(batch[R.SAMPLE_ID]) == 0:
            return batch
        self.blocks += 1
        self.faults.exit_if("scorer_exit", self.blocks)
        t0 = time.perf_counter()
        tensors = R.to_torch({k: v for k, v in batch.items() if k in R.COLUMNS})
        cache = self.cache
        block = int(np.asarray(batch[R.BLOCK_INDEX])[0])
        if self.dense_reference and dense_reference_due(block, **self.dense_reference):
            cache = WithDenseLogits(cache)  # the gradient probe's block: the full logits too
        scores = score_teacher(self.model, tensors, cache, seed=batch_seed(self.seed + 1, batch[R.SAMPLE_ID]))
        out = dict(batch)
        out.update(R.to_numpy(scores))
        out[R.REWARD] = self.reward.rewards(batch)
        out["score_node"] = np.full(len(out[R.REWARD]), node_id(), dtype=object)
        out["score_time_s"] = np.full(len(out[R.REWARD]), time.perf_counter() - t0, dtype=np.float64)
        out["score_done_at"] = np.full(len(out[R.REWARD]), time.time(), dtype=np.float64)
        return out


class GenerateAndScore:
    """Generation and scoring in one actor (``pipeline.fuse_scoring``): a block is generated and
    scored in one Ray Data task, one stage hand-off fewer per block (its Arrow conversion, object
    store round trip and executor wake-up), and one process fewer to schedule. On a small machine
    this is the natural split: rollout and scoring share one core, the learner has the other.
    The price is that a block's scoring no longer overlaps the next block's generation.

    ``scorer`` is ``ScoreTeacher`` or ``ScoreReward``; the keyword dicts are their constructors'.
    """

    def __init__(self, *, generate: dict[str, Any], scorer: type, score: dict[str, Any]) -> None:
        self.generate = Generate(**generate)
        self.score = scorer(**score)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.score(self.generate(batch))


class Colocated:
    """Generation and scoring inside a learner worker (``pipeline.colocate``).

    Strict on-policy training (``max_lag = 0``) has nothing to overlap: block ``k+1`` is
    generated with the weights block ``k`` produced, and scored with the completions it sampled.
    So a colocated lock-step run keeps one process per learner rank (verl's "hybrid engine"
    layout): the engine samples from the learner's model in place (``model``: no weight
    publication, no copy), and the teacher lives beside it.

    With ``max_lag >= 1`` (``model`` None) it is a generator actor's work moved into a thread of
    the learner's process (``asyncrl.rollouts.RunAhead``): an engine of its own, loading at
    admission the weights the admission names, as a stage actor does, but from its own learner
    rank (``weights``: ``asyncrl.coordinator.LocalWeights``), not through the object store. Block
    ``k+1`` is generated and scored while block ``k`` trains: one process, both cores busy.

    Either way the Ray Data stream carries prompt blocks only, and admission goes through the
    PolicyStore, so the books, the ordering rule, the staleness bound and the controller chain's
    ``admit`` hooks are the pipeline's own; the stage columns (versions, timings, nodes) are the
    same too. ``stages``: the pipeline's ``StageSpecs``."""

    def __init__(
        self, stages: Any, model: torch.nn.Module | None = None, weights: LocalWeights | None = None
    ) -> None:
        if (model is None) == (weights is None):
            raise ValueError("Colocated takes the learner's model (in step) or its LocalWeights (a thread)")
        self.generate = Generate(**stages.generate, model=model, local_weights=weights)
        self.in_step = model is not None
        self.score = stages.scorer(**stages.score)
        # the stream this worker group was started with (built before this, by the single worker
        # itself or by Ray Train): admission requests carry its id, as the stage actors' do
        self.generate.stream = self.generate.store.current_stream()

    def __call__(self, batch: dict[str, np.ndarray], version: int | None = None) -> dict[str, np.ndarray]:
        """Block ``batch`` of prompt rows -> scored rollouts; in step: sampled from the learner's
        model, which holds ``version``; else from the weights the admission brought."""
        if self.in_step:
            if version is None:
                raise ValueError("a colocated lock-step rollout needs the learner's version")
            self.generate.engine.weights_updated(version)
            self.generate.have_version = version
        rollouts = self.generate(batch)
        if len(rollouts[R.SAMPLE_ID]) == 0 < len(batch[R.SAMPLE_ID]):  # admission answered None
            raise CoordinatorError(
                f"block {int(np.asarray(batch[R.BLOCK_INDEX])[0])} was refused admission: the PolicyStore "
                f"closed or began another stream while this learner worker still trains"
            )
        # the learner stamps ``consumed_at`` when it takes the block (``asyncrl.rollouts.taken``)
        return self.score(rollouts)
