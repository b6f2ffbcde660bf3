"""Stage times of on-policy distillation measured alone in one process, and the throughput bound they imply.

    python benchmarks/stage_times.py                                        # small, addition, B=32, T=6
    python benchmarks/stage_times.py --extra workload.task=running_sum sampling.max_new_tokens=33
    python benchmarks/stage_times.py --extra estimator.options.dense=true   # dense forward KL

``Stages`` holds the pipeline's parts as plain calls in one process (no Ray): the plain
single-process loop of ``async_vs_sync.py`` is built from it, and ``measure_stage_times`` times
each call alone. Stages, one torch thread each (what every pipeline process uses):

  generate   the HF engine samples B completions from the student (the generator actor's work)
  score      one teacher forward over prompt + completion and the cache build (dense or top-k)
  learn      student forward, estimator loss, backward, grad-norm clip, AdamW step
  publish    the learner's side of a weight update, as the pipeline does it: ``publishable_state``
             (CPU copies, tied weights once), ``pack_weights``, pickle 5 with the buffers copied
             out of band (what ``ray.put`` does into the object store)
  load       the generator's side: unpickle, ``unpack_weights``, ``engine.load_weights``

Bound for C cores with perfect overlap and nothing else to pay (``throughput_bound``):

  work bound       samples/s <= C * B / (sum of all stage times)     CPU-seconds per batch / cores
  pipeline bound   samples/s <= B / max(generator, scorer, learner)  one process per stage, where
                   generator = load + generate, scorer = score, learner = learn + publish
  two-core limit   the smaller of the two (C = 2 on this machine)

Both assume a stage does not run faster than C times its one-thread time. Times are medians of
``repeats`` rounds after ``warmup`` untimed ones; every number printed is measured.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl import records as R
from asyncrl.backends.base import scheduled_lr
from asyncrl.config import RunConfig, load_config
from asyncrl.coordinator import pack_weights, publishable_state, unpack_weights
from asyncrl.estimators import build as build_estimator
from asyncrl.plan import load_examples, make_plan, prompt_blocks
from asyncrl.raysetup import apply_env
from asyncrl.stages import batch_seed, pad_rollout
from asyncrl.step import autocast
from asyncrl.workloads.tasks import prompt_token_ids

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_async.yaml"
STAGES = ("generate", "score", "learn", "publish", "load")


class Stages:
    """Generator, teacher scorer and learner of one run config as plain calls in one process.

    Same components, seeds and prompt stream as the pipeline (``prompt_blocks``), AdamW with the
    pipeline's learning-rate schedule (``scheduled_lr``: linear warmup, then constant) and weight
    decay; the engine holds its own copy of the student, as a generator actor does.
    """

    def __init__(self, cfg: RunConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.caches import CACHES
        from asyncrl.engines import ENGINES

        torch.set_num_threads(cfg.pipeline.torch_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        plan = make_plan(cfg)
        self.models = plan.models
        self.estimator = build_estimator(cfg.estimator.name, dict(cfg.estimator.options))
        self.cache = CACHES.get(plan.cache_kind)(**plan.cache_options)
        student_dir, teacher_dir = self.models.student_dir, self.models.teacher_dir
        self.tokenizer = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
        self.student = AutoModelForCausalLM.from_pretrained(
            student_dir, dtype=torch.float32, local_files_only=True
        )
        self.teacher = AutoModelForCausalLM.from_pretrained(
            teacher_dir, dtype=getattr(torch, cfg.pipeline.teacher_dtype), local_files_only=True
        ).eval()
        # the generator's engine options (e.g. dtype=bfloat16), as a generator actor gets them
        self.engine = ENGINES.get(cfg.pipeline.engine).from_pretrained(student_dir, **plan.engine_options)
        # the plan's config: a real preset's prompt files are set there (workload.prompts_path)
        train_ex, self.eval_examples = load_examples(plan.cfg)
        if train_ex is None:  # prompt files (workload.prompts_path, a real preset): the stream's blocks
            self.blocks = file_blocks(plan.cfg, plan.prompts, self.tokenizer)
        else:
            width = max(map(len, prompt_token_ids(self.tokenizer, [e.prompt for e in train_ex[:2048]])))
            self.blocks = prompt_blocks(cfg, train_ex, self.tokenizer, width)
        self.optimizer = torch.optim.AdamW(
            self.student.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=True
        )  # fused, as the learner's backend (asyncrl.backends.ddp)

    def sync_engine(self, version: int) -> None:
        """The plain loop's weight update: the engine takes a copy of the student's weights."""
        state = {k: v.detach().clone() for k, v in self.student.state_dict().items()}
        self.engine.load_weights(state, version)

    def generate(self, step: int) -> dict[str, torch.Tensor]:
        """Prompts of block ``step`` plus B sampled completions, padded to ``max_new_tokens``."""
        b = self.blocks[step]
        ids, mask = torch.from_numpy(b[R.PROMPT_IDS]), torch.from_numpy(b[R.PROMPT_MASK]).bool()
        out = self.engine.generate(
            ids, mask, self.cfg.sampling, seed=batch_seed(self.cfg.seed, b[R.SAMPLE_ID])
        )
        return {
            R.PROMPT_IDS: ids,
            R.PROMPT_MASK: mask,
            R.SAMPLE_ID: torch.from_numpy(b[R.SAMPLE_ID]),
            **pad_rollout(out, self.cfg.sampling.max_new_tokens, self.engine.pad_id),
        }

    def score(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` plus the teacher cache's columns."""
        from asyncrl.caches import score_teacher

        seed = batch_seed(self.cfg.seed + 1, batch[R.SAMPLE_ID].numpy())
        return {**batch, **score_teacher(self.teacher, batch, self.cache, seed=seed)}

    def learn(self, batch: dict[str, torch.Tensor], step: int) -> float:
        """One optimizer step on a scored batch at the scheduled learning rate; returns the loss."""
        tc = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = scheduled_lr(tc, step)
        batch = R.trim_to_longest(batch)
        with autocast("cpu", tc.precision):  # train.precision, as the learner's loss_step
            logits = R.completion_logits(
                self.student,
                batch[R.PROMPT_IDS],
                batch[R.PROMPT_MASK],
                batch[R.COMPLETION_IDS],
                batch[R.COMPLETION_MASK],
            )
        out = self.estimator(logits, batch)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.student.parameters(), tc.grad_clip)
        self.optimizer.step()
        return float(out.loss.detach())

    def publish(self) -> tuple[bytes, list[bytes]]:
        """The learner's side of a weight update (``PolicyStoreClient.publish`` without Ray): the
        packed snapshot pickled, its tensor bytes copied out of band as ``ray.put`` copies them."""
        buffers: list[pickle.PickleBuffer] = []
        inband = pickle.dumps(
            pack_weights(publishable_state(self.student)), protocol=5, buffer_callback=buffers.append
        )
        return inband, [bytes(b.raw()) for b in buffers]

    def load(self, payload: tuple[bytes, list[bytes]], version: int) -> None:
        """The generator's side of a weight update: unpickle, unpack and load into the engine."""
        inband, buffers = payload
        self.engine.load_weights(unpack_weights(pickle.loads(inband, buffers=buffers)), version)


