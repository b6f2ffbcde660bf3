"""Tied weights: state-dict keys that name one tensor.

A model that ties its input embedding and LM head (qwen3, GPT-2) has one parameter under two
``state_dict`` keys. With a real vocabulary that parameter is most of a small model (the
``qwen-tiny`` student: 151,936 x 64 floats, 39 MB of 78 MB keyed), so whatever copies, ships or
loads a state dict key by key does that work twice, and the copy it ends with is no longer tied.
These helpers find the aliases and copy each tensor once, keeping the aliasing in the copy; the
learner's weight publication, the PolicyStore's wire format, the engines' weight loads and the
band search's snapshots all go through them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def _view(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], str]:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), str(t.device))


def tied_aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{key: first key}`` for every key whose tensor is the same view of the same memory as an
    earlier key's (same address, dtype, shape, strides and device): a tie, not merely equal values.
    Empty tensors are never aliases (they all may report address 0)."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for key, t in state.items():
        if t.numel() == 0:
            continue
        view = _view(t)
        if view in first:
            aliases[key] = first[view]
        else:
            first[view] = key
    return aliases


def copy_once(
    state: Mapping[str, torch.Tensor], copy: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{key: copy(tensor)}`` where tied keys share one copy (``copy`` runs once per tensor), so the
    result is tied where ``state`` is and loading it writes each tied parameter once."""
    aliases = tied_aliases(state)
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        out[key] = out[aliases[key]] if key in aliases else copy(t)
    return out


def drop_tied_duplicates(
    state: Mapping[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """``state`` without the keys that are tied both in ``state`` and in ``model`` to the same first
    key: ``model.load_state_dict`` would copy the same values into the same parameter twice. A key
    tied in the model but sent as a separate tensor is kept (its values are not known to agree)."""
    in_model = tied_aliases(model.state_dict(keep_vars=True))
    aliases = tied_aliases(state)
    return {k: v for k, v in state.items() if k not in aliases or in_model.get(k) != aliases[k]}
