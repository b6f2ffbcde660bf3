"""``HFEngine``: batched KV-cache sampling with any ``transformers`` causal LM (the CPU default).

Why not ``model.generate``: the staleness math needs, for every generated token, the
log-probability under the *exact* sampling distribution ``pi_b = softmax(z / tau)``
(untruncated, no top-k/top-p), the policy version that produced it, and optionally ``m``
extra draws per position from that same distribution. This loop produces all of them in
one pass and is at least as fast as ``generate`` at toy scale (``benchmarks/engine_throughput.py``).

Conventions (shared with ``asyncrl.records``): prompts are left-padded; positions are
``cumsum(mask) - 1`` (``records.position_ids``), so ``behavior_logprobs`` equal a
teacher-forced forward pass over prompt+completion (``records.completion_logits``) up to
float error. A row stops at its first EOS (which is kept and masked valid), or after its
token budget with ``sampling.heavy_tail`` (``SamplingParams.token_budgets``); later slots
hold the pad id and are masked out. The loop ends as soon as every row has finished.

Per step ``t`` with logits ``z_t`` [B, V]:
    log pi_b(. | prefix) = log_softmax(z_t / tau)                       (tau > 0)
    y_t ~ pi_b, and for m > 0: mc_ids[:, t] = m i.i.d. draws (with replacement), column 0 = y_t
    tau = 0: greedy, y_t = argmax z_t; pi_b is a point mass, so its log-probabilities are 0.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from asyncrl import records
from asyncrl.engines.base import (
    SamplingParams,
    WeightsPoll,
    check_prompts,
    check_version,
    checkpoint_dir,
    pack_rollout,
)
from asyncrl.engines.llama_decode import LlamaDecoder, config_unsupported_reason, unsupported_reason
from asyncrl.lora import (
    ADAPTER,
    LoRAConfig,
    apply_lora,
    is_lora,
    load_adapter_state,
    lora_modules,
    policy_state,
)
from asyncrl.provenance import same_elements, stale_fingerprint, weights_fingerprint
from asyncrl.tied import drop_tied_duplicates, tied_aliases

#: ``HFEngine(decode=...)`` / ``pipeline.engine_options.decode``
DECODE_CHOICES = ("auto", "fast", "hf")
#: ``HFEngine(inflight_kv=...)`` / ``pipeline.engine_options.inflight_kv``
INFLIGHT_KV_CHOICES = ("recompute", "keep")


class HFEngine:
    """Rollout engine over a ``PreTrainedModel`` (``RolloutEngine`` protocol).

    Args:
        model: a causal LM taking ``input_ids, attention_mask, position_ids`` and a KV cache;
            it is put in eval mode (no dropout: the sampling distribution must be exact).
        tokenizer_or_ids: a tokenizer (its ``pad_token_id`` / ``eos_token_id`` are used), or a
            mapping ``{"pad_id": int, "eos_id": int | list[int]}``.
        version: policy version of the current weights (stamped on every generated token).
        decode: the per-token forward. ``"auto"`` (default): ``LlamaDecoder`` (the same Llama
            arithmetic without ``transformers``' per-call overhead, 1.4-1.9x faster per rollout
            in BENCHMARKS.md; ``engines/llama_decode.py``) when the model is a Llama or Qwen3 it
            supports, else the model's own forward; ``"fast"``: ``LlamaDecoder`` or a
            ``ValueError`` naming why not; ``"hf"``: always the model's own forward.
            ``decode_path`` says which one runs.
        lora: a LoRA student (``train.lora``, ``asyncrl.lora.LoRAConfig`` or its options): ``model`` is
            the base; peft's adapters are added to it and ``load_weights`` takes adapter tensors only.
            A peft ``model`` (a LoRA learner's own, ``pipeline.colocate``) needs none.
        lora_merge: apply each adapter version merged into the base weights (default; the fast decode
            path runs, and every load rebuilds the merged weights from a kept copy of the base, so
            nothing of an older version survives) or unmerged (peft's adapter forward, ``decode="hf"``).
        inflight_kv: what happens to the KV cache of the already generated prefix when newer
            weights arrive mid-rollout (``generate(poll_weights=...)``, ``pipeline.inflight_updates``):
            ``"recompute"`` (default) rebuilds it with the new weights in one prefill of prompt +
            prefix, so every later token is sampled from exactly the version it is stamped with
            (pi_v(. | prefix)) and nothing derived from older weights survives a load; ``"keep"``
            (PipelineRL / AReaL) continues on the old K/V, so a later token's distribution mixes the
            prefix's versions (its behavior log-prob is still the exact sampling probability, so
            importance ratios stay exact). Measured (``benchmarks/inflight.py``, tiny pair, max_lag 2,
            2 generators, BENCHMARKS.md "In-flight updates"): with keep, the samples spanning versions
            had KL(behavior || current) 0.041 per token against 0.027 for the whole batch without
            in-flight updates; the recompute run saw too few spanning samples (1 of 256) to compare on
            this toy, and both runs' batch KL is within timing noise of each other. Per token, keep's
            post-switch log-probs differ from the new version's by up to 4e-2 nats on a 2-layer
            model (unit test), recompute's by < 1e-5. A recompute costs one prefill per switch.
            Recompute is the default: the version stamp and the provenance fingerprint stay exact
            (no state derived from older weights survives a load); keep trades that for no prefill.
        compact: finished rows leave the decode batch (default): when a row ends (EOS, the token
            limit, its ``heavy_tail`` budget), the decoder's per-row state (K/V buffers, key mask,
            positions, prompt) is index-selected down to the live rows, so a step costs c(live rows)
            instead of c(B). With heavy-tailed lengths most of a static batch's steps carry finished
            rows (``benchmarks/batching_headroom.py`` measures c(r) and replays the schedules).
            The uniforms are drawn for all B rows every step, as without compaction, and each live
            row takes its own, so a draw is the same unless float rounding moves a CDF boundary past
            its uniform: a row's logits come from a smaller matmul and differ by rounding, which can
            flip a draw whose uniform sits that close to a boundary, typically between two tail
            tokens (the row then continues differently; CHANGELOG has what was seen on the real
            student). Either way each token is an exact draw from the logits that produced
            it, and a run is deterministic given its seed and this option. The transformers path
            compacts its ``DynamicCache`` with ``batch_select_indices``.
        step_latency_s: a study tool (default 0: off): every decode step takes at least this long,
            the rest of it spent sleeping. On an accelerator a small model's decode step is bound
            by reading the weights, so its cost barely grows with the live rows and it uses no
            host CPU; on a small CPU machine every stage shares the same cores, so a faster
            generator gives its core to the others instead of delivering sooner. A step floor
            emulates the accelerator's regime (a flat step cost that sleeps, like
            ``asyncrl.engines.paced.PacedEngine`` for whole calls) so that what the pipeline's
            scheduling buys (compaction, ``pipeline.continuous_batching``) can be measured on
            one machine. The tokens, log-probabilities and versions are unchanged: only time is
            emulated. Prefill is not paced.

    In-flight switch: between decode steps ``generate`` asks ``poll_weights`` (every
    ``poll_every`` steps); on newer weights it loads them (``load_weights``: the fingerprint is
    taken afresh), re-gathers the fast decoder's fused weight copies (``LlamaDecoder.reload``),
    checks that the copies equal the live parameters (a decoder that kept stale copies gets a
    fingerprint matching no version, which the learner's provenance check refuses loudly), then
    recomputes or keeps the prefix's K/V (``inflight_kv``) and stamps later tokens with the new
    version. Finished rows are unaffected (their later slots are padding).

    ``fingerprints``: version -> fingerprint of the weights this engine held at that version
    (``asyncrl.provenance``), computed from its own model after every load.
    """

    name = "hf"
    supports_mc = True
    #: several rollouts step together (``asyncrl.engines.continuous``) on the fast decode path
    supports_continuous_batching = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_or_ids: Any,
        *,
        version: int = 0,
        decode: Literal["auto", "fast", "hf"] = "auto",
        lora: LoRAConfig | Mapping[str, Any] | None = None,
        lora_merge: bool = True,
        inflight_kv: Literal["recompute", "keep"] = "recompute",
        compact: bool = True,
        step_latency_s: float = 0.0,
    ) -> None:
        number = isinstance(step_latency_s, int | float) and not isinstance(step_latency_s, bool)
        if not number or step_latency_s < 0:
            raise ValueError(f"HFEngine step_latency_s={step_latency_s!r}: use seconds >= 0 (0: off)")
        #: every decode step lasts at least this long (class docstring; 0: off)
        self.step_latency_s = float(step_latency_s)
        if not isinstance(compact, bool):
            raise ValueError(f"HFEngine compact={compact!r}: use true or false")
        #: finished rows leave the decode batch (class docstring)
        self.compact = compact
        if inflight_kv not in INFLIGHT_KV_CHOICES:
            raise ValueError(f"HFEngine inflight_kv={inflight_kv!r}: use 'recompute' or 'keep'")
        self.inflight_kv = inflight_kv
        if decode not in DECODE_CHOICES:
            raise ValueError(f"HFEngine decode={decode!r}: use 'auto', 'fast' or 'hf'")
        if lora is not None and is_lora(model):
            raise ValueError("HFEngine(lora=...) adds adapters to a base model; this model has them already")
        if lora is not None:
            model = apply_lora(model, lora, seed=0)  # A's init is never used: every load replaces it
        self.model = model.eval()
        #: a LoRA engine's adapters merged into its weights; the base weights kept to rebuild them
        self.lora_merged = bool(lora_merge) and lora is not None
        self._base: dict[str, torch.Tensor] = {}
        decode_model = model
        if self.lora_merged:
            with torch.no_grad():
                self._base = {n: m.get_base_layer().weight.detach().clone() for n, m in lora_modules(model)}
            self._merge()
        if is_lora(model):  # merged layers read as plain Linear weights; unmerged ones are refused
            decode_model = model.get_base_model()
        self._decode_model = decode_model
        why_not = unsupported_reason(decode_model) if decode != "hf" else "decode='hf' was asked for"
        if decode == "fast" and why_not is not None:
            raise ValueError(
                f"HFEngine decode='fast' cannot run this model: {why_not}; use decode='auto' or 'hf'"
            )
        #: "fast" (LlamaDecoder) or "hf" (the model's own forward), and why not fast
        self.decode_path: str = "fast" if why_not is None else "hf"
        self.decode_reason: str | None = why_not
        self.tokenizer: Any | None
        if isinstance(tokenizer_or_ids, Mapping):
            self.tokenizer = None
            pad_id, eos = tokenizer_or_ids.get("pad_id"), tokenizer_or_ids.get("eos_id")
        else:
            self.tokenizer = tokenizer_or_ids
            pad_id, eos = tokenizer_or_ids.pad_token_id, tokenizer_or_ids.eos_token_id
        config = getattr(model, "config", None)
        if eos is None and config is not None:
            eos = getattr(config, "eos_token_id", None)
        if eos is None:
            raise ValueError("HFEngine needs an EOS id: give a tokenizer with eos_token or {'eos_id': ...}")
        self.eos_ids: tuple[int, ...] = tuple(
            int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])
        )
        self.eos_id: int = self.eos_ids[0]
        self.pad_id: int = int(pad_id) if pad_id is not None else self.eos_id
        self._version = check_version(version)
        # a peft model passes the base model's keyword arguments through: read those
        params = inspect.signature((model.get_base_model() if is_lora(model) else model).forward).parameters
        # transformers >= 5.2x renamed the KV-cache kwarg ``past_key_values`` -> ``cache``
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_logits = "logits_to_keep" in params
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        self.fingerprints: dict[int, int] = {}
        self._fingerprint()

    # --- construction seam ---------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        version: int = 0,
        torch_threads: int | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        attn_implementation: str | None = None,
        decode: Literal["auto", "fast", "hf"] = "auto",
        lora: LoRAConfig | Mapping[str, Any] | None = None,
        lora_merge: bool = True,
        inflight_kv: Literal["recompute", "keep"] = "recompute",
        compact: bool = True,
        step_latency_s: float = 0.0,
    ) -> HFEngine:
        """Load model + tokenizer from an HF checkpoint directory on local disk (no hub access).
        With ``lora`` the checkpoint is the base and the engine loads adapter versions (``HFEngine``).

        ``torch_threads`` sets ``torch.set_num_threads`` (one engine per Ray actor). The tokenizer
        is the process's shared read-only one (``shared_tokenizer``: the engine only reads its
        pad/EOS ids and decodes); give a private ``load_tokenizer`` copy to ``HFEngine(...)`` to
        change it.
        """
        from transformers import AutoModelForCausalLM

        from asyncrl.workloads.checkpoints import shared_tokenizer

        p = checkpoint_dir(path)
        if torch_threads is not None:
            torch.set_num_threads(int(torch_threads))
        torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
        kw: dict[str, Any] = {"local_files_only": True, "dtype": torch_dtype}
        if attn_implementation is not None:
            kw["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(p), **kw).to(device)
        try:
            tokenizer = shared_tokenizer(p)
        except (OSError, ValueError) as err:
            raise FileNotFoundError(
                f"{str(p)!r} has no loadable tokenizer ({err}); save one with tokenizer.save_pretrained(dir)"
            ) from err
        return cls(
            model,
            tokenizer,
            version=version,
            decode=decode,
            lora=lora,
            lora_merge=lora_merge,
            inflight_kv=inflight_kv,
            compact=compact,
            step_latency_s=step_latency_s,
        )

    @classmethod
    def check_supported(cls, path: str | Path | None, params: SamplingParams, **options: Any) -> None:
        """HFEngine serves every ``SamplingParams`` (exact MC draws included) for any causal LM
        checkpoint; the directory and the ``decode`` option are checked here, in the driver
        (``RolloutEngine.check_supported``): ``decode="fast"`` on a checkpoint whose config the fast
        path cannot run fails now, naming why, instead of in every generator actor."""
        decode = options.get("decode", "auto")
        if decode not in DECODE_CHOICES:
            raise ValueError(f"pipeline.engine_options.decode={decode!r}: use 'auto', 'fast' or 'hf'")
        if not isinstance(options.get("compact", True), bool):
            raise ValueError(
                f"pipeline.engine_options.compact={options['compact']!r}: use true (finished rows leave "
                f"the decode batch) or false"
            )
        kv = options.get("inflight_kv", "recompute")
        if kv not in INFLIGHT_KV_CHOICES:
            raise ValueError(f"pipeline.engine_options.inflight_kv={kv!r}: use 'recompute' or 'keep'")
        if options.get("lora") is not None and decode == "fast" and not options.get("lora_merge", True):
            raise ValueError(
                "pipeline.engine_options.decode='fast' runs merged weights only, and lora_merge=false "
                "keeps the LoRA adapters unmerged: set lora_merge=true or decode='auto'"
            )
        continuous = bool(options.get("continuous_batching"))
        if continuous and decode == "hf":
            raise ValueError(
                "pipeline.continuous_batching steps the rollouts of several blocks together on the fast "
                "decode path, and pipeline.engine_options.decode='hf' turns it off: use decode='auto' or "
                "'fast', or continuous_batching=false"
            )
        if continuous and options.get("lora") is not None and not options.get("lora_merge", True):
            raise ValueError(
                "pipeline.continuous_batching runs merged weights only (the fast decode path), and "
                "lora_merge=false keeps the LoRA adapters unmerged: set lora_merge=true or "
                "continuous_batching=false"
            )
        if path is None:
            return
        p = checkpoint_dir(path)
        if decode == "fast" or continuous:
            from transformers import AutoConfig

            why_not = config_unsupported_reason(AutoConfig.from_pretrained(str(p), local_files_only=True))
            if why_not is not None and continuous:
                raise ValueError(
                    f"pipeline.continuous_batching needs HFEngine's fast decode path, which cannot run "
                    f"{str(p)!r}: {why_not}; set continuous_batching=false"
                )
            if why_not is not None:
                raise ValueError(
                    f"pipeline.engine_options.decode='fast' cannot run {str(p)!r}: {why_not}; "
                    f"use decode='auto' (transformers' forward where the fast path cannot run) or 'hf'"
                )

    # --- versioned weights ---------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model (a DDP ``module.`` prefix is stripped) and set ``version``.

        Keys must match the model's; only tied weights (e.g. ``lm_head.weight`` tied to the
        embedding) may be absent. A key tied in ``state_dict`` as in the model is written once.
        """
        version = check_version(version)
        sd = {(k[7:] if k.startswith("module.") else k): v for k, v in state_dict.items()}
        if is_lora(self.model):  # adapter tensors only (asyncrl.lora)
            load_adapter_state(self.model, sd)
            if self.lora_merged:
                self._merge()
            self._version = version
            self._fingerprint()
            return
        result = self.model.load_state_dict(drop_tied_duplicates(sd, self.model), strict=False)
        tied = tied_aliases(self.model.state_dict(keep_vars=True))
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"load_weights: state_dict does not match the engine's model: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}; "
                f"send model.state_dict() of the same architecture"
            )
        self._version = version
        self._fingerprint()

    def weights_updated(self, version: int) -> None:
        """The model's weights were changed in place (a learner stepped the module this engine
        samples from, ``pipeline.colocate``): stamp later tokens with ``version``."""
        self._version = check_version(version)
        self._fingerprint()

    def _fingerprint(self) -> None:
        """Fingerprint the weights now held (``asyncrl.provenance``), under the current version; a
        few recent versions are kept (a rollout may span versions with in-flight updates)."""
        self.fingerprints[self._version] = weights_fingerprint(policy_state(self.model))
        for old in sorted(self.fingerprints)[:-8]:
            del self.fingerprints[old]

    @torch.no_grad()
    def _merge(self) -> None:
        """Rebuild every LoRA layer's weight as base + its adapter's update (peft's ``merge``), from
        the kept base copy, so no earlier version's update is left in the weights."""
        for name, layer in lora_modules(self.model):
            layer.get_base_layer().weight.copy_(self._base[name])
            layer.merged_adapters.clear()
            layer.merge(adapter_names=[ADAPTER])

    # --- generation ----------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
        poll_weights: WeightsPoll | None = None,
        poll_every: int = 1,
    ) -> dict[str, torch.Tensor]:
        """Sample completions for left-padded prompts ``[B, P]``; see the module docstring.

        Returns ``completion_ids`` [B, T] int64, ``completion_mask`` [B, T] bool,
        ``behavior_logprobs`` [B, T] float32, ``token_versions`` [B, T] int32 and, for
        ``m = params.mc_samples > 0``, ``mc_ids`` [B, T, m] int64 and ``mc_behavior_logprobs``
        [B, T, m] float32, where ``T <= params.max_new_tokens`` is the longest completion.
        Without ``poll_weights`` one call uses one set of weights, so ``token_versions`` is
        ``self.version`` everywhere (padding included). With it (in-flight updates, class
        docstring) the callback is asked after every ``poll_every``-th token, and each token carries
        the version whose weights computed its distribution; a padded slot carries the version of
        the step that padded it. Padded positions hold the pad id and log-probability 0. The draws
        do not depend on when a switch happens except through the logits (one generator stream).
        """
        if poll_weights is not None and poll_every < 1:
            raise ValueError(f"poll_every must be >= 1 decode steps, got {poll_every}")
        ro = self.start_rollout(
            prompt_ids, prompt_mask, params, seed=seed, track_versions=poll_weights is not None
        )
        while not ro.draw():
            due = poll_weights is not None and (ro.t + 1) % poll_every == 0
            if due and self._poll(poll_weights, [ro.dec]) and ro.switched(self._version, self.inflight_kv):
                continue  # the recompute's logits predict the next token
            started = time.perf_counter()
            ro.logits = ro.dec.step(ro.tokens, ro.t)
            self.pace(started)
        return ro.result()

    def pace(self, started: float) -> None:
        """Sleep out the rest of ``step_latency_s`` after a decode step begun at ``started``
        (``time.perf_counter``); nothing when it is 0."""
        if self.step_latency_s > 0:
            left = self.step_latency_s - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)

    def start_rollout(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        seed: int,
        track_versions: bool,
    ) -> _Rollout:
        """Prefill left-padded prompts [B, P] and return the rollout's decode state (``_Rollout``):
        ``generate`` drives one; ``asyncrl.engines.continuous.ContinuousBatcher`` steps several
        together. ``track_versions``: keep a [B, T] version per token (weights may change mid-rollout)."""
        device = _device_of(self.model)
        limit = ("the model's max_position_embeddings", self.max_positions)
        prompt_ids, prompt_mask = check_prompts(prompt_ids, prompt_mask, params, self.vocab_size, limit)
        dec = LlamaDecoder(self._decode_model) if self.decode_path == "fast" else _ModelDecoder(self)
        return _Rollout(
            self, dec, prompt_ids.to(device), prompt_mask.to(device), params, seed, track_versions
        )

    def _poll(self, poll_weights: WeightsPoll, decoders: list[Any]) -> bool:
        """Ask for newer weights mid-rollout and switch to them (class docstring); True if the
        version changed."""
        before = self._version
        got = poll_weights()
        if got is not None:
            version, state = got
            self.load_weights(state, version)
        if self._version == before:
            return False
        self.refresh_decoders(decoders)
        return True

    def refresh_decoders(self, decoders: list[Any]) -> None:
        """After a load mid-rollout: fast decoders re-gather their fused copies (the first one; the
        others read through it, ``LlamaDecoder.adopt_weights``) and are checked against the live
        parameters: if a copy is stale, the version's fingerprint is made to match no published
        weights, so the learner's provenance check fails naming this engine."""
        fast = [d for d in decoders if isinstance(d, LlamaDecoder)]
        if not fast:
            return
        shared = fast[0]._layers
        self._reload_decoder(fast[0])
        for d in fast[1:]:
            if d._layers is shared:
                d.adopt_weights(fast[0])
            else:
                self._reload_decoder(d)
        stale = sum(not same_elements(live, held) for d in fast for live, held in d.held_weights())
        if stale:
            v = self._version
            self.fingerprints[v] = stale_fingerprint(self.fingerprints[v], stale)

    def _reload_decoder(self, dec: LlamaDecoder) -> None:
        """Re-gather the fast decoder's copies of the weights just loaded (a seam for tests that
        inject an engine keeping stale derived state)."""
        dec.reload()