def file_blocks(cfg: RunConfig, source: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The blocks the pipeline streams from prompt files (``asyncrl.stream.FileStream`` with the
    arguments ``asyncrl.pipeline.streamed`` gives ``StreamBlocks``), read in this process, no Ray."""
    import itertools

    from asyncrl.plan import stream_blocks
    from asyncrl.stream import FileStream, local_reader

    stream = FileStream(
        source,
        tokenizer,
        seed=cfg.seed,
        group_size=cfg.train.group_size,
        block_samples=cfg.train.batch_size // cfg.pipeline.learner_workers,
        window=cfg.workload.shuffle_window,
        max_prompt_tokens=cfg.workload.max_prompt_tokens,
        reader=local_reader(source.kind),
    )
    try:
        return list(itertools.islice(stream, stream_blocks(cfg)))
    finally:
        stream.close()


def measure_stage_times(cfg: RunConfig, *, repeats: int = 5, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each stage (``STAGES``), each timed alone, over ``repeats`` rounds.

    One round = publish, load, generate, score, learn on the next prompt block, so the weights
    and the completions evolve as in a run. ``warmup`` rounds first (untimed: allocator, caches).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    stages = Stages(cfg)
    if len(stages.blocks) < repeats + warmup:
        raise ValueError(f"{repeats + warmup} rounds need more prompt blocks; raise train.steps")
    samples: dict[str, list[float]] = {name: [] for name in STAGES}
    for i in range(warmup + repeats):
        t = [time.perf_counter()]
        payload = stages.publish()
        t.append(time.perf_counter())
        stages.load(payload, i)
        t.append(time.perf_counter())
        batch = stages.generate(i)
        t.append(time.perf_counter())
        batch = stages.score(batch)
        t.append(time.perf_counter())
        stages.learn(batch, i)
        t.append(time.perf_counter())
        if i >= warmup:
            for name, start, end in zip(("publish", "load", "generate", "score", "learn"), t, t[1:]):
                samples[name].append(end - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def throughput_bound(times: Mapping[str, float], batch_size: int, cores: int = 2) -> dict[str, float]:
    """Upper bounds on samples/s implied by one-thread stage times (see the module docstring)."""
    missing = [s for s in STAGES if s not in times]
    if missing:
        raise ValueError(f"stage times lack {missing}; measure_stage_times returns all of {STAGES}")
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    total = sum(times[s] for s in STAGES)
    per_process = {
        "generator": times["load"] + times["generate"],
        "scorer": times["score"],
        "learner": times["learn"] + times["publish"],
    }
    work = cores * batch_size / total
    pipe = batch_size / max(per_process.values())
    return {
        "work_bound": work,
        "pipeline_bound": pipe,
        "limit": min(work, pipe),
        "bottleneck": max(per_process, key=per_process.__getitem__),
        "cpu_s_per_batch": total,
        **{f"{k}_s": v for k, v in per_process.items()},
    }


def describe(times: Mapping[str, float], bound: Mapping[str, Any], cores: int) -> str:
    """One line: the stage times (ms) and the bounds they imply."""
    parts = ", ".join(f"{s} {1e3 * times[s]:.1f}" for s in STAGES)
    return (
        f"stage ms: {parts}; {cores} x B / sum = {bound['work_bound']:.1f}, "
        f"B / max process ({bound['bottleneck']}) = {bound['pipeline_bound']:.1f} samples/s"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG), help="run config (default: the demo's)")
    ap.add_argument("--cache-dir", default=".asyncrl_cache", help="where the pretrained pairs are")
    ap.add_argument("--cores", type=int, default=2, help="CPU cores the bound is computed for")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="key=value overrides of the run config")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    apply_env()  # a run's process environment (TORCH_ENV: torch's allocator), before any tensor
    cfg = load_config(
        args.config,
        [f"workload.cache_dir={args.cache_dir}", "pipeline.torch_threads=1", *args.extra],
    )
    times = measure_stage_times(cfg, repeats=args.repeats, warmup=args.warmup)
    bound = throughput_bound(times, cfg.train.batch_size, args.cores)
    print(
        f"task={cfg.workload.task} preset={cfg.workload.preset} B={cfg.train.batch_size} "
        f"T={cfg.sampling.max_new_tokens} estimator={cfg.estimator.name} {dict(cfg.estimator.options)} "
        "torch_threads=1"
    )
    print(describe(times, bound, args.cores))
    print(f"two-core limit: {bound['limit']:.1f} samples/s")
    figures = {"stage_s": times, "bound": bound}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
