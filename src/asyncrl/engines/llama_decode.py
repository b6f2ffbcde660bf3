"""``LlamaDecoder``: the Llama block's incremental forward over a preallocated KV cache, for
``HFEngine``'s sampling loop.

Why: at the model sizes asyncrl's CPU engine serves, one decode step of ``transformers``'
``LlamaForCausalLM`` is nearly all framework overhead (module dispatch, mask construction,
``DynamicCache`` concatenation, output dataclasses): a 1-layer 64-wide student spends ~0.85 ms
per step of which the matrix products are ~0.1 ms. This module runs the same arithmetic as
``transformers``' eager/SDPA Llama in the same order, in plain tensor calls on the model's own
parameters (read afresh by every rollout, so weights loaded or trained in place are always
used), with the query, key and value projections fused into one matmul and keys/values written
into buffers sized for the whole rollout (no per-step concatenation).

Per layer l, hidden h [B, S, d], positions p, left-padding key mask k_valid:
    x = RMSNorm(h) = w * (h / sqrt(mean(h^2) + eps))
    [q | k | v] = x W_qkv^T (+ b_qkv)                        (one matmul; W_qkv = [W_q; W_k; W_v])
    q, k = q cos(p) + rot(q) sin(p), k cos(p) + rot(k) sin(p)  (RoPE, rot = rotate_half)
    o = softmax(q K^T / sqrt(d_head) + mask) V               (K, V: the buffers up to p)
    h = h + o W_o^T;  h = h + W_down (silu(x' W_gate^T) * x' W_up^T),  x' = RMSNorm(h)
logits = RMSNorm(h_last) W_lm^T.

Supported: ``model_type`` ``llama``, and ``qwen3`` (the same block plus RMSNorm of each query and
key head before RoPE, ``q_norm`` / ``k_norm``) without sliding-window layers; SiLU MLP,
``default`` / ``linear`` / ``llama3`` RoPE, optional attention/MLP biases, grouped-query
attention, tied embeddings, no attention dropout. Anything else is reported by
``unsupported_reason`` and ``HFEngine`` keeps ``transformers``' own forward. Parity with
``transformers`` (logits to float error, identical draws) is a unit test.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

#: rope types whose inverse frequencies do not change with the sequence length
_STATIC_ROPE = ("default", "linear", "llama3")
#: transformers model types whose decoder block this module reproduces
_FAMILIES = ("llama", "qwen3")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``LlamaDecoder`` cannot run ``model`` (``None`` when it can)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no transformers config"
    reason = config_unsupported_reason(config)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model is not a LlamaForCausalLM (no .model.layers / .model.rotary_emb)"
    unmerged = next((n for n, m in model.named_modules() if _unmerged_adapter(m)), None)
    if unmerged is not None:  # this decoder reads the layers' weights only: the adapters would be lost
        return f"layer {unmerged!r} has unmerged LoRA adapters (merge them into the weights first)"
    return None


def _unmerged_adapter(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an adapter layer (peft's tuner layers) whose active adapters are not
    merged into its base weight."""
    if not hasattr(module, "merged_adapters") or not hasattr(module, "active_adapters"):
        return False
    if getattr(module, "disable_adapters", False):
        return False
    return any(a not in module.merged_adapters for a in module.active_adapters)


