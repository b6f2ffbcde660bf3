"""Checking and sanitising the record columns an Estimator reads, before any math runs.

The functional core stays lean; the classes call ``check_inputs`` once per step so a bad
record (teacher log-probs > 0 or non-finite, ids outside the vocabulary, shapes that do not
match the logits) fails with the column's name and the fix instead of a NaN three steps later.
``fill_padding`` then gives padded positions harmless values, because a NaN there would
survive masking in the backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from asyncrl import records as R


def check_inputs(
    estimator: str,
    student_logits: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    columns: Iterable[str],
) -> None:
    """Validate ``columns`` of ``batch`` against ``student_logits [B, T, V]``.

    Raises ValueError naming the estimator, the column and the fix."""
    if student_logits.dim() != 3:
        raise ValueError(
            f"{estimator}: student_logits must be [B, T, V] aligned to completion tokens "
            f"(records.completion_logits), got shape {tuple(student_logits.shape)}"
        )
    B, T, V = student_logits.shape
    cols = list(columns)
    try:
        dims = R.validate_batch(batch, cols, vocab_size=V)
    except ValueError as err:
        raise ValueError(f"{estimator}: {err}") from None
    for d, n in (("B", B), ("T", T), ("V", V)):
        if d in dims and dims[d] != n:
            col = next(c for c in cols if c in R.COLUMNS and d in R.COLUMNS[c].dims)
            raise ValueError(
                f"{estimator}: column {col!r} has {d}={dims[d]} but student_logits [B, T, V] has {d}={n}; "
                f"pass logits aligned to the completion tokens of this batch (records.completion_logits)"
            )


def check_logprob_column(estimator: str, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """For columns outside ``records.COLUMNS`` (e.g. ``ref_logprobs``): shape ``[B, T]``, finite, ≤ 0."""
    if x.shape != mask.shape:
        raise ValueError(
            f"{estimator}: column {name!r} must have the shape of completion_mask {tuple(mask.shape)}, "
            f"got {tuple(x.shape)}"
        )
    valid = x[mask.bool()]
    if not torch.isfinite(valid).all():
        raise ValueError(f"{estimator}: column {name!r} has non-finite values at valid positions")
    if (valid > 1e-6).any():
        raise ValueError(
            f"{estimator}: column {name!r} holds log-probabilities but has values > 0; "
            f"store log-probabilities normalised over the full vocabulary"
        )


def check_token_logprobs(
    estimator: str, token_logprobs: torch.Tensor | None, student_logits: torch.Tensor, mask: torch.Tensor
) -> None:
    """A precomputed ``token_logprobs`` must be a float ``[B, T]`` tensor (the shape of
    ``completion_mask``) that carries the gradient whenever ``student_logits`` does."""
    if token_logprobs is None:
        return
    fix = "pass gather_logprobs(student_logits, completion_ids) computed with grad, or None"
    if tuple(token_logprobs.shape) != tuple(mask.shape) or not token_logprobs.is_floating_point():
        raise ValueError(
            f"{estimator}: token_logprobs must be a float [B, T] tensor of log π_θ at completion_ids with "
            f"the shape of completion_mask {tuple(mask.shape)}, got {tuple(token_logprobs.shape)} "
            f"{token_logprobs.dtype}; {fix}"
        )
    if student_logits.requires_grad and not token_logprobs.requires_grad:
        raise ValueError(f"{estimator}: token_logprobs carries no gradient (detached or no_grad); {fix}")


def fill_padding(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with every padded position (``mask`` False, broadcast over trailing axes) set to ``value``."""
    m = mask.bool()
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    return torch.where(m, x, torch.full((), value, dtype=x.dtype, device=x.device))
