"""Prompt files streamed through the whole pipeline: a set larger than the run's epoch, a crash
and a resume that neither repeats nor skips a sample.

Each ``run`` starts and stops its own Ray instance (no shared ``ray_local``), as a user's crashed
command and its rerun do."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from asyncrl import records as R
from asyncrl.checkpoint import latest, load_ledger
from asyncrl.lab.tasks import Addition
from asyncrl.pipeline import run
from asyncrl.stream import FileStream, local_reader
from asyncrl.telemetry.summary import read_samples
from asyncrl.workloads.prompts import PromptSource

pytestmark = pytest.mark.ray

N_PROMPTS = 3000


def write_shards(folder: Path, n: int = N_PROMPTS, shards: int = 3) -> Path:
    """``n`` addition prompts over ``shards`` JSONL files, with an id and a metadata column."""
    folder.mkdir()
    examples = Addition().make_examples("train", n, seed=7)
    per = -(-n // shards)
    for s in range(shards):
        rows = [
            {"prompt": e.prompt, "answer": e.answer, "prompt_id": i, "source": f"shard{s}"}
            for i, e in enumerate(examples[s * per : (s + 1) * per], start=s * per)
        ]
        (folder / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_streamed_prompts_resume_without_repeating_or_skipping(tiny_pair, tmp_path):
    """3000 prompts in three shards, a run that needs far less than one epoch, two generators; it
    crashes after its step-3 checkpoint and resumes. Every sample of the seeded stream's first
    8 B positions is trained exactly once, and each is the prompt the stream puts there."""
    prompts = write_shards(tmp_path / "prompts")
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        run_dir,
        f"workload.prompts_path={prompts}",
        "workload.shuffle_window=500",
        "pipeline.generators=2",
        "pipeline.max_lag=1",
        "train.steps=8",
        "train.checkpoint_every=3",
        "train.eval_every=0",
    )
    B = cfg.train.batch_size
    assert 8 * B * 2 < N_PROMPTS  # the run does not reach the end of one epoch (with headroom)
    # the learner dies after step 4 and the run gives up (no worker-group restart): the driver's
    # rerun of the same config resumes from the step-3 checkpoint (the fault fires once per run)
    crash = replace(cfg, faults=replace(cfg.faults, learner_exit=4))
    crash = replace(crash, pipeline=replace(crash.pipeline, max_learner_failures=0))
    with pytest.raises(Exception):  # noqa: B017 - whatever Ray Train reports for the dead worker
        run(crash)
    assert len(load_ledger(latest(run_dir))) == 3 * B
    result = run(cfg)
    samples = read_samples(result.run_dir)
    kept = samples[samples["kept"]]
    assert kept["sample_id"].is_unique
    assert sorted(kept["sample_id"]) == list(range(8 * B))  # none repeated, none skipped
    assert sorted(load_ledger(latest(run_dir)).tolist()) == list(range(8 * B))
    assert sorted(kept["step"].unique()) == list(range(1, 9))

    # the prompts trained are the seeded stream's (predicted here without Ray)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair.student_dir)
    stream = FileStream(
        PromptSource.open(prompts),
        tok,
        seed=cfg.seed,
        group_size=1,
        block_samples=B,
        window=500,
        reader=local_reader("jsonl"),
    )
    expected = {}
    for i in range(8):
        block = stream.block(i)
        expected.update(zip(block[R.SAMPLE_ID].tolist(), block[R.PROMPT_ID].tolist()))
    got = dict(zip(kept["sample_id"].tolist(), kept["prompt_id"].tolist()))
    assert got == expected
    assert len(set(got.values())) == 8 * B  # prompts, not repeats of a few (no epoch was finished)
    # the seeded first shard's first window (500 rows), permuted: not the head of the file
    first = int(np.random.default_rng([cfg.seed, 0]).permutation(3)[0])
    assert {v // 1000 for v in got.values()} == {first}
    assert 8 * B <= max(v % 1000 for v in got.values()) < 500
