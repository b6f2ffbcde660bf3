"""Version provenance: prove that the weights a rollout engine sampled with are the weights the
learner published at the version the engine stamped on the tokens.

Why: the costliest async-RL bugs look like staleness but are not: weights that never reached an
engine (a LoRA adapter dropped for two months, verl #7495), arrived partially, reached the wrong
engine, or derived state that outlived an update (a KV cache not flushed, NeMo-RL #4018). The
learner trains "fine" on them. Version numbers cannot show it: the engine stamps the version it
was *told*, not the one it holds.

**Fingerprint.** A deterministic hash of a fixed sample of elements of every weight tensor: for
tensor ``key`` with ``n`` elements, ``k = min(n, SAMPLE_PER_TENSOR)`` flat indices drawn by a
generator seeded with ``crc32(key)`` (the same indices in every process, every version), the
elements read bit-exactly (their integer view) and hashed with the key, in key order, by
BLAKE2b into a signed 64-bit integer (0 is reserved for "no fingerprint"). Cost: one gather of
``k`` elements per tensor (the ``small`` student: ~0.3 ms; see BENCHMARKS.md), so every engine
computes it after every load and the learner after every step.

What it catches: a skipped load (the engine's elements are the older version's), a partial load
(a tensor not written keeps old elements; a tensor written in part differs at most sampled
indices of a trained tensor, since an Adam step moves nearly every element), weights applied to
another engine (that engine's fingerprint is then the older one), and a corrupted copy. What it
does not see: state *derived* from weights after the load (a merged LoRA copy, a KV or prefix
cache); an engine that keeps such state must rebuild it on every load, and says so (the HF engine
rebuilds its merged weights from the base copy on every load; its decoder reads the weights
afresh per rollout; the vLLM engine resets its prefix cache). In-flight updates
(``pipeline.inflight_updates``) load weights *inside* a rollout, where the HF engine's fast
decoder holds fused copies of q/k/v and gate/up and a KV cache: after a load it re-gathers the
copies, checks them against the live parameters (``same_elements``; a stale copy turns the
version's fingerprint into ``stale_fingerprint``, which matches nothing, so the check below fails
loudly), and by default recomputes the prefix's KV cache (``HFEngine(inflight_kv=...)``).

The canonical weights are what the learner publishes (``asyncrl.coordinator.publishable_state``):
the full state dict, or with ``train.lora`` the adapter tensors only (``asyncrl.lora``). An engine
whose weights are another dtype (``engine_options.dtype=bfloat16``) fingerprints the same
elements in its dtype; the learner accepts its elements rounded to bfloat16 / float16 too
(rounding is elementwise and deterministic, so the hash is still bit-exact).

**Check** (``ProvenanceCheck``, every learner rank, Ray-free): the learner keeps the sampled
elements of the versions a block may still carry, and checks every consumed block's
``weights_fingerprint`` column (per sample: the fingerprint of each version its tokens came from,
combined in version order, ``combine``) against them. ``pipeline.provenance``: ``strict`` (the
default) raises ``ProvenanceError`` naming the engine, the version it claimed and the version
whose weights it actually held (or "none published"); ``warn`` prints that and counts it in
``provenance/mismatches``; ``off`` checks nothing.
"""

from __future__ import annotations

import hashlib
import sys
import zlib
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import torch

#: elements sampled per tensor (all of a smaller tensor)
SAMPLE_PER_TENSOR = 256
#: ``weights_fingerprint`` of an engine that computes none
NO_FINGERPRINT = 0
#: what a block carries from an engine that keeps no ``fingerprints`` at all (a user engine written
#: before provenance): its samples cannot be checked, so they are counted ``provenance/unchecked``
#: (with one warning per engine) instead of failing the run; an engine that keeps fingerprints but
#: none for a version it stamped is a mismatch
NOT_REPORTED = -1
#: dtypes an engine may hold the learner's fp32 weights in (rounded elementwise)
ENGINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: metric keys (per learner step, rank 0's blocks): samples checked, too old to check, mismatched
CHECKED = "provenance/checked"
UNCHECKED = "provenance/unchecked"
MISMATCHES = "provenance/mismatches"

Mode = Literal["strict", "warn", "off"]
MODES = ("strict", "warn", "off")


class ProvenanceError(RuntimeError):
    """A rollout block was generated with weights other than those the learner published at the
    version it claims; the message names the engine and both versions."""


@lru_cache(maxsize=4096)
def _indices(key: str, n: int, k: int) -> torch.Tensor:
    """The ``min(n, k)`` flat indices sampled from tensor ``key`` of ``n`` elements (deterministic)."""
    if n <= k:
        return torch.arange(n)
    gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) << 24) ^ n)
    return torch.randint(n, (k,), generator=gen)


def canonical_key(key: str) -> str:
    """``key`` without a DDP ``module.`` prefix (engines strip it when they load)."""
    return key[7:] if key.startswith("module.") else key


