"""The rollout-engine seam: what every generator backend (HF on CPU, vLLM on GPU) must provide.

An engine turns left-padded prompts into completions and records exactly what the
staleness math needs: the behavior log-probability of every generated token under the
*exact* sampling distribution (temperature-scaled, untruncated), the policy version that
produced each token, and optionally ``m`` Monte Carlo draws per position from that same
distribution (column 0 = the generated token) with their log-probabilities.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from asyncrl import records
from asyncrl.sampling import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine can serve no further calls (its workers died, or a reload timed out and they may
    hold half-loaded weights); only a new engine from ``from_pretrained`` can continue.

    The generation stage answers it crash-only: its actor process exits, Ray Data restarts the
    actor (which builds a new engine and pulls the latest weights) and re-runs the block under
    the block's existing admission, up to ``pipeline.max_engine_restarts`` times per run.
    """


@runtime_checkable
class RolloutEngine(Protocol):
    """Generate with versioned weights.

    ``generate`` returns a dict of tensors with the columns of ``asyncrl.records``:
    ``completion_ids`` [B, T] int64 (right-padded with pad id), ``completion_mask`` [B, T] bool
    (EOS included), ``behavior_logprobs`` [B, T] float32, ``token_versions`` [B, T] int32 and,
    when ``params.mc_samples = m > 0``, ``mc_ids`` / ``mc_behavior_logprobs`` [B, T, m].
    Deterministic given ``seed`` and the weights.

    Provenance (``asyncrl.provenance``; checked by the learner under ``pipeline.provenance``): an
    engine should keep ``fingerprints``, a mapping version -> ``weights_fingerprint`` of the weights
    it holds at that version, taken from its *own* weights after every load (not from the state
    dict it was sent), for every version its tokens may carry. Not a protocol member, so engines
    written before it still pass ``isinstance``; without it every block reports no fingerprint and
    a ``strict`` run fails at its first block, saying so. An engine that keeps state derived from
    the weights (merged adapters, a KV or prefix cache) must rebuild or reset it on every load.

    In-flight updates (``pipeline.inflight_updates``): an engine that supports them takes a keyword
    ``poll_weights`` (a ``WeightsPoll``) in ``generate`` and calls it between decode steps; after it
    loads a newer version, the unfinished rows continue with the new weights and their later tokens
    carry the new version in ``token_versions`` (versions never go down along a row). Engines
    without the keyword are refused at build time when the setting is on.
    """

    name: str
    #: True if ``mc_samples > 0`` yields exact draws from the sampling distribution
    #: (the "behavior_mc" cache needs them); the pipeline refuses the pairing otherwise
    supports_mc: bool

    @classmethod
    def from_pretrained(cls, path: str, *, version: int = 0, **options: object) -> RolloutEngine:
        """Build the engine from an HF checkpoint directory on local disk (how Ray actors build it)."""
        ...

    @classmethod
    def check_supported(cls, path: str | None, params: SamplingParams, **options: object) -> None:
        """Raise ``ValueError`` (or ``ImportError`` naming the extra to install) if this engine,
        built by ``from_pretrained(path, **options)``, could not serve ``params``; with ``path``
        None (no checkpoint yet, e.g. ``asyncrl validate``) only the checks that need none.

        Why: the pipeline calls it in the driver before any actor starts, so a pairing the
        engine cannot serve (MC draws, a model its kernels lack) fails at build time with the
        setting to change instead of inside a Ray actor minutes later. Cheap: it may read the
        checkpoint's config but loads no weights.
        """
        ...

    @property
    def version(self) -> int: ...

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
    ) -> dict[str, torch.Tensor]:
        """Sample completions of the left-padded prompts with the loaded weights (class docstring)."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the learner's published weights; tokens generated from now on carry ``version``."""
        ...


#: ``generate(..., poll_weights=...)`` (``pipeline.inflight_updates``): called by an engine between
#: decode steps; returns ``(version, state_dict)`` of newer published weights for the engine to load
#: (``load_weights``) before its next step, or None. The answer comes without waiting (a version
#: check; the weights are fetched only when newer). A callback may also change the engine's
#: version itself (``weights_updated``) and return None; the engine stamps every later token with
#: whatever ``version`` holds after the call. It may raise ``EngineDeadError``.
WeightsPoll = Callable[[], "tuple[int, Mapping[str, torch.Tensor]] | None"]


def supports_inflight(engine: Any) -> bool:
    """Whether ``engine`` (a class or an instance) takes ``generate(..., poll_weights=...)``."""
    try:
        return "poll_weights" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


#: what the pipeline calls on an engine class (``pipeline.engine``): check_supported in the driver,
#: from_pretrained in every generator actor, then generate / load_weights / version per block
ENGINE_HOOKS = ("from_pretrained", "check_supported", "generate", "load_weights")


