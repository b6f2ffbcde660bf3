"""records.trim_to_longest: the learner computes only over positions some row uses, with the same loss."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from asyncrl import records as R
from asyncrl.lab.presets import ModelSpec, build_model

torch.set_num_threads(1)


def _batch() -> dict[str, torch.Tensor]:
    # prompts left-padded to P = 6 (the stream's width), the longest of this batch is 4 tokens;
    # completions right-padded to T = 5, the longest is 3
    prompt_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    prompt_ids = torch.where(prompt_mask, torch.tensor([[0, 0, 0, 5, 6, 7], [0, 0, 8, 9, 10, 11]]), 0)
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    completion_ids = torch.where(completion_mask, torch.tensor([[12, 13, 14, 0, 0], [15, 16, 0, 0, 0]]), 0)
    return {
        R.PROMPT_IDS: prompt_ids,
        R.PROMPT_MASK: prompt_mask,
        R.COMPLETION_IDS: completion_ids,
        R.COMPLETION_MASK: completion_mask,
        R.BEHAVIOR_LOGPROBS: torch.zeros(2, 5),
    }


def test_trims_prompt_left_padding_and_completion_right_padding() -> None:
    out = R.trim_to_longest(_batch())
    assert out[R.PROMPT_IDS].tolist() == [[0, 5, 6, 7], [8, 9, 10, 11]]
    assert out[R.PROMPT_MASK].tolist() == [[False, True, True, True], [True, True, True, True]]
    assert out[R.COMPLETION_IDS].shape == (2, 3) and out[R.BEHAVIOR_LOGPROBS].shape == (2, 3)


def test_trimmed_batch_scores_the_same() -> None:
    """Positions come from the attention mask: dropping all-padding prompt columns leaves the logits
    of every completion token unchanged (to float error)."""
    model = build_model(ModelSpec("llama", hidden=32, layers=2, heads=2, intermediate=64), 20, 0).eval()
    b, t = _batch(), R.trim_to_longest(_batch())
    with torch.no_grad():
        full = R.completion_logits(
            model, b[R.PROMPT_IDS], b[R.PROMPT_MASK], b[R.COMPLETION_IDS], b[R.COMPLETION_MASK]
        )
        cut = R.completion_logits(
            model, t[R.PROMPT_IDS], t[R.PROMPT_MASK], t[R.COMPLETION_IDS], t[R.COMPLETION_MASK]
        )
    m = t[R.COMPLETION_MASK]
    torch.testing.assert_close(cut[m], full[:, :3][m], rtol=1e-5, atol=1e-5)


def test_padding_fraction() -> None:
    b = {k: v.numpy() for k, v in _batch().items()}
    # valid: prompts 3 + 4, completions 3 + 2 = 12 of 2 x (4 + 3) = 14 positions after trimming
    assert R.padding_fraction(b) == pytest.approx(1 - 12 / 14)
    full = {R.PROMPT_MASK: np.ones((2, 3), bool), R.COMPLETION_MASK: np.ones((2, 2), bool)}
    assert R.padding_fraction(full) == 0.0
