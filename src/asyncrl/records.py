"""Rollout and train-batch records: column names, dtypes, shapes, validation, alignment.

A batch is a flat mapping ``column -> array`` (numpy in Ray Data, torch in the learner).
All per-token columns are padded to the batch's longest completion ``T``; ``completion_mask``
marks the valid positions. Prompts are **left**-padded to ``P`` and ``prompt_mask`` marks
their valid positions, so a sequence is ``cat(prompt_ids, completion_ids)`` with no gap.

Alignment (the classic silent bug lives here, and only here): a causal LM's logits at
sequence position ``i`` score token ``i + 1``. Completion token ``t`` sits at position
``P + t``, so it is scored by the logits at position ``P + t - 1``. ``completion_logits``
and ``align_logits`` do that shift once; every estimator receives logits already aligned:
``student_logits[b, t]`` is the distribution that scored ``completion_ids[b, t]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# --- column names (contract: shared/DESIGN.md section 4) ---------------------------------
PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
COMPLETION_IDS = "completion_ids"
COMPLETION_MASK = "completion_mask"
BEHAVIOR_LOGPROBS = "behavior_logprobs"
TOKEN_VERSIONS = "token_versions"
MC_IDS = "mc_ids"
MC_BEHAVIOR_LOGPROBS = "mc_behavior_logprobs"
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOGPROBS = "teacher_topk_logprobs"
#: log(1 − Σ_k p): the teacher's mass outside its top-k, from the full logits at scoring time
TEACHER_TOPK_LOG_TAIL = "teacher_topk_log_tail"
TEACHER_MC_IDS = "teacher_mc_ids"
TEACHER_MC_LOGPROBS = "teacher_mc_logprobs"
TEACHER_TOKEN_LOGPROBS = "teacher_token_logprobs"
TEACHER_LOGITS = "teacher_logits"
REWARD = "reward"
GROUP_ID = "group_id"
SAMPLE_ID = "sample_id"
PROMPT_ID = "prompt_id"
VERSION_FIRST = "version_first"
VERSION_LAST = "version_last"
#: per sample: the fingerprint of the weights its tokens were sampled with, as the engine measured
#: them after loading (asyncrl.provenance; one version: that version's, several: combined in order)
WEIGHTS_FINGERPRINT = "weights_fingerprint"
#: per sample (a string, not a tensor column): which engine generated it (kind, node, process, actor)
GEN_ENGINE = "gen_engine"
#: position of a sample's input block in the prompt stream (admission and consumption order)
BLOCK_INDEX = "block_index"
#: non-tensor columns of a prompt row: the reference answer (a string) and, for prompt files, the
#: row's other columns as one JSON object string, both for the reward (asyncrl.workloads.prompts)
ANSWER = "answer"
METADATA = "metadata"


@dataclass(frozen=True)
class Column:
    """Shape is a tuple of symbolic dims: B batch, P prompt, T completion, k top-k, m samples, V vocab."""

    name: str
    dims: tuple[str, ...]
    kind: str  # "int" | "float" | "bool"
    doc: str
    logprob: bool = False  # values must be finite and <= 0 where valid


COLUMNS: dict[str, Column] = {
    c.name: c
    for c in [
        Column(PROMPT_IDS, ("B", "P"), "int", "prompt tokens, left-padded"),
        Column(PROMPT_MASK, ("B", "P"), "bool", "valid prompt positions"),
        Column(COMPLETION_IDS, ("B", "T"), "int", "completion tokens, right-padded (EOS included)"),
        Column(COMPLETION_MASK, ("B", "T"), "bool", "valid completion positions"),
        Column(BEHAVIOR_LOGPROBS, ("B", "T"), "float", "log pi_b of each generated token", True),
        Column(TOKEN_VERSIONS, ("B", "T"), "int", "policy version that generated each token"),
        Column(MC_IDS, ("B", "T", "m"), "int", "m draws from pi_b; column 0 = generated token"),
        Column(MC_BEHAVIOR_LOGPROBS, ("B", "T", "m"), "float", "log pi_b at mc_ids", True),
        Column(TEACHER_TOPK_IDS, ("B", "T", "k"), "int", "teacher top-k ids"),
        Column(TEACHER_TOPK_LOGPROBS, ("B", "T", "k"), "float", "teacher log p at top-k (full-vocab)", True),
        Column(
            TEACHER_TOPK_LOG_TAIL,
            ("B", "T"),
            "float",
            "teacher log(1 - sum_k p) outside the top-k (masked logsumexp of the full logits)",
            True,
        ),
        Column(TEACHER_MC_IDS, ("B", "T", "m"), "int", "m draws from the teacher p"),
        Column(
            TEACHER_MC_LOGPROBS, ("B", "T", "m"), "float", "teacher log p at mc_ids / teacher_mc_ids", True
        ),
        Column(TEACHER_TOKEN_LOGPROBS, ("B", "T"), "float", "teacher log p at the generated token", True),
        Column(TEACHER_LOGITS, ("B", "T", "V"), "float", "teacher full logits (dense cache; tests only)"),
        Column(REWARD, ("B",), "float", "scalar reward"),
        Column(GROUP_ID, ("B",), "int", "GRPO group (prompt instance)"),
        Column(SAMPLE_ID, ("B",), "int", "unique sample id"),
        Column(PROMPT_ID, ("B",), "int", "index of the prompt in its source"),
        Column(VERSION_FIRST, ("B",), "int", "version of the first generated token"),
        Column(VERSION_LAST, ("B",), "int", "version of the last generated token"),
        Column(WEIGHTS_FINGERPRINT, ("B",), "int", "fingerprint of the weights that generated the sample"),
    ]
}

ROLLOUT_COLUMNS = (
    PROMPT_IDS,
    PROMPT_MASK,
    COMPLETION_IDS,
    COMPLETION_MASK,
    BEHAVIOR_LOGPROBS,
    TOKEN_VERSIONS,
    SAMPLE_ID,
    PROMPT_ID,
    GROUP_ID,
)


def _kind_of(x: Any) -> str:
    dt = x.dtype
    if isinstance(x, torch.Tensor):
        if dt == torch.bool:
            return "bool"
        return "float" if dt.is_floating_point else "int"
    if dt == np.bool_:
        return "bool"
    return "float" if np.issubdtype(dt, np.floating) else "int"


def validate_batch(
    batch: Mapping[str, Any],
    columns: tuple[str, ...] | list[str] | None = None,
    *,
    vocab_size: int | None = None,
) -> dict[str, int]:
    """Check shapes, dtypes, finiteness and masks; return the resolved dims.

    ``columns`` are required (default: every known column present in ``batch``).
    Raises ``ValueError`` naming the offending column and the fix.
    """
    names = list(columns) if columns is not None else [c for c in batch if c in COLUMNS]
    dims: dict[str, int] = {}
    for name in names:
        if name not in batch:
            raise ValueError(f"column {name!r} is missing from the batch; present: {sorted(batch)}")
        col = COLUMNS.get(name)
        if col is None:
            continue
        x = batch[name]
        if len(x.shape) != len(col.dims):
            raise ValueError(f"column {name!r} must have shape {list(col.dims)}, got {tuple(x.shape)}")
        for d, n in zip(col.dims, x.shape):
            if d in dims and dims[d] != n:
                raise ValueError(
                    f"column {name!r} has {d}={n} but other columns have {d}={dims[d]}; "
                    f"pad all per-token columns to the same length"
                )
            dims[d] = int(n)
        kind = _kind_of(x)
        if kind != col.kind and not (col.kind == "bool" and kind == "int"):
            raise ValueError(f"column {name!r} must hold {col.kind} values, got dtype {x.dtype}")
    mask = batch.get(COMPLETION_MASK)
    for name in names:
        col = COLUMNS.get(name)
        if col is None or col.kind != "float":
            continue
        x = _as_tensor(batch[name])
        m: torch.Tensor | None = None
        if mask is not None and col.dims[:2] == ("B", "T"):
            m = _as_tensor(mask).bool()
            while m.dim() < x.dim():
                m = m.unsqueeze(-1)
        # masked reductions, not x[mask]: gathering the valid values (nonzero + index) cost the
        # learner ~1.4 ms a step on a dense [B, T, V] teacher column; they are gathered on error only
        bad = ~torch.isfinite(x)
        if m is not None:
            bad &= m
        if bad.any():
            raise ValueError(f"column {name!r} has non-finite values at valid positions")
        if not col.logprob:
            continue
        over = x > 1e-6
        if m is not None:
            over &= m
        if over.any():
            valid = x[m.expand_as(x)] if m is not None else x
            raise ValueError(
                f"column {name!r} holds log-probabilities but has values > 0 (max {valid.max().item():.3g}); "
                f"store log-probabilities normalised over the full vocabulary"
            )
    if vocab_size is not None:
        for name in names:
            col = COLUMNS.get(name)
            if col is None or col.kind != "int" or not name.endswith("_ids"):
                continue
            x = _as_tensor(batch[name])
            if x.numel() and (x.min() < 0 or x.max() >= vocab_size):
                raise ValueError(
                    f"column {name!r} has ids outside the vocabulary [0, {vocab_size}): "
                    f"min {int(x.min())}, max {int(x.max())}"
                )
    return dims


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(_writable(np.asarray(x)))


# --- alignment ------------------------------------------------------------------------------
def align_logits(logits: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Full-sequence logits [B, P+T, V] -> logits aligned to completion tokens [B, T, V].

    ``out[:, t]`` is ``logits[:, P - 1 + t]``: the distribution that scored completion token t.
    Returns a view (no copy). The last position (which scores the token after the sequence) is
    dropped.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1: the first completion token needs a preceding position")
    return logits[:, prompt_len - 1 : -1]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first valid token is position 0.

    Engines and learners must use the same convention, or behavior and current log-probs
    disagree even at staleness 0.
    """
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def completion_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """One forward pass of a causal LM over prompt+completion; logits aligned to completions [B, T, V].

    Padded completion positions still get logits (they are masked downstream). The LM head runs
    only at the ``T + 1`` last positions when the model takes transformers' ``logits_to_keep``
    (``keeps_logits``): the prompt's other positions score nothing we use, and at a real
    vocabulary their [B, P, V] logits (and, in the learner, their zero gradient) are most of the
    forward's memory and time (chat-templated `qwen-tiny` prompts: P ~ 17 against T = 4).
    """
    if prompt_ids.shape[1] < 1:
        raise ValueError("prompt_len must be >= 1: the first completion token needs a preceding position")
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask.bool(), completion_mask.bool()], dim=1).long()
    kw: dict[str, Any] = {"logits_to_keep": completion_ids.shape[1] + 1} if keeps_logits(model) else {}
    out = model(
        input_ids=input_ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False, **kw
    )
    if kw:
        return out.logits[:, :-1]  # positions P - 1 .. P + T - 2, as align_logits
    return align_logits(out.logits, prompt_ids.shape[1])