def check_engine(engine: Any, name: str, options: Mapping[str, Any]) -> None:
    """Refuse, before any actor starts, an engine the generator actors could not build.

    ``engine`` is what ``pipeline.engine`` names (a registered name or a dotted path
    ``package.module:Class``); it must provide the ``RolloutEngine`` hooks, and its
    ``from_pretrained(path, version=0, **options)`` must take ``pipeline.engine_options``. Why
    here: a user engine with a missing method or a misspelt option otherwise fails inside a Ray
    actor, after the models were loaded, with a traceback instead of the setting to change.
    """
    missing = [h for h in ENGINE_HOOKS if not callable(getattr(engine, h, None))]
    if missing:
        raise ValueError(
            f"pipeline.engine={name!r} is not a rollout engine: it has no {', '.join(missing)}; implement "
            f"the asyncrl.engines.RolloutEngine protocol ({', '.join(ENGINE_HOOKS)} and a version property)"
        )
    try:
        inspect.signature(engine.from_pretrained).bind("checkpoint", version=0, **options)
    except TypeError as err:
        sig = inspect.signature(engine.from_pretrained)
        raise ValueError(
            f"pipeline.engine_options={dict(options)!r} do not fit {name}.from_pretrained{sig} ({err}); "
            f"use only the options it takes"
        ) from None


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a ``Path`` if it holds an HF checkpoint (``config.json``); else a clear error."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(p)!r} is not an HF checkpoint directory (no config.json); pass a directory "
            f"written by save_pretrained, e.g. from `asyncrl pretrain`"
        )
    return p


# --- shared by the engines: input checks and the output record -------------------------------------
def check_version(version: int) -> int:
    """``version`` as an int >= 0 (optimizer steps applied); bools and negatives are refused."""
    try:
        v = operator.index(version)
    except TypeError:
        v = -1
    if isinstance(version, bool) or v < 0:
        raise ValueError(f"version must be an int >= 0 (optimizer steps applied), got {version!r}")
    return v


def check_prompts(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    vocab_size: int | None,
    max_len: tuple[str, int | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate left-padded prompts ``[B, P]`` for ``generate``; return ``(ids int64, mask bool)``.

    Why here: every engine must refuse the same bad input with the same fix (right padding, empty
    rows, ids outside ``[0, vocab_size)``, prompt + ``max_new_tokens`` over the context limit)
    before any sampling starts. ``max_len`` is ``(its name in the error, its value)``; a value or
    ``vocab_size`` of None skips that check (the model does not state it).
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be asyncrl.engines.SamplingParams, got {type(params).__name__}")
    if params.max_new_tokens == "auto":
        raise ValueError(
            "SamplingParams.max_new_tokens='auto' is resolved from the task by the run config "
            "(asyncrl.config.load_config); an engine needs a number: pass max_new_tokens=N"
        )
    ids, mask = torch.as_tensor(prompt_ids), torch.as_tensor(prompt_mask)
    if ids.dim() != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"prompt_ids and prompt_mask must both be [B, P]; got {tuple(ids.shape)} and {tuple(mask.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"prompt_ids must be integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError(f"prompt_ids is empty (shape {tuple(ids.shape)})")
    mask = mask.bool()
    empty = (~mask.any(1)).nonzero().flatten()
    if len(empty):
        raise ValueError(
            f"prompt_mask rows {empty[:5].tolist()} have no valid token; every prompt needs >= 1"
        )
    if (mask[:, 1:].long() < mask[:, :-1].long()).any():
        raise ValueError("prompts must be left-padded (mask 0...0 1...1 per row); use encode_prompts")
    valid = ids[mask]
    if vocab_size is not None and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        raise ValueError(
            f"prompt_ids has ids outside [0, vocab_size={vocab_size}) (min {int(valid.min())}, "
            f"max {int(valid.max())}); encode with the model's own tokenizer"
        )
    longest, (limit_name, limit) = int(mask.sum(1).max()), max_len
    if limit is not None and longest + params.max_new_tokens > limit:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens={params.max_new_tokens} exceeds "
            f"{limit_name}={limit}; shorten prompts or max_new_tokens"
        )
    return ids.long(), mask


def pack_rollout(
    draws: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    version: int | torch.Tensor,
    mc_samples: int,
) -> dict[str, torch.Tensor]:
    """Per-position draws -> the ``RolloutEngine.generate`` output dict.

    ``draws`` [B, T, k] int64 and their ``logprobs`` [B, T, k] (log pi_b) with column 0 = the
    generated token, ``k = max(mc_samples, 1)``; ``mask`` [B, T] bool. Padded slots must already
    hold the pad id and log-prob 0. Column 0 becomes ``completion_ids``/``behavior_logprobs``;
    for ``mc_samples > 0`` all k columns become ``mc_ids``/``mc_behavior_logprobs``; every token
    is stamped with ``version``: an int (one set of weights for the whole call) or a [B, T]
    tensor of the version that produced each token (in-flight updates, ``WeightsPoll``).

    The columns are always fresh, normal tensors, even when the engine sampled under
    ``torch.inference_mode`` (``HFEngine.generate``): an inference tensor cannot be saved for
    backward, so a plain training loop that computes a loss from the rollout (behavior log-probs
    in an importance ratio, completion ids in a gather) would fail on it.
    """
    B, T = mask.shape
    with torch.inference_mode(False):  # clone() of an inference tensor here is a normal tensor
        out = {
            records.COMPLETION_IDS: draws[..., 0].clone(memory_format=torch.contiguous_format),
            records.COMPLETION_MASK: mask.clone(memory_format=torch.contiguous_format),
            records.BEHAVIOR_LOGPROBS: logprobs[..., 0].clone(memory_format=torch.contiguous_format),
            records.TOKEN_VERSIONS: (
                torch.full((B, T), int(version), dtype=torch.int32, device=mask.device)
                if not isinstance(version, torch.Tensor)
                else version.to(mask.device, torch.int32).clone(memory_format=torch.contiguous_format)
            ),
        }
        if mc_samples > 0:
            out[records.MC_IDS] = draws.clone(memory_format=torch.contiguous_format)
            out[records.MC_BEHAVIOR_LOGPROBS] = logprobs.clone(memory_format=torch.contiguous_format)
    return out