def sample_weights(state: Mapping[str, torch.Tensor], k: int = SAMPLE_PER_TENSOR) -> dict[str, torch.Tensor]:
    """The sampled elements of every floating tensor of ``state``: ``{key: [min(n, k)] CPU copy}``.

    Tied keys (one tensor under two names) are sampled under each name: both sides of a check see
    the same ties. Non-floating tensors (integer buffers) are left out."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if not t.is_floating_point():
            continue
        flat = t.detach().reshape(-1)
        idx = _indices(canonical_key(key), flat.numel(), k).to(flat.device)
        out[canonical_key(key)] = flat[idx].to("cpu", copy=True)
    return out


def fingerprint(samples: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    """Signed 64-bit hash of sampled elements (``sample_weights``), bit-exact, never 0.

    ``dtype``: hash the elements rounded to it (an engine holding the weights in bfloat16)."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(samples):
        v = samples[key]
        if dtype is not None and v.dtype != dtype:
            v = v.to(dtype)
        h.update(key.encode())
        h.update(str(v.dtype).encode())
        h.update(v.contiguous().view(_INT_VIEW[v.element_size()]).numpy().tobytes())
    value = int.from_bytes(h.digest(), "little", signed=True)
    return value if value not in (NO_FINGERPRINT, NOT_REPORTED) else 1


def weights_fingerprint(state: Mapping[str, torch.Tensor]) -> int:
    """The fingerprint of weights as they are held (each engine calls it after a load): sampled
    from ``state`` and hashed in the dtype of its first floating tensor."""
    samples = sample_weights(state)
    dtype = next((v.dtype for v in samples.values()), None)
    return fingerprint(samples, dtype)


def same_elements(live: torch.Tensor, held: torch.Tensor, k: int = 64) -> bool:
    """Whether a copy ``held`` derived from the weight ``live`` (a fused decoder copy) still holds
    its elements, bit-exactly, at ``k`` sampled indices (all of a smaller tensor): how an engine
    proves that state derived from its weights was rebuilt after a load."""
    a, b = live.detach().reshape(-1), held.detach().reshape(-1)
    if a.shape != b.shape:
        return False
    idx = _indices(f"derived/{a.numel()}", a.numel(), k).to(a.device)
    return bool(torch.equal(a[idx].to(b.dtype), b[idx]))


def stale_fingerprint(fp: int, n_stale: int) -> int:
    """The fingerprint an engine reports for a version whose derived state (``same_elements``)
    outlived the load: ``fp`` mixed with a marker, so it matches no published version and the
    learner's check refuses the samples loudly instead of training on what the copies held."""
    h = hashlib.blake2b(np.asarray([fp, n_stale, 0x57A1E], dtype=np.int64).tobytes(), digest_size=8)
    value = int.from_bytes(h.digest(), "little", signed=True)
    return value if value not in (NO_FINGERPRINT, NOT_REPORTED) else 1


def combine(fingerprints: Iterable[int]) -> int:
    """One sample's fingerprint from those of the versions its tokens came from, in version order
    (one version: its fingerprint unchanged)."""
    fps = [int(f) for f in fingerprints]
    if len(fps) == 1:
        return fps[0]
    if any(f == NO_FINGERPRINT for f in fps):
        return NO_FINGERPRINT
    h = hashlib.blake2b(np.asarray(fps, dtype=np.int64).tobytes(), digest_size=8)
    value = int.from_bytes(h.digest(), "little", signed=True)
    return value if value not in (NO_FINGERPRINT, NOT_REPORTED) else 1


def row_versions(
    token_versions: np.ndarray, mask: np.ndarray, version_first: np.ndarray
) -> list[tuple[int, ...]]:
    """Per sample, the sorted versions its valid tokens came from (``version_first`` for a sample
    with no valid token)."""
    out = []
    for tv, m, vf in zip(token_versions, mask, version_first):
        vs = np.unique(tv[m.astype(bool)])
        out.append(tuple(int(v) for v in vs) if len(vs) else (int(vf),))
    return out


