"""The teacher-scoring stage of the Ray Data graph: ``map_batches(ScoreTeacher, actor pool)``.

The teacher is frozen, so its scores never go stale: only which tokens get scored depends on
the (possibly stale) student that generated them. The stage runs one teacher forward over
prompt + completion and keeps only the finite record its TeacherCache kind declares
(top-k, scores at the behavior MC samples, the generated token, teacher samples), never the
full [B, T, V] logits. It also scores the task reward, for accuracy telemetry.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from asyncrl import records as R
from asyncrl.caches import CACHES, score_teacher
from asyncrl.rollout import ScoreReward, batch_seed, node_id


class ScoreTeacher:
    """Ray Data actor UDF holding the teacher model for the actor's lifetime."""

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
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(torch_threads)
        model = AutoModelForCausalLM.from_pretrained(teacher_dir, local_files_only=True)
        self.model = model.to(device).eval()  # score_teacher moves each batch to the model's device
        self.cache = CACHES.get(cache)(**cache_options)
        self.reward = ScoreReward(task=task, tokenizer_dir=teacher_dir)
        self.seed = seed

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(batch[R.SAMPLE_ID]) == 0:
            return batch
        t0 = time.perf_counter()
        tensors = R.to_torch({k: v for k, v in batch.items() if k in R.COLUMNS})
        scores = score_teacher(
            self.model, tensors, self.cache, seed=batch_seed(self.seed + 1, batch[R.SAMPLE_ID])
        )
        out = dict(batch)
        out.update(R.to_numpy(scores))
        out[R.REWARD] = self.reward.rewards(batch)
        out["score_node"] = np.full(len(out[R.REWARD]), node_id(), dtype=object)
        out["score_time_s"] = np.full(len(out[R.REWARD]), time.perf_counter() - t0, dtype=np.float64)
        out["score_done_at"] = np.full(len(out[R.REWARD]), time.time(), dtype=np.float64)
        return out