class _Rollout:
    """One ``generate`` call's decode state, advanced one token at a time (``draw``), so that one
    rollout (``HFEngine.generate``) or several stepped together (``ContinuousBatcher``) run the
    same code. After ``draw`` returns False, the caller computes the next ``logits`` from
    ``tokens`` at step ``t`` (``dec.step`` or ``step_together``), or calls ``switched``.

    The uniforms are drawn for all B rows every step (one generator stream per rollout, seeded
    by ``seed``), so a rollout's draws do not depend on which other rollouts share its steps,
    only on its logits."""

    def __init__(
        self,
        engine: HFEngine,
        dec: Any,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seed: int,
        track_versions: bool,
    ) -> None:
        device = prompt_ids.device
        B = prompt_ids.shape[0]
        self.N, self.m = params.max_new_tokens, params.mc_samples
        self.k = max(self.m, 1)  # draws per position; column 0 is the generated token
        self.temperature = params.temperature
        self.pad_id = engine.pad_id
        self.eos = torch.tensor(engine.eos_ids, device=device)
        self.gen = torch.Generator(device=device).manual_seed(int(seed))
        self.mask = torch.zeros((B, self.N), dtype=torch.bool, device=device)
        self.draws_out = torch.full((B, self.N, self.k), self.pad_id, dtype=torch.int64, device=device)
        self.logp_out = torch.zeros((B, self.N, self.k), dtype=torch.float32, device=device)
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        budgets = params.token_budgets(B, seed)  # heavy_tail: per-row stop after L_i tokens
        self.budget = None if budgets is None else torch.as_tensor(budgets, device=device)
        self.version = engine.version
        # token t's version: the weights that computed the logits it was drawn from
        self.versions = (
            torch.full((B, self.N), engine.version, dtype=torch.int32, device=device)
            if track_versions
            else None
        )
        self.rows = torch.arange(B, device=device)  # the batch row of each of the decoder's rows
        self.dec = dec
        self.logits = dec.start(prompt_ids, prompt_mask, records.position_ids(prompt_mask), self.N)
        self.compact = engine.compact and dec.can_select  # (the transformers cache exists after start)
        self.t = -1  # the last token drawn
        self.tokens = torch.empty(0, dtype=torch.int64, device=device)  # live rows' token t

    def draw(self) -> bool:
        """Draw token ``t + 1`` from ``logits`` for the live rows; True when the rollout is done."""
        self.t = t = self.t + 1
        B, rows = self.mask.shape[0], self.rows
        u = _uniforms(self.gen, B, self.k, self.temperature, self.mask.device)  # all B rows: one stream
        draws, logp = _draw(self.logits, self.temperature, self.k, None if u is None else u[rows])  # [r, k]
        live = ~self.finished[rows]
        draws = torch.where(live[:, None], draws, self.pad_id)
        self.draws_out[rows, t] = draws
        self.logp_out[rows, t] = torch.where(live[:, None], logp, 0.0)
        self.mask[rows, t] = live
        ended = torch.isin(draws[:, 0], self.eos)
        if self.budget is not None:
            ended = ended | (self.budget[rows] <= t + 1)
        self.finished[rows] = self.finished[rows] | ended
        if t == self.N - 1 or bool(self.finished.all()):
            return True
        if self.compact and bool(ended.any()):  # finished rows leave the decode batch
            keep = ~ended
            self.dec.select(keep)
            self.rows, draws = rows[keep], draws[keep]
        self.tokens = draws[:, 0]
        return False

    def switched(self, version: int, kv: str) -> bool:
        """The engine now holds ``version`` (loaded after token ``t``): later tokens carry it. With
        ``kv == "recompute"`` the prefix's K/V is rebuilt with the new weights and ``logits`` set
        from it (returns True: no step to take); ``"keep"`` continues on the old K/V (False)."""
        if self.versions is None:
            raise RuntimeError("a rollout started with track_versions=False cannot switch weights")
        self.version = version
        self.versions[:, self.t + 1 :] = version
        if kv == "recompute":  # K/V of prompt + tokens 0..t with the new weights
            self.logits = self.dec.recompute(self.draws_out[self.rows, : self.t + 1, 0])
            return True
        return False

    def result(self) -> dict[str, torch.Tensor]:
        """The ``RolloutEngine.generate`` columns (``pack_rollout``), trimmed to the longest row."""
        T = self.t + 1
        version: int | torch.Tensor = self.version if self.versions is None else self.versions[:, :T]
        return pack_rollout(
            self.draws_out[:, :T], self.logp_out[:, :T], self.mask[:, :T], version=version, mc_samples=self.m
        )