class ProvenanceCheck:
    """The learner's side: the sampled elements of each version it published, and the check of
    every consumed block against them (see the module docstring).

    ``keep``: how many versions back a block may still come from (older ones are forgotten; a
    sample of a forgotten version is counted in ``provenance/unchecked``, never passed as checked).
    """

    def __init__(self, mode: Mode = "strict", keep: int = 8) -> None:
        if mode not in MODES:
            raise ValueError(f"pipeline.provenance={mode!r}: use one of {MODES}")
        self.mode = mode
        self.keep = max(int(keep), 1)
        self._samples: dict[int, dict[str, torch.Tensor]] = {}
        self._hashes: dict[tuple[int, torch.dtype], int] = {}
        self._warned: set[str] = set()  # engines already named for keeping no fingerprints

    def record(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """The learner's weights at ``version`` (what it publishes, or its model's own tensors)."""
        if self.mode == "off":
            return
        self._samples[int(version)] = sample_weights(state)
        for old in [v for v in self._samples if v < version - self.keep]:
            del self._samples[old]
        self._hashes = {key: h for key, h in self._hashes.items() if key[0] in self._samples}

    def expected(self, version: int, dtype: torch.dtype = torch.float32) -> int | None:
        """The fingerprint of the learner's ``version`` in ``dtype``; None if not kept."""
        if version not in self._samples:
            return None
        key = (version, dtype)
        if key not in self._hashes:
            self._hashes[key] = fingerprint(self._samples[version], dtype)
        return self._hashes[key]

    def _matches(self, versions: tuple[int, ...], reported: int) -> bool | None:
        """Whether ``reported`` is the combined fingerprint of ``versions`` in some engine dtype;
        None when a version is no longer kept (or never was, below the oldest kept)."""
        for dtype in ENGINE_DTYPES:
            fps = [self.expected(v, dtype) for v in versions]
            if any(f is None for f in fps):
                return None
            if combine(fps) == reported:  # type: ignore[arg-type]
                return True
        return False

    def _held(self, reported: int) -> int | None:
        """The kept version whose weights have fingerprint ``reported`` (a single-version sample)."""
        for v in sorted(self._samples, reverse=True):
            if any(self.expected(v, d) == reported for d in ENGINE_DTYPES):
                return v
        return None

    def check(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """Check a consumed rollout block (numpy columns); returns ``provenance/*`` metrics.

        Raises ``ProvenanceError`` (strict) at the first mismatching sample group."""
        from asyncrl import records as R

        if self.mode == "off" or len(batch[R.SAMPLE_ID]) == 0:
            return {}
        reported = np.asarray(batch[R.WEIGHTS_FINGERPRINT]).astype(np.int64)
        versions = row_versions(
            np.asarray(batch[R.TOKEN_VERSIONS]),
            np.asarray(batch[R.COMPLETION_MASK]),
            np.asarray(batch[R.VERSION_FIRST]),
        )
        engines = batch.get(R.GEN_ENGINE)
        groups: dict[tuple[tuple[int, ...], int, str], int] = {}
        for i, (vs, fp) in enumerate(zip(versions, reported)):
            engine = str(engines[i]) if engines is not None else "?"
            key = (vs, int(fp), engine)
            groups[key] = groups.get(key, 0) + 1
        checked = unchecked = mismatched = 0
        oldest = min(self._samples) if self._samples else None
        for (vs, fp, engine), n in groups.items():
            if fp == NOT_REPORTED:
                unchecked += n
                if engine not in self._warned:
                    self._warned.add(engine)
                    print(
                        f"asyncrl: WARNING engine {engine} keeps no weight fingerprints: provenance is not "
                        f"checked for its samples (give it a `fingerprints` mapping, see "
                        f"asyncrl.engines.RolloutEngine)",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            if fp == NO_FINGERPRINT:
                ok: bool | None = False
            else:
                ok = self._matches(vs, fp)
            if ok is None and oldest is not None and max(vs) < oldest:
                unchecked += n  # older than any kept version (its lag exceeds what can be trained)
                continue
            if ok:
                checked += n
                continue
            mismatched += n
            message = self._message(vs, fp, engine, n, batch)
            if self.mode == "strict":
                raise ProvenanceError(message)
            print(f"asyncrl: WARNING {message}", file=sys.stderr, flush=True)
        return {CHECKED: float(checked), UNCHECKED: float(unchecked), MISMATCHES: float(mismatched)}

    def _message(self, vs: tuple[int, ...], fp: int, engine: str, n: int, batch: Mapping[str, Any]) -> str:
        from asyncrl import records as R

        blocks = sorted({int(b) for b in np.asarray(batch.get(R.BLOCK_INDEX, [-1]))})
        claimed = f"v{vs[0]}" if len(vs) == 1 else "versions " + ", ".join(f"v{v}" for v in vs)
        kept = f"v{min(self._samples)}..v{max(self._samples)}" if self._samples else "none"
        newest = max(self._samples) if self._samples else -1
        if fp == NO_FINGERPRINT:
            held = (
                "unknown: the engine reports no fingerprint (give it a `fingerprints` mapping, see "
                "asyncrl.engines.RolloutEngine, or set pipeline.provenance=off)"
            )
        elif len(vs) == 1 and vs[0] > newest:
            held = f"of a version the learner never published (its newest is v{newest})"
        else:
            u = self._held(fp) if len(vs) == 1 else None
            held = (
                f"the weights of v{u}"
                if u is not None
                else f"weights matching no version the learner published (kept {kept}): a partial, "
                f"corrupted or foreign load"
            )
        return (
            f"provenance mismatch (pipeline.provenance={self.mode}): engine {engine} generated {n} "
            f"sample(s) of block(s) {blocks} stamped {claimed}, but the weights it sampled with "
            f"(fingerprint {fp:#018x}) are {held}. The weight update did not reach that engine as "
            f"published; training on these samples would train on stale or wrong weights"
        )


__all__ = [
    "MODES",
    "NOT_REPORTED",
    "NO_FINGERPRINT",
    "ProvenanceCheck",
    "ProvenanceError",
    "combine",
    "fingerprint",
    "row_versions",
    "same_elements",
    "sample_weights",
    "stale_fingerprint",
    "weights_fingerprint",
]
