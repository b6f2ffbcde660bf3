"""Teacher caches: which finite teacher scores are kept per completion token.

Full teacher distributions are too big to ship (|V| floats per token), so the teacher stage
keeps a finite record, built in one pass from the teacher's aligned logits at scoring time.
Teacher scores never go stale (the teacher is frozen); what each kind keeps decides which
estimators can run and with what bias (``shared/research/opd_estimators.md`` section 4):

- ``topk(k)``: ``teacher_topk_ids``/``teacher_topk_logprobs`` [k] and ``teacher_topk_log_tail``
  (``log(1 − Σ_k p)``, a masked logsumexp of the full logits: exact however small the tail,
  which ``1 − Σ exp(lp)`` in fp32 is not); for ``forward_kl``, ``reverse_kl``.
- ``behavior_mc``: ``teacher_mc_logprobs`` [m] at the rollout's ``mc_ids`` (draws from π_b);
  for ``reverse_kl_mc``.
- ``token``: ``teacher_token_logprobs`` at the generated token; for ``reverse_kl_mc`` with
  ``source="token"``.
- ``teacher_mc(m, seed)``: ``teacher_mc_ids``/``teacher_mc_logprobs`` [m], ids drawn from p;
  for ``forward_kl_mc``.
- ``topk_behavior_mc(k)``: the top-k columns plus ``teacher_mc_logprobs``; for
  ``reverse_kl_stratified`` (and it can stand in for ``topk`` or ``behavior_mc``).
- ``dense``: ``teacher_logits`` [V] (small vocabularies and tests); for the dense KLs.

Teacher log-probs are always normalised over the FULL vocabulary, never renormalised on the
kept ids, so the tail mass ``1 − Σ_k p`` stays derivable. Ids are stored as int32 and
log-probs in the compute dtype of the logits (fp32; fp64 stays fp64).

Temperature: every kind scores the tempered teacher ``softmax(z_t / τ)`` with ``τ`` the rollout
engine's sampling temperature (the ``temperature`` option, set by the run from
``sampling.temperature``), because the learner computes the student at the same ``τ`` (its
ratios are against the engine's ``softmax(z / τ)``): the objective is then
``KL(softmax(z_s/τ) ‖ softmax(z_t/τ))``, whose minimiser ``z_s = z_t + const`` is the same as at
``τ = 1``.

``score_teacher`` is the pure function the Ray teacher stage calls; ``check_pairing`` is the
pipeline-build-time check that a cache kind feeds an estimator; ``cache_options`` filters the
run-level ``k``/``m``/``seed`` to the fields a kind has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from asyncrl import records as R
from asyncrl.configurable import check, field
from asyncrl.estimators.functional import compute_dtype, gather_logprobs, gather_logprobs_and_log_tail
from asyncrl.registry import Registry, RegistryError

__all__ = [
    "CACHES",
    "BehaviorMCCache",
    "DenseCache",
    "TeacherCache",
    "TeacherMCCache",
    "TokenCache",
    "TopKBehaviorMCCache",
    "TopKCache",
    "bytes_table",
    "cache_for",
    "cache_options",
    "check_pairing",
    "score_teacher",
]

CACHES: Registry[type] = Registry("cache")

#: storage dtype of cached ids (|V| < 2^31); estimators cast to int64 for gathers
ID_DTYPE = torch.int32
#: bytes per stored element: an int32 id or an fp32 log-prob/logit
_ELEM_BYTES = 4
#: sequence positions per chunk of the teacher's log-softmax gathers
SCORE_CHUNK = 128
#: tolerance on the top-k mass check: Σ_k p ≤ 1 + MASS_EPS
MASS_EPS = 1e-4


@runtime_checkable
class TeacherCache(Protocol):
    """A cache kind: what it writes, what it costs, how it is built and checked."""

    name: str
    #: cache kinds this one can stand in for (itself, plus any kind whose columns it also writes)
    provides: frozenset[str]

    def columns(self) -> tuple[str, ...]:
        """Record columns ``build`` writes."""
        ...

    def input_columns(self) -> tuple[str, ...]:
        """Rollout columns ``build`` reads besides prompt/completion ids and masks (e.g. ``mc_ids``)."""
        ...

    def bytes_per_token(
        self, *, vocab_size: int | None = None, m: int | None = None, include_inputs: bool = False
    ) -> int:
        """Bytes the written columns cost per completion token (``include_inputs`` adds the rollout
        columns the cache needs that exist only for it, e.g. ``mc_ids``/``mc_behavior_logprobs``)."""
        ...

    def build(
        self,
        teacher_logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Teacher logits aligned to completion tokens ``[B, T, V]`` -> the cache columns, in one pass."""
        ...

    def validate(self, record: Mapping[str, torch.Tensor], *, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the column if the record is malformed."""
        ...


# --- shared pieces -----------------------------------------------------------------------------------
#: what a missing size is called in ``bytes_per_token``'s error (the argument that supplies it)
_SIZE_ARGS = {"m": "m (the engine's mc_samples)", "V": "vocab_size"}


def _logprobs_at(teacher_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return gather_logprobs(teacher_logits, ids.long(), chunk_size=SCORE_CHUNK)


def _require(cache: str, batch: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in batch]
    if missing:
        raise ValueError(
            f"teacher cache {cache!r} needs the rollout columns {missing}, missing from the batch; "
            f"e.g. mc_ids come from the engine with sampling.mc_samples = m > 0"
        )


def _valid(record: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    mask = record.get(R.COMPLETION_MASK)
    return x[mask.bool()] if mask is not None else x.reshape(-1, x.shape[-1])


@dataclass(frozen=True)
class _CacheKind:
    """Shared body of the built-in kinds (``TeacherCache`` protocol): a kind states only its
    columns, the rollout columns it reads, what it writes (``_write``) and any check beyond the
    records contract (``_check``).

    Sizes come from the records contract: a column's trailing dims (after ``[B, T]``) are ``k``,
    ``m`` or ``V``, taken from the kind's own fields where it has them, else ``m`` is the engine's
    ``mc_samples`` and ``V`` the vocabulary. Every element costs 4 bytes (int32 id, fp32 value), so
    ``bytes_per_token = 4 · Σ_columns Π trailing sizes``; ``validate`` holds a record to the same sizes.
    """

    name: ClassVar[str]
    provides: ClassVar[frozenset[str]]
    #: record columns ``build`` writes
    _columns: ClassVar[tuple[str, ...]]
    #: rollout columns ``build`` reads besides prompt/completion ids and masks
    _inputs: ClassVar[tuple[str, ...]] = ()
    #: rollout columns that exist only for this kind (what ``include_inputs`` adds)
    _own_inputs: ClassVar[tuple[str, ...]] = ()
    #: the sampling temperature τ: teacher logits are divided by it before anything is kept
    temperature: float = dataclasses.field(
        default=1.0,
        kw_only=True,
        metadata={
            "help": "teacher temperature τ (the rollout's sampling.temperature): scores of softmax(z/τ)"
        },
    )

    def __post_init__(self) -> None:
        check(self.temperature > 0, "temperature", self.temperature, "use the sampling temperature, > 0")

    def columns(self) -> tuple[str, ...]:
        return self._columns

    def input_columns(self) -> tuple[str, ...]:
        return self._inputs

    def bytes_per_token(
        self, *, vocab_size: int | None = None, m: int | None = None, include_inputs: bool = False
    ) -> int:
        sizes = self._sizes(vocab_size, m)
        total = 0
        for col in (*self._columns, *(self._own_inputs if include_inputs else ())):
            n = _ELEM_BYTES
            for d in R.COLUMNS[col].dims[2:]:
                if sizes[d] is None:
                    raise ValueError(f"{self.name}: bytes_per_token needs {_SIZE_ARGS[d]}")
                n *= sizes[d]
            total += n
        return total

    def build(
        self,
        teacher_logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        _require(self.name, batch, self._inputs)
        if self.temperature != 1.0:
            teacher_logits = teacher_logits / self.temperature
        return self._write(teacher_logits, batch, generator=generator, seed=seed)

    def validate(self, record: Mapping[str, torch.Tensor], *, vocab_size: int | None = None) -> None:
        cols = [*self._columns, R.COMPLETION_MASK] if R.COMPLETION_MASK in record else list(self._columns)
        try:
            dims = R.validate_batch(record, cols, vocab_size=vocab_size)
        except ValueError as err:
            raise ValueError(f"teacher cache {self.name!r}: {err}") from None
        for d, want in self._sizes(vocab_size, None).items():
            if want is not None and dims.get(d, want) != want:
                col = next(c for c in self._columns if d in R.COLUMNS[c].dims)
                raise ValueError(
                    f"teacher cache {self.name!r}: column {col!r} has {d}={dims[d]}, expected {d}={want}"
                )
        self._check(record)

    def _sizes(self, vocab_size: int | None, m: int | None) -> dict[str, int | None]:
        return {"k": getattr(self, "k", None), "m": getattr(self, "m", m), "V": vocab_size}

    def _write(
        self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any
    ) -> dict[str, torch.Tensor]:
        """The cache columns from aligned, tempered teacher logits ``[B, T, V]``."""
        raise NotImplementedError

    def _check(self, record: Mapping[str, torch.Tensor]) -> None:
        """Checks beyond shapes, dtypes and sizes (none by default)."""


# --- kinds -----------------------------------------------------------------------------------------
@CACHES.register("topk")
@dataclass(frozen=True)
class TopKCache(_CacheKind):
    """Teacher top-k ids and log-probs (full-vocabulary normalised) and the log tail mass
    ``log(1 − Σ_k p)``, formed from the full logits (masked logsumexp) when they are at hand.

    8k + 4 bytes per token. Feeds the deterministic top-k estimators (``forward_kl``, ``reverse_kl``).
    """

    name: ClassVar[str] = "topk"
    provides: ClassVar[frozenset[str]] = frozenset({"topk"})
    _columns: ClassVar[tuple[str, ...]] = (
        R.TEACHER_TOPK_IDS,
        R.TEACHER_TOPK_LOGPROBS,
        R.TEACHER_TOPK_LOG_TAIL,
    )
    k: int = field(16, help="number of teacher top tokens kept per position")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.k >= 1, "k", self.k, "use k >= 1")

    def _write(
        self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any
    ) -> dict[str, torch.Tensor]:
        V = teacher_logits.shape[-1]
        if self.k > V:
            raise ValueError(f"topk cache: k={self.k} exceeds the vocabulary size {V}; use k <= {V}")
        ids = teacher_logits.topk(self.k, dim=-1, sorted=True).indices  # [B, T, k]
        lp, log_tail = gather_logprobs_and_log_tail(teacher_logits, ids, chunk_size=SCORE_CHUNK)
        return {
            R.TEACHER_TOPK_IDS: ids.to(ID_DTYPE),
            R.TEACHER_TOPK_LOGPROBS: lp,
            R.TEACHER_TOPK_LOG_TAIL: log_tail,
        }

    def _check(self, record: Mapping[str, torch.Tensor]) -> None:
        """Top-k mass ``Σ_k p ≤ 1`` (normalised over the full vocabulary), head and tail summing to 1,
        and distinct ids."""
        lp_valid = _valid(record, record[R.TEACHER_TOPK_LOGPROBS].double())
        if lp_valid.numel():
            log_mass = torch.logsumexp(lp_valid, -1)
            mass = log_mass.exp()
            if (mass > 1 + MASS_EPS).any():
                raise ValueError(
                    f"teacher cache {self.name!r}: column {R.TEACHER_TOPK_LOGPROBS!r} has top-k mass "
                    f"{float(mass.max()):.6g} > 1; store log-probabilities normalised over the full "
                    f"vocabulary, not renormalised on the top-k"
                )
            tail = record[R.TEACHER_TOPK_LOG_TAIL].double()
            mask = record.get(R.COMPLETION_MASK)
            tail = tail[mask.bool()] if mask is not None else tail.reshape(-1)
            total = torch.logaddexp(log_mass, tail).exp()
            if ((total - 1).abs() > MASS_EPS).any():
                bad = float(total[(total - 1).abs().argmax()])
                raise ValueError(
                    f"teacher cache {self.name!r}: top-k mass plus exp({R.TEACHER_TOPK_LOG_TAIL!r}) is "
                    f"{bad:.6g}, not 1; store log(1 - sum_k p) of the same teacher distribution"
                )
        ids_valid = _valid(record, record[R.TEACHER_TOPK_IDS])
        if ids_valid.numel():
            srt = ids_valid.sort(-1).values
            if (srt[:, 1:] == srt[:, :-1]).any():
                raise ValueError(
                    f"teacher cache {self.name!r}: column {R.TEACHER_TOPK_IDS!r} repeats an id at some "
                    f"position; top-k ids must be distinct"
                )


@CACHES.register("behavior_mc")
@dataclass(frozen=True)
class BehaviorMCCache(_CacheKind):
    """Teacher log-probs at the m behavior draws ``mc_ids`` the engine made at generation time.

    Duplicated draws are scored as they are (a multiset, not a set). 4m bytes written; with the
    engine's ``mc_ids`` and ``mc_behavior_logprobs`` that exist only for it, 12m in total.
    Feeds ``reverse_kl_mc``.
    """

    name: ClassVar[str] = "behavior_mc"
    provides: ClassVar[frozenset[str]] = frozenset({"behavior_mc"})
    _columns: ClassVar[tuple[str, ...]] = (R.TEACHER_MC_LOGPROBS,)
    _inputs: ClassVar[tuple[str, ...]] = (R.MC_IDS,)
    _own_inputs: ClassVar[tuple[str, ...]] = (R.MC_IDS, R.MC_BEHAVIOR_LOGPROBS)

    def _write(
        self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any
    ) -> dict[str, torch.Tensor]:
        return {R.TEACHER_MC_LOGPROBS: _logprobs_at(teacher_logits, batch[R.MC_IDS])}


@CACHES.register("token")
@dataclass(frozen=True)
class TokenCache(_CacheKind):
    """Teacher log-prob of the generated token only: 4 bytes per token, the cheapest record.

    Feeds the single-sample estimator (``reverse_kl_mc`` with ``source="token"``).
    """

    name: ClassVar[str] = "token"
    provides: ClassVar[frozenset[str]] = frozenset({"token"})
    _columns: ClassVar[tuple[str, ...]] = (R.TEACHER_TOKEN_LOGPROBS,)

    def _write(
        self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any
    ) -> dict[str, torch.Tensor]:
        _require(self.name, batch, (R.COMPLETION_IDS,))
        return {R.TEACHER_TOKEN_LOGPROBS: _logprobs_at(teacher_logits, batch[R.COMPLETION_IDS])}


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _row_seed(*parts: int) -> int:
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h & ((1 << 63) - 1)


@CACHES.register("teacher_mc")
@dataclass(frozen=True)
class TeacherMCCache(_CacheKind):
    """Teacher samples: m draws ``y_j ~ p`` (with replacement) at scoring time, plus ``log p(y_j)``.

    8m bytes per token. Feeds ``forward_kl_mc`` (unbiased FKL). Draws for a sample depend only
    on ``(seed, score seed, sample_id)``, not on how rows were batched; pass ``generator`` to
    ``build`` to draw from one stream instead.
    """

    name: ClassVar[str] = "teacher_mc"
    provides: ClassVar[frozenset[str]] = frozenset({"teacher_mc"})
    _columns: ClassVar[tuple[str, ...]] = (R.TEACHER_MC_IDS, R.TEACHER_MC_LOGPROBS)
    m: int = field(8, help="teacher draws per position")
    seed: int = field(0, help="seed of the teacher draws (mixed with the scoring seed and sample_id)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.m >= 1, "m", self.m, "use m >= 1")

    def _write(
        self,
        teacher_logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        *,
        generator: torch.Generator | None,
        seed: int,
    ) -> dict[str, torch.Tensor]:
        B, T, _ = teacher_logits.shape
        sample_ids = batch.get(R.SAMPLE_ID)
        ids = torch.empty(B, T, self.m, dtype=torch.long, device=teacher_logits.device)
        for b in range(B):  # one [T, V] softmax at a time
            gen = generator
            if gen is None:
                sid = int(sample_ids[b]) if sample_ids is not None else b
                gen = torch.Generator(device=teacher_logits.device).manual_seed(
                    _row_seed(self.seed, seed, sid)
                )
            probs = torch.softmax(teacher_logits[b].to(compute_dtype(teacher_logits.dtype)), dim=-1)
            if T:
                ids[b] = torch.multinomial(probs, self.m, replacement=True, generator=gen)
        return {R.TEACHER_MC_IDS: ids.to(ID_DTYPE), R.TEACHER_MC_LOGPROBS: _logprobs_at(teacher_logits, ids)}


@CACHES.register("topk_behavior_mc")
@dataclass(frozen=True)
class TopKBehaviorMCCache(TopKCache):
    """``topk(k)`` plus ``behavior_mc`` in one pass: the stratified estimator's head and tail.

    8k + 4m bytes written (12m more with the engine's MC columns). Feeds ``reverse_kl_stratified``.
    """

    name: ClassVar[str] = "topk_behavior_mc"
    provides: ClassVar[frozenset[str]] = frozenset({"topk_behavior_mc", "topk", "behavior_mc"})
    _columns: ClassVar[tuple[str, ...]] = (*TopKCache._columns, *BehaviorMCCache._columns)
    _inputs: ClassVar[tuple[str, ...]] = BehaviorMCCache._inputs
    _own_inputs: ClassVar[tuple[str, ...]] = BehaviorMCCache._own_inputs

    def _write(
        self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any
    ) -> dict[str, torch.Tensor]:
        head = super()._write(teacher_logits, batch)
        return {**head, **BehaviorMCCache()._write(teacher_logits, batch)}


@CACHES.register("dense")
@dataclass(frozen=True)
class DenseCache(_CacheKind):
    """The full teacher logits, 4|V| bytes per token: exact dense KL, for small vocabularies and tests."""

    name: ClassVar[str] = "dense"
    provides: ClassVar[frozenset[str]] = frozenset({"dense"})
    _columns: ClassVar[tuple[str, ...]] = (R.TEACHER_LOGITS,)

    def _write(
        self, teacher_logits: torch.Tensor, batch: Mapping[str, torch.Tensor], **draw: Any
    ) -> dict[str, torch.Tensor]:
        return {R.TEACHER_LOGITS: teacher_logits.to(compute_dtype(teacher_logits.dtype)).contiguous()}


# --- construction, scoring, pairing --------------------------------------------------------------------
def _resolve(cache: TeacherCache | str) -> TeacherCache:
    if isinstance(cache, str):
        try:
            return CACHES.get(cache)()
        except RegistryError as err:
            raise ValueError(str(err)) from None
    return cache


def cache_options(
    kind: str,
    *,
    k: int | None = None,
    m: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
) -> dict[str, Any]:
    """Run-level cache settings (``CacheConfig.k/m``, the run seed, ``sampling.temperature``) filtered
    to the fields ``kind`` has, so ``CACHES.get(kind)(**cache_options(kind, k=..., m=...))`` works
    for every kind."""
    cls = CACHES.get(kind)
    given = {"k": k, "m": m, "seed": seed, "temperature": temperature}
    names = (
        {f.name for f in fields(cls)}
        if isinstance(cls, type) and hasattr(cls, "__dataclass_fields__")
        else set()
    )
    return {n: v for n, v in given.items() if v is not None and n in names}


def score_teacher(
    teacher_model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    cache: TeacherCache | str,
    *,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """One teacher forward over prompt + completion -> the cache's columns ``[B, T, ...]``.

    Runs under ``no_grad`` through ``records.completion_logits`` (the single place the
    position shift happens, so teacher and student logits are aligned the same way). Put the
    teacher in eval mode. The cache's ``temperature`` (the rollout's τ) divides the logits.
    A half-precision teacher (``pipeline.teacher_dtype``) has its logits cast to fp32 first, so
    every cache column is computed (log-softmax, top-k mass, tail) and stored in fp32.
    ``seed`` feeds caches that sample (``teacher_mc``); inputs are moved
    to the model's device and outputs stay there.

    The forward runs over the batch's longest completion only (``records.trim_to_longest``):
    rollouts arrive padded to ``max_new_tokens`` and the teacher's cost grows with every position
    (demo config: 4 of 6 completion slots used, 11 of 13 positions). The columns come back padded
    to the input's T, with 0 at the padded positions (masked everywhere downstream).
    """
    cache = _resolve(cache)
    needed = (R.PROMPT_IDS, R.PROMPT_MASK, R.COMPLETION_IDS, R.COMPLETION_MASK, *cache.input_columns())
    missing = [c for c in needed if c not in batch]
    if missing:
        raise ValueError(
            f"score_teacher: columns {missing} are missing from the batch; present: {sorted(batch)}"
        )
    device = next(iter(teacher_model.parameters())).device
    length = batch[R.COMPLETION_IDS].shape[1]
    tb = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    tb = R.trim_to_longest(tb)
    with torch.no_grad():
        logits = R.completion_logits(
            teacher_model, tb[R.PROMPT_IDS], tb[R.PROMPT_MASK], tb[R.COMPLETION_IDS], tb[R.COMPLETION_MASK]
        )
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        record = cache.build(logits, tb, seed=seed)
    return {k: R.pad_to(v, length, 0) for k, v in record.items()}


def cache_for(estimator: Any) -> str | None:
    """The cache kind an estimator needs (its ``cache_kind``; None for reward-only estimators)."""
    kind = getattr(estimator, "cache_kind", None)
    if kind is not None and kind not in CACHES:
        raise ValueError(
            f"estimator {getattr(estimator, 'name', estimator)!r} asks for cache kind {kind!r}, which is not "
            f"registered; registered kinds: {CACHES.names()}"
        )
    return kind


def check_pairing(estimator: Any, cache_kind: str | None) -> None:
    """Raise ValueError at pipeline-build time if ``cache_kind`` does not write what ``estimator`` reads.

    ``None`` or ``"auto"`` means "what the estimator needs" and always passes. A kind passes if the
    estimator's ``cache_kind`` is in its ``provides`` (e.g. ``topk_behavior_mc`` also provides
    ``topk`` and ``behavior_mc``).
    """
    need = cache_for(estimator)
    name = getattr(estimator, "name", type(estimator).__name__)
    if cache_kind in (None, "auto"):
        return
    if need is None:
        raise ValueError(
            f"estimator {name!r} needs no teacher cache (it trains on rewards), but cache kind "
            f"{cache_kind!r} was configured; set cache.kind=auto"
        )
    cache = _resolve(cache_kind)
    # by kind, not by column name: teacher_mc_logprobs means "at mc_ids" for behavior_mc and
    # "at teacher_mc_ids" for teacher_mc
    provides = getattr(cache, "provides", frozenset({cache.name}))
    if need not in provides:
        teacher_cols = {c for _, cls in CACHES.items() for c in cls().columns()}
        wanted = sorted(set(estimator.required_columns()) & teacher_cols)
        raise ValueError(
            f"estimator {name!r} needs cache kind {need!r} (teacher columns {wanted}), but cache kind "
            f"{cache_kind!r} writes {sorted(cache.columns())} for a different purpose; "
            f"set cache.kind={need!r} or 'auto'"
        )


def bytes_table(vocab_size: int, k: int, m: int, *, include_inputs: bool = False) -> dict[str, int]:
    """Bytes per completion token of every registered kind at (V, k, m), for docs and benchmarks."""
    out = {}
    for kind, cls in CACHES.items():
        c = cls(**cache_options(kind, k=k, m=m))
        out[kind] = c.bytes_per_token(vocab_size=vocab_size, m=m, include_inputs=include_inputs)
    return out