def config_unsupported_reason(config: Any) -> str | None:
    """The part of ``unsupported_reason`` a checkpoint's config alone decides (no weights loaded:
    ``HFEngine.check_supported`` asks it in the driver before any actor starts)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        return f"model_type {model_type!r} is not one of {_FAMILIES}"
    sliding = [t for t in getattr(config, "layer_types", None) or [] if t != "full_attention"]
    if sliding or getattr(config, "use_sliding_window", False):
        return f"layers of type {sorted(set(sliding)) or ['sliding_attention']} (sliding-window attention)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not 'silu'"
    # transformers 5 names it rope_parameters; 4.x rope_scaling (with "type" in older configs)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _STATIC_ROPE:
        return f"rope_type {rope_type!r} is not one of {_STATIC_ROPE}"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        return f"attention_dropout is {config.attention_dropout} (the fast path has no dropout)"
    return None


class LlamaDecoder:
    """Prefill + one-token decode steps for one batch; see the module docstring.

    Args:
        model: a ``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` (``unsupported_reason(model) is None``).

    Usage: ``logits = dec.start(prompt_ids, prompt_mask, positions, max_new_tokens)``, then
    ``logits = dec.step(token_ids, t)`` for ``t = 0, 1, ...`` (token ``t``'s logits predict
    token ``t + 1``). Logits are float32 [B, V] of the last position.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LlamaDecoder cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scale = self.head_dim**-0.5
        self.reload()

    def reload(self) -> None:
        """Gather the model's weights afresh (q/k/v and gate/up fused into copies).

        A decoder lives for one ``generate`` call, so a model trained in place between calls is
        always read fresh; the copies cost microseconds against the rollout's milliseconds. The
        fused copies are state *derived* from the weights: an engine that loads new weights in the
        middle of a rollout (in-flight updates) must call this before the next step, or it samples
        with the old q/k/v and MLP weights (``held_weights`` lets it prove it did)."""
        model = self.model
        self._layers = [_LayerWeights.of(layer) for layer in model.model.layers]
        self._final = (model.model.norm.weight, model.model.norm.variance_epsilon)
        self._head = (model.lm_head.weight, model.lm_head.bias)

    def held_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(live parameter, the slice of the decoder's fused copy it was gathered into)`` for every
        copied weight (q, k, v, gate, up and their biases); equal elementwise iff the copies are
        current. Other weights (norms, o, down, embedding, head) are read by reference."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, w in zip(self.model.model.layers, self._layers):
            a, mlp = layer.self_attn, layer.mlp
            for lins, fused, bias in (
                ((a.q_proj, a.k_proj, a.v_proj), w.qkv, w.qkv_b),
                ((mlp.gate_proj, mlp.up_proj), w.gate_up, w.gate_up_b),
            ):
                lo = 0
                for lin in lins:
                    n = lin.weight.shape[0]
                    out.append((lin.weight, fused[lo : lo + n]))
                    if bias is not None and lin.bias is not None:
                        out.append((lin.bias, bias[lo : lo + n]))
                    lo += n
        return out

    # --- one rollout -------------------------------------------------------------------
    def start(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """Prefill left-padded prompts [B, P] (``positions = cumsum(mask) - 1``); logits [B, V]."""
        inner = self.model.model
        B, P = prompt_ids.shape
        L = P + max_new_tokens
        dev = prompt_ids.device
        dtype = inner.embed_tokens.weight.dtype
        rot = inner.rotary_emb
        # cos/sin for positions 0..L-1 exactly as LlamaRotaryEmbedding.forward computes them
        pos = torch.arange(L, device=dev, dtype=torch.float32)
        freqs = pos[:, None] * rot.inv_freq.to(device=dev, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * rot.attention_scaling).to(dtype)  # [L, D]
        self._sin = (emb.sin() * rot.attention_scaling).to(dtype)
        n_layers = len(inner.layers)  # one key and one value buffer per layer: [layers, B, H_kv, L, D]
        self._k = torch.zeros((n_layers, B, self.n_kv, L, self.head_dim), dtype=dtype, device=dev)
        self._v = torch.zeros_like(self._k)
        # key validity for every slot: prompt mask, then generated slots (always attended)
        valid = torch.ones((B, L), dtype=torch.bool, device=dev)
        valid[:, :P] = prompt_mask.bool()
        self._valid = valid[:, None, None, :]  # [B, 1, 1, L]
        self._P = P
        self._next_pos = positions[:, -1] + 1  # [B]: the first completion position
        self._prompt = (prompt_ids, positions)  # for ``recompute``
        causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
        # a left-padding position attends to itself only: its keys/values stay finite (no valid
        # query reads them, but NaN there would poison softmax(...) V through 0 * NaN)
        mask = (causal[None, None] & self._valid[..., :P]) | torch.eye(P, dtype=torch.bool, device=dev)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [B, 1, P, D]
        h = F.embedding(prompt_ids, inner.embed_tokens.weight)
        return self._forward(h, cos, sin, mask, 0, P)

    #: ``select`` is available (``HFEngine(compact=True)`` drops finished rows through it)
    can_select = True

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows where ``keep`` [B] is True (finished rows leave the batch): the K/V
        buffers, key mask, positions and prompt are index-selected; later calls see the smaller B."""
        self._k, self._v = self._k[:, keep], self._v[:, keep]
        self._valid = self._valid[keep]
        self._next_pos = self._next_pos[keep]
        prompt_ids, positions = self._prompt
        self._prompt = (prompt_ids[keep], positions[keep])

    def step(self, token_ids: torch.Tensor, t: int) -> torch.Tensor:
        """Feed generated token ``t`` ([B] or [B, 1]) at slot ``P + t``; logits [B, V]."""
        h, cos, sin = self._step_inputs(token_ids, t)
        s = self._P + t
        return self._forward(h, cos, sin, self._valid[..., : s + 1], s, s + 1)

    def recompute(self, generated: torch.Tensor) -> torch.Tensor:
        """Rebuild the K/V of the prompt and the generated tokens ``generated`` [B, n] (tokens
        ``0..n-1``) with the weights now held, as one prefill; returns the logits [B, V] that
        predict token ``n`` (what ``step(generated[:, -1], n - 1)`` returns, but with no K/V of an
        older version left). The next call is ``step(token_n, n)``."""
        prompt_ids, positions = self._prompt
        n = generated.shape[1]
        P = self._P
        S = P + n
        ids = torch.cat([prompt_ids, generated.to(prompt_ids.dtype)], 1)  # [B, S]
        offs = torch.arange(n, device=ids.device)
        pos = torch.cat([positions, self._next_pos[:, None] + offs], 1)  # [B, S]
        causal = torch.ones((S, S), dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(S, dtype=torch.bool, device=ids.device)
        mask = (causal[None, None] & self._valid[..., :S]) | eye  # as ``start``, over S slots
        cos, sin = self._cos[pos][:, None], self._sin[pos][:, None]  # [B, 1, S, D]
        h = F.embedding(ids, self.model.model.embed_tokens.weight)
        return self._forward(h, cos, sin, mask, 0, S)

    def _forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, lo: int, hi: int
    ) -> torch.Tensor:
        """Run every layer on hidden ``h`` [B, S, d] for cache slots ``lo:hi``; last-position logits."""
        return _run_layers(self, h, cos, sin, [_Part(self, 0, h.shape[0], mask, lo, hi)])

    def adopt_weights(self, other: LlamaDecoder) -> None:
        """Read the weights through ``other``'s gathered copies (decoders of one model that step
        together, ``step_together``: one copy, one ``reload``)."""
        if other.model is not self.model:
            raise ValueError("adopt_weights: the decoders must run the same model")
        self._layers, self._final, self._head = other._layers, other._final, other._head

    def _step_inputs(self, token_ids: torch.Tensor, t: int) -> tuple[torch.Tensor, ...]:
        """Hidden, cos, sin of generated token ``t`` ([B] ids) and its cache slot ``P + t``."""
        pos = self._next_pos + t  # [B]
        cos, sin = self._cos[pos][:, None, None], self._sin[pos][:, None, None]  # [B, 1, 1, D]
        h = F.embedding(token_ids.reshape(-1, 1), self.model.model.embed_tokens.weight)
        return h, cos, sin


class _Part(NamedTuple):
    """Rows ``lo_row:hi_row`` of a fused batch belong to ``decoder``; they write its cache slots
    ``lo:hi`` and attend under ``mask``."""

    decoder: LlamaDecoder
    lo_row: int
    hi_row: int
    mask: torch.Tensor
    lo: int
    hi: int


def _run_layers(
    owner: LlamaDecoder, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[_Part]
) -> torch.Tensor:
    """Every layer over hidden ``h`` [R, S, d] with ``owner``'s weights: the projections and the
    MLP (the part of a step that reads the weights) as one matmul over all R rows, attention per
    part, each over its own decoder's K/V buffers. Returns the last position's logits [R, V]."""
    R, S, _ = h.shape
    nq, nkv, D = owner.n_heads, owner.n_kv, owner.head_dim
    for i, w in enumerate(owner._layers):
        x = _rms(h, w.norm1, w.eps1)
        qkv = F.linear(x, w.qkv, w.qkv_b).view(R, S, nq + 2 * nkv, D)
        if w.q_norm is None:
            qk = qkv[:, :, : nq + nkv].transpose(1, 2)  # [R, H, S, D]
        else:  # qwen3: RMSNorm over each query / key head's dims, before RoPE
            q = _rms(qkv[:, :, :nq], w.q_norm, w.qk_eps)
            qk = torch.cat([q, _rms(qkv[:, :, nq : nq + nkv], w.k_norm, w.qk_eps)], 2).transpose(1, 2)
        qk = qk * cos + _rotate_half(qk) * sin  # RoPE on the query and key heads at once
        outs = []
        for part in parts:
            a, b = part.lo_row, part.hi_row
            k_buf, v_buf = part.decoder._k[i], part.decoder._v[i]
            k_buf[:, :, part.lo : part.hi] = qk[a:b, nq:]
            v_buf[:, :, part.lo : part.hi] = qkv[a:b, :, nq + nkv :].transpose(1, 2)
            outs.append(
                F.scaled_dot_product_attention(
                    qk[a:b, :nq],
                    k_buf[:, :, : part.hi],
                    v_buf[:, :, : part.hi],
                    attn_mask=part.mask,
                    scale=owner.scale,
                    enable_gqa=nkv != nq,
                )
            )
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        h = h + F.linear(o.transpose(1, 2).reshape(R, S, nq * D), w.o, w.o_b)
        x = _rms(h, w.norm2, w.eps2)
        gate, up = F.linear(x, w.gate_up, w.gate_up_b).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, w.down, w.down_b)
    x = _rms(h[:, -1], *owner._final)
    return F.linear(x, *owner._head).float()


def step_together(
    decoders: list[LlamaDecoder], token_ids: list[torch.Tensor], ts: list[int]
) -> list[torch.Tensor]:
    """One decode step of several decoders as one batch (continuous batching across rollouts):
    decoder ``j`` feeds its generated token ``ts[j]`` (``token_ids[j]`` [B_j]) as ``step`` would,
    and gets its logits [B_j, V]. At these sizes a step is mostly reading the weights (its cost
    by live rows: BENCHMARKS.md, "Batching headroom"), so rows of several rollouts share that read; each
    rollout keeps its own K/V buffers, slots and positions, so only attention runs per decoder.

    Every decoder must hold the same weights (``adopt_weights`` of the first one); the first
    decoder's are used. Logits equal each decoder's own ``step`` to float rounding (a row's
    matmul runs in a different batch)."""
    if not decoders or not (len(decoders) == len(token_ids) == len(ts)):
        raise ValueError("step_together needs one token tensor and one t per decoder")
    owner = decoders[0]
    if any(d._layers is not owner._layers for d in decoders[1:]):
        raise ValueError("step_together: every decoder must adopt_weights of the first one")
    if len(decoders) == 1:
        return [owner.step(token_ids[0], ts[0])]
    hs, coss, sins, parts, row = [], [], [], [], 0
    for dec, ids, t in zip(decoders, token_ids, ts):
        h, cos, sin = dec._step_inputs(ids, t)
        s = dec._P + t
        parts.append(_Part(dec, row, row + h.shape[0], dec._valid[..., : s + 1], s, s + 1))
        hs.append(h)
        coss.append(cos)
        sins.append(sin)
        row += h.shape[0]
    logits = _run_layers(owner, torch.cat(hs), torch.cat(coss), torch.cat(sins), parts)
    return [logits[p.lo_row : p.hi_row] for p in parts]


class _LayerWeights(NamedTuple):
    """One decoder layer's parameters, q/k/v and gate/up concatenated along the output dim."""

    norm1: torch.Tensor
    eps1: float
    qkv: torch.Tensor
    qkv_b: torch.Tensor | None
    o: torch.Tensor
    o_b: torch.Tensor | None
    norm2: torch.Tensor
    eps2: float
    gate_up: torch.Tensor
    gate_up_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # qwen3's per-head query / key norms (None for llama)
    k_norm: torch.Tensor | None
    qk_eps: float

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _LayerWeights:
        a, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return cls(
            layer.input_layernorm.weight,
            layer.input_layernorm.variance_epsilon,
            *_cat_linear(a.q_proj, a.k_proj, a.v_proj),
            a.o_proj.weight,
            a.o_proj.bias,
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon,
            *_cat_linear(mlp.gate_proj, mlp.up_proj),
            mlp.down_proj.weight,
            mlp.down_proj.bias,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.variance_epsilon if q_norm is not None else 0.0,
        )


def _cat_linear(*linears: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights (and biases, if any) of ``nn.Linear`` layers stacked along the output dim."""
    w = torch.cat([lin.weight for lin in linears], 0)
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return w, None
    b = torch.cat([lin.bias if lin.bias is not None else w.new_zeros(lin.out_features) for lin in linears])
    return w, b


def _rms(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (float32 statistics, cast back before the weight)."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


__all__ = ["LlamaDecoder", "config_unsupported_reason", "step_together", "unsupported_reason"]