class _ModelDecoder:
    """``LlamaDecoder``'s ``start`` / ``step`` over the model's own forward and a ``DynamicCache``:
    the path for any causal LM (``decode_path == "hf"``)."""

    def __init__(self, engine: HFEngine) -> None:
        self.model = engine.model
        self._cache_kw, self._keep_logits = engine._cache_kw, engine._keep_logits

    def start(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        max_new_tokens: int,
    ) -> torch.Tensor:
        B, P = prompt_ids.shape
        self._attn = torch.ones((B, P + max_new_tokens), dtype=torch.long, device=prompt_ids.device)
        self._attn[:, :P] = prompt_mask
        self._P = P
        self._next_pos = prompt_mask.sum(1, keepdim=True)  # [B, 1]: first completion position
        self._prompt = (prompt_ids, positions)  # for ``recompute``
        self._cache = _new_cache(self.model)
        return self._forward(prompt_ids, self._attn[:, :P], positions)

    @property
    def can_select(self) -> bool:
        """The cache can drop rows (``DynamicCache.batch_select_indices``; ``LlamaDecoder.select``)."""
        return callable(getattr(self._cache, "batch_select_indices", None))

    def select(self, keep: torch.Tensor) -> None:
        """``LlamaDecoder.select``: keep the rows where ``keep`` is True, in the cache too."""
        idx = keep.nonzero().squeeze(1)
        self._cache.batch_select_indices(idx)
        self._attn, self._next_pos = self._attn[idx], self._next_pos[idx]
        prompt_ids, positions = self._prompt
        self._prompt = (prompt_ids[idx], positions[idx])

    def step(self, token_ids: torch.Tensor, t: int) -> torch.Tensor:
        return self._forward(token_ids.reshape(-1, 1), self._attn[:, : self._P + t + 1], self._next_pos + t)

    def recompute(self, generated: torch.Tensor) -> torch.Tensor:
        """``LlamaDecoder.recompute``: a fresh cache filled by one forward over prompt + ``generated``."""
        prompt_ids, positions = self._prompt
        n = generated.shape[1]
        ids = torch.cat([prompt_ids, generated.to(prompt_ids.dtype)], 1)
        pos = torch.cat([positions, self._next_pos + torch.arange(n, device=ids.device)], 1)
        self._cache = _new_cache(self.model)
        return self._forward(ids, self._attn[:, : self._P + n], pos)

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """One forward with the KV cache; returns float32 logits of the last position [B, V]."""
        kw: dict[str, Any] = {self._cache_kw: self._cache, "use_cache": True}
        if self._keep_logits:
            kw["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)
        return out.logits[:, -1].float()


def _uniforms(
    gen: torch.Generator, rows: int, k: int, temperature: float, device: torch.device
) -> torch.Tensor | None:
    """One decode step's uniforms ``u`` [rows, k] (float64) for ``_draw``; None at temperature 0."""
    if temperature == 0:
        return None
    return torch.rand((rows, k), generator=gen, dtype=torch.float64, device=device)


def _draw(
    logits: torch.Tensor, temperature: float, k: int, u: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """``k`` i.i.d. draws per row from softmax(logits / tau) at the uniforms ``u`` [B, k]
    (``_uniforms``; None at temperature 0: the argmax), and their log-probs, both [B, k]."""
    if temperature == 0:
        top = logits.argmax(-1, keepdim=True).expand(-1, k)
        return top, torch.zeros(top.shape, dtype=torch.float32, device=logits.device)
    if u is None:
        raise ValueError("_draw at temperature > 0 needs uniforms u [B, k] (_uniforms)")
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)  # [B, V], exact
    # Inverse-CDF sampling: draw = first index whose cumulative probability exceeds u ~ U(0, 1).
    # Float64 sums keep the CDF exact to ~1e-16; zero-probability tokens are never drawn.
    # (torch.multinomial with one draw per row is 5-20x slower on CPU.)
    if logp.shape[-1] >= _BLOCKED_FROM:
        draws = _inverse_cdf_blocked(logp, u)
    else:
        cdf = logp.double().exp().cumsum(-1)  # [B, V]
        draws = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max_(logits.shape[-1] - 1)
    return draws, logp.gather(-1, draws)


#: vocabularies from this size sample through block sums (``_inverse_cdf_blocked``)
_BLOCKED_FROM = 16_384
_BLOCK = 128


def _inverse_cdf_blocked(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws at ``u`` [B, k] from ``exp(logp)`` [B, V] in two levels: the float64 CDF
    of 128-token block sums (each summed in fp32), then the float64 CDF inside the chosen block.

    At Qwen's V = 151,936 the flat float64 CDF (``.double().exp().cumsum()``, three [B, V] passes
    in float64, the cumsum sequential) took ~70 % of a decode step's sampling. Here the [B, V] work
    is one fp32 exp and one fp32 summing pass; the probabilities differ from the flat path's by fp32
    rounding (~1e-7 relative), and zero-probability tokens are still never drawn.
    """
    B, V = logp.shape
    nb = -(-V // _BLOCK)
    p = logp.exp()
    if nb * _BLOCK != V:
        p = torch.nn.functional.pad(p, (0, nb * _BLOCK - V))  # zero mass: never drawn
    blocks = p.view(B, nb, _BLOCK)
    coarse = blocks.sum(-1).double().cumsum(-1)  # [B, nb]; fp32 block sums (sum(dtype=) copies to f64)
    target = u * coarse[:, -1:]  # [B, k]
    positive = coarse > torch.nn.functional.pad(coarse[:, :-1], (1, 0))  # blocks with mass
    last_block = (positive * torch.arange(1, nb + 1, device=p.device)).argmax(-1, keepdim=True)
    b = torch.searchsorted(coarse, target, right=True)
    b = torch.where(b < nb, b, last_block)  # u * total rounded up to the total
    before = torch.where(b > 0, coarse.gather(-1, (b - 1).clamp_min(0)), 0.0)
    chosen = blocks[torch.arange(B, device=p.device)[:, None], b]  # [B, k, BLOCK]
    inner = chosen.double().cumsum(-1)
    j = torch.searchsorted(inner, (target - before).unsqueeze(-1), right=True).squeeze(-1)
    # the block's own cumsum may end a rounding below its coarse sum: take its last positive token
    last = ((chosen > 0) * torch.arange(1, _BLOCK + 1, device=p.device)).argmax(-1)
    j = torch.where(j < _BLOCK, j, last)
    return b * _BLOCK + j


def _new_cache(model: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _device_of(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")