_KEEPS_LOGITS: dict[Any, bool] = {}
_WRAPPERS = ("DistributedDataParallel", "DeepSpeedEngine")


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the module a DDP / DeepSpeed wrapper holds) takes transformers'
    ``logits_to_keep`` (the LM head only at the last k positions); a user model may not."""
    inner = model
    while type(inner).__name__ in _WRAPPERS and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module  # their forward passes keyword arguments through
    fn = type(inner).forward
    if fn not in _KEEPS_LOGITS:
        import inspect

        _KEEPS_LOGITS[fn] = "logits_to_keep" in inspect.signature(fn).parameters
    return _KEEPS_LOGITS[fn]


# --- Ray Data <-> torch ----------------------------------------------------------------------
def to_numpy(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """torch/numpy/list batch -> dict of numpy arrays (what Ray Data ``map_batches`` returns).

    Multi-dimensional arrays become Arrow tensor columns in Ray Data.
    """
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().numpy()
        out[k] = np.asarray(v)
    return out


def _writable(arr: np.ndarray) -> np.ndarray:
    """``arr``, or a copy of it if read-only: Ray Data hands out zero-copy views of its object
    store, and a tensor over read-only memory is undefined behaviour on write (torch warns)."""
    return arr if arr.flags.writeable else arr.copy()


def writable(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A batch whose numpy arrays may back tensors (read-only ones copied, see ``_writable``)."""
    return {k: _writable(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def to_torch(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """numpy batch (as yielded by Ray Data) -> dict of torch tensors; masks become bool."""
    out = {}
    for k, v in batch.items():
        arr = np.asarray(v)
        if arr.dtype == object:
            arr = np.stack([np.asarray(x) for x in arr])
        t = torch.from_numpy(_writable(np.ascontiguousarray(arr)))
        if k.endswith("_mask"):
            t = t.bool()
        out[k] = t
    return out


def trim_to_longest(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut per-token columns ([B, T, ...]) to the batch's longest completion (at least 1), and the
    prompt columns ([B, P]) to its longest prompt (their left padding that no row uses).

    Rollouts are padded to ``max_new_tokens`` and prompts to the stream's prompt width P so Ray
    Data blocks have fixed shapes; the learner computes only over positions some sample uses.
    Masks are unchanged, and positions come from the attention mask (``position_ids``), so losses
    are too. With chat prompts of heavy-tailed length the stream's P is the longest of thousands
    of prompts, so a batch's longest prompt is often much shorter.
    """
    t_eff = max(int(batch[COMPLETION_MASK].sum(1).max()), 1)
    out = dict(batch)
    for k, col in COLUMNS.items():
        if k in out and len(col.dims) >= 2 and col.dims[1] == "T":
            out[k] = out[k][:, :t_eff]
    if PROMPT_MASK in out and PROMPT_IDS in out:
        p_eff = max(int(out[PROMPT_MASK].sum(1).max()), 1)
        out[PROMPT_IDS], out[PROMPT_MASK] = out[PROMPT_IDS][:, -p_eff:], out[PROMPT_MASK][:, -p_eff:]
    return out


def padding_fraction(batch: Mapping[str, Any]) -> float:
    """Fraction of the [B, P + T] positions the learner computes over (after ``trim_to_longest``)
    that are padding: 1 − (valid prompt + completion tokens) / (B · (P_eff + T_eff))."""
    pm = np.asarray(batch[PROMPT_MASK]).astype(bool)
    cm = np.asarray(batch[COMPLETION_MASK]).astype(bool)
    p_eff = max(int(pm.sum(1).max()), 1) if pm.size else 1
    t_eff = max(int(cm.sum(1).max()), 1) if cm.size else 1
    total = pm.shape[0] * (p_eff + t_eff)
    return 1.0 - float(pm.sum() + cm.sum()) / total if total else 0.0


def pad_to(x: torch.Tensor, length: int, value: float | int | bool) -> torch.Tensor:
    """Right-pad dim 1 of ``x`` to ``length`` with ``value``: the inverse of ``trim_to_longest``
    (rollout and cache columns are padded to ``max_new_tokens`` so Ray Data blocks have fixed shapes)."""
    missing = length - x.shape[1]
    if missing <= 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[1] = missing
    return torch.cat([x, torch.full(pad_shape, value, dtype=x.dtype, device=x.device)], dim=1)
