"""HFEngine: exact behavior log-probs, MC draws, EOS handling, determinism, weights, errors."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from asyncrl import records
from asyncrl.engines import ENGINES, RolloutEngine
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import EOS_ID, PAD_ID, char_tokenizer

torch.set_num_threads(1)

TOK = char_tokenizer()
PROMPTS = ["12+34=", "7+8=", "hello world=", "a", "99+99=", "xyz=", "3=", "reverse me="]


def _model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    spec = ModelSpec(arch, hidden=32, layers=2, heads=4, intermediate=64, max_positions=64)
    return build_model(spec, len(TOK), seed).eval()


def _prompts(prompts: list[str] = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    return encode_prompts(TOK, prompts, 16)


def _with_eos_bias(model: torch.nn.Module, bias: float) -> torch.nn.Module:
    """Give the LM head a bias towards EOS so rows finish early (a plain HF model otherwise)."""
    old = model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[EOS_ID] = bias
    model.set_output_embeddings(head)
    return model


def _teacher_forced_logprobs(model, ids, mask, out, temperature=1.0):
    with torch.no_grad():
        z = records.completion_logits(model, ids, mask, out["completion_ids"], out["completion_mask"])
    logp = torch.log_softmax(z.float() / temperature, -1)
    return logp


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_teacher_forced_forward(arch: str, temperature: float) -> None:
    model = _model(arch)
    ids, mask = _prompts()
    out = HFEngine(model, TOK).generate(
        ids, mask, SamplingParams(max_new_tokens=24, temperature=temperature, mc_samples=3), seed=1
    )
    logp = _teacher_forced_logprobs(model, ids, mask, out, temperature)
    valid = out["completion_mask"]
    ref = logp.gather(-1, out["completion_ids"][..., None])[..., 0]
    assert (ref - out["behavior_logprobs"])[valid].abs().max() < 1e-5
    ref_mc = logp.gather(-1, out["mc_ids"])
    assert (ref_mc - out["mc_behavior_logprobs"])[valid].abs().max() < 1e-5


def test_output_columns_shapes_and_dtypes() -> None:
    ids, mask = _prompts()
    eng = HFEngine(_model(), TOK, version=7)
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=10, mc_samples=4), seed=0)
    B, T = ids.shape[0], out["completion_ids"].shape[1]
    assert T <= 10
    dims = records.validate_batch(
        {**out, records.PROMPT_IDS: ids, records.PROMPT_MASK: mask}, vocab_size=len(TOK)
    )
    assert dims == {"B": B, "P": ids.shape[1], "T": T, "m": 4}
    assert out["completion_ids"].dtype == torch.int64 and out["completion_mask"].dtype == torch.bool
    assert (
        out["behavior_logprobs"].dtype == torch.float32 and out["mc_behavior_logprobs"].dtype == torch.float32
    )
    assert out["token_versions"].dtype == torch.int32 and bool((out["token_versions"] == 7).all())
    assert torch.equal(out["mc_ids"][..., 0], out["completion_ids"])  # column 0 = generated token
    no_mc = eng.generate(ids, mask, SamplingParams(max_new_tokens=10), seed=0)
    assert records.MC_IDS not in no_mc and records.MC_BEHAVIOR_LOGPROBS not in no_mc


def test_mc_draws_match_softmax_chi_square() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    model = _model(seed=3)
    with torch.no_grad():  # sharpen the (near-uniform at init) distribution so tau matters
        model.get_output_embeddings().weight.mul_(8.0)
    ids, mask = _prompts(["12+34="])
    m, tau = 6000, 0.8
    out = HFEngine(model, TOK).generate(
        ids, mask, SamplingParams(max_new_tokens=1, temperature=tau, mc_samples=m), seed=11
    )
    draws = out["mc_ids"][0, 0]  # [m]: i.i.d. with replacement (m > V is only possible that way)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=mask.long(), position_ids=records.position_ids(mask)).logits
    probs = torch.softmax(z[0, -1].double() / tau, -1)
    counts = torch.bincount(draws, minlength=len(TOK)).double()

    def binned(expected: torch.Tensor) -> tuple:
        """Bins with >= 5 expected draws, plus one bin merging the rest (if any)."""
        big = probs * m >= 5
        obs, exp = [counts[big]], [expected[big]]
        if (~big).any():
            obs.append(counts[~big].sum()[None])
            exp.append(expected[~big].sum()[None])
        return torch.cat(obs).numpy(), torch.cat(exp).numpy(), int(big.sum())

    obs, exp, n_big = binned(probs * m)
    assert n_big >= 20, n_big
    p = scipy_stats.chisquare(obs, exp).pvalue
    assert p > 1e-3, f"MC draws do not follow softmax(z/tau): chi-square p={p:.2e}"
    # and a wrong temperature is detected by the same test (the test can fail)
    obs_w, exp_w, _ = binned(torch.softmax(z[0, -1].double() / 1.3, -1) * m)
    assert scipy_stats.chisquare(obs_w, exp_w).pvalue < 1e-3


def test_generated_tokens_match_softmax_chi_square() -> None:
    """The m = 0 path: one draw per row, many identical rows at one position."""
    scipy_stats = pytest.importorskip("scipy.stats")
    model = _model(seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    n, tau = 4000, 0.8
    ids, mask = _prompts(["12+34="] * n)
    out = HFEngine(model, TOK).generate(ids, mask, SamplingParams(max_new_tokens=1, temperature=tau), seed=2)
    with torch.no_grad():
        z = model(input_ids=ids[:1], attention_mask=mask[:1].long()).logits[0, -1].double()
    expected = torch.softmax(z / tau, -1) * n
    counts = torch.bincount(out["completion_ids"][:, 0], minlength=len(TOK)).double()
    big = expected >= 5  # merge rare tokens into one bin (there are some: the logits are sharpened)
    assert 20 <= int(big.sum()) < len(TOK)
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).numpy()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).numpy()
    assert scipy_stats.chisquare(obs, exp).pvalue > 1e-3


def test_eos_stops_row_and_masks_padding() -> None:
    model = _with_eos_bias(_model(seed=1), bias=2.0)
    ids, mask = _prompts()
    out = HFEngine(model, TOK).generate(ids, mask, SamplingParams(max_new_tokens=30, mc_samples=2), seed=5)
    c, valid = out["completion_ids"], out["completion_mask"]
    stopped = 0
    for b in range(c.shape[0]):
        eos_at = (c[b] == EOS_ID).nonzero().flatten()
        if len(eos_at) == 0:
            assert bool(valid[b].all())
            continue
        stopped += 1
        e = int(eos_at[0])
        assert bool(valid[b, : e + 1].all()), "tokens up to and including EOS are valid"
        assert not bool(valid[b, e + 1 :].any()), "positions after EOS are masked"
        assert bool((c[b, e + 1 :] == PAD_ID).all()), "positions after EOS hold the pad id"
        assert bool((out["behavior_logprobs"][b, e + 1 :] == 0).all())
        assert bool((out["mc_ids"][b, e + 1 :] == PAD_ID).all())
    assert stopped >= 2


def test_stops_early_when_all_rows_finished() -> None:
    model = _with_eos_bias(_model(seed=1), bias=30.0)  # EOS is (almost surely) the first token
    ids, mask = _prompts()
    out = HFEngine(model, TOK).generate(ids, mask, SamplingParams(max_new_tokens=30), seed=0)
    assert out["completion_ids"].shape == (len(PROMPTS), 1)
    assert bool((out["completion_ids"] == EOS_ID).all()) and bool(out["completion_mask"].all())


def test_same_seed_same_output_different_seed_different_output() -> None:
    eng = HFEngine(_model(), TOK)
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=16, mc_samples=2)
    a = eng.generate(ids, mask, params, seed=123)
    b = eng.generate(ids, mask, params, seed=123)
    c = eng.generate(ids, mask, params, seed=124)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["completion_ids"], c["completion_ids"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_equals_hf_generate(arch: str) -> None:
    from transformers import GenerationConfig

    model = _model(arch, seed=2)
    ids, mask = _prompts()
    out = HFEngine(model, TOK).generate(ids, mask, SamplingParams(max_new_tokens=12, temperature=0), seed=0)
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=gc)[
            :, ids.shape[1] :
        ]
    T = out["completion_ids"].shape[1]
    assert torch.equal(ref[:, :T], out["completion_ids"])
    assert bool((out["behavior_logprobs"] == 0).all())  # greedy: pi_b is a point mass


def test_left_padding_does_not_change_a_row() -> None:
    """A prompt's completion does not depend on how much left padding its batch needs."""
    model = _model(seed=4)
    eng = HFEngine(model, TOK)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    alone = eng.generate(*encode_prompts(TOK, ["7+8="], 5), params, seed=0)
    padded = eng.generate(*encode_prompts(TOK, ["7+8=", "a much longer prompt="], 24), params, seed=0)
    T = alone["completion_ids"].shape[1]
    assert torch.equal(padded["completion_ids"][0, :T], alone["completion_ids"][0])


def test_load_weights_sets_weights_and_version() -> None:
    a, b = _model(seed=0), _model(seed=1)
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=8, temperature=0)
    ref = HFEngine(b, TOK).generate(ids, mask, params, seed=0)["completion_ids"]
    eng = HFEngine(a, TOK, version=0)
    assert not torch.equal(eng.generate(ids, mask, params, seed=0)["completion_ids"], ref)
    eng.load_weights({f"module.{k}": v for k, v in b.state_dict().items()}, version=5)  # DDP prefix ok
    assert eng.version == 5
    assert torch.equal(eng.generate(ids, mask, params, seed=0)["completion_ids"], ref)
    assert bool((eng.generate(ids, mask, params, seed=0)["token_versions"] == 5).all())
    with pytest.raises(ValueError, match="missing"):
        eng.load_weights({"not.a.key": torch.zeros(1)}, version=6)
    with pytest.raises(ValueError, match="version"):
        eng.load_weights(b.state_dict(), version=-1)
    assert eng.version == 5


def test_from_pretrained_round_trip_and_registry(tmp_path) -> None:
    model = _model(seed=6)
    model.save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    eng = ENGINES.get("hf").from_pretrained(str(tmp_path), version=3, torch_threads=1)
    assert isinstance(eng, HFEngine) and isinstance(eng, RolloutEngine)
    assert eng.version == 3 and eng.name == "hf" and eng.supports_mc
    assert eng.pad_id == PAD_ID and eng.eos_id == EOS_ID and eng.tokenizer is not None
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=8, temperature=0)
    ref = HFEngine(model, TOK).generate(ids, mask, params, seed=0)
    got = eng.generate(ids, mask, params, seed=0)
    assert torch.equal(ref["completion_ids"], got["completion_ids"])
    # engine_options reach the engine (pipeline.engine_options is from_pretrained's keywords)
    paced = HFEngine.from_pretrained(tmp_path, step_latency_s=0.01, compact=False)
    assert paced.step_latency_s == 0.01 and paced.compact is False and eng.step_latency_s == 0.0
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        HFEngine.from_pretrained(tmp_path / "nope")


def test_ids_mapping_instead_of_tokenizer() -> None:
    eng = HFEngine(_model(), {"pad_id": PAD_ID, "eos_id": [EOS_ID, 5]})
    assert eng.tokenizer is None and eng.eos_ids == (EOS_ID, 5) and eng.pad_id == PAD_ID


def test_bad_inputs_raise_clear_errors() -> None:
    eng = HFEngine(_model(), TOK)
    params = SamplingParams(max_new_tokens=4)
    ids, mask = _prompts(["12+3=", "7="])
    with pytest.raises(ValueError, match="left-padded"):
        eng.generate(ids, mask.flip(1), params, seed=0)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(ValueError, match="no valid token"):
        eng.generate(ids, empty, params, seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.generate(ids, mask, SamplingParams(max_new_tokens=63), seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        eng.generate(ids + 1000, mask, params, seed=0)
    with pytest.raises(ValueError, match=r"\[B, P\]"):
        eng.generate(ids[0], mask[0], params, seed=0)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate(ids, mask, {"max_new_tokens": 4}, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        HFEngine(_model(), TOK, version=-2)


def test_full_length_rollout_trains_in_a_plain_loop() -> None:
    """Every row reaches max_new_tokens (no EOS), so ``pad_rollout`` has nothing to pad and hands the
    engine's own tensors on: they must be normal tensors, not ``inference_mode`` ones, or the
    importance ratio below fails with "Inference tensors cannot be saved for backward"."""
    from asyncrl.stages import pad_rollout

    model = _with_eos_bias(_model(), -1e4)  # EOS is never drawn: every row runs to the limit
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=6, mc_samples=2)
    out = HFEngine(model, TOK).generate(ids, mask, params, seed=3)
    assert bool(out["completion_mask"].all()) and out["completion_ids"].shape[1] == 6
    out = pad_rollout(out, params.max_new_tokens, PAD_ID)
    assert not any(v.is_inference() for v in out.values())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):  # plain loop: PPO-style ratio against the behavior log-probs
        z = records.completion_logits(model, ids, mask, out["completion_ids"], out["completion_mask"])
        lp = torch.log_softmax(z, -1).gather(-1, out["mc_ids"])  # [B, T, m]
        ratio = (lp - out["mc_behavior_logprobs"]).exp()
        loss = -(ratio * out["completion_mask"][..., None]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_completion_logits_keep_only_completion_positions_same_values_and_gradient(arch: str) -> None:
    """``records.completion_logits`` runs the LM head at the last T + 1 positions only
    (``logits_to_keep``): the same aligned logits and parameter gradients as the full forward
    sliced by ``align_logits``, left-padded prompts included; a model without the argument (a
    user's, or behind a DDP-style wrapper) gets the full forward."""
    model = _model(arch, seed=3)
    ids, mask = _prompts()
    out = HFEngine(model, TOK).generate(ids, mask, SamplingParams(max_new_tokens=5, temperature=1.0), seed=0)
    comp, cmask = out["completion_ids"], out["completion_mask"]
    assert records.keeps_logits(model)
    head_rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, o: head_rows.append(a[0].shape[1]))

    def full(m: torch.nn.Module) -> torch.Tensor:
        x = torch.cat([ids, comp], 1)
        attn = torch.cat([mask, cmask], 1).long()
        z = m(
            input_ids=x, attention_mask=attn, position_ids=records.position_ids(attn), use_cache=False
        ).logits
        return records.align_logits(z, ids.shape[1])

    grads = []
    for fn in (lambda m: records.completion_logits(m, ids, mask, comp, cmask), full):
        model.zero_grad()
        z = fn(model)
        assert z.shape == (len(PROMPTS), comp.shape[1], len(TOK))
        (z.float().log_softmax(-1) * cmask[..., None]).sum().backward()
        grads.append((z.detach(), [p.grad.clone() for p in model.parameters()]))
    assert head_rows == [comp.shape[1] + 1, ids.shape[1] + comp.shape[1]]  # kept rows, then the full forward
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

    class NoKeep(torch.nn.Module):  # a user model: the HF call without logits_to_keep
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    class DistributedDataParallel(torch.nn.Module):  # a wrapper's name: looked through to .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    assert not records.keeps_logits(NoKeep(model)) and records.keeps_logits(DistributedDataParallel(model))
    for wrapped in (NoKeep(model), DistributedDataParallel(model)):
        z = records.completion_logits(wrapped, ids, mask, comp, cmask)
        torch.testing.assert_close(z.detach(), grads[1][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("V", [20_000, 151_936])
def test_blocked_inverse_cdf_draws_what_the_flat_cdf_draws(V: int) -> None:
    """Large vocabularies sample through block sums (``_inverse_cdf_blocked``): at the same
    uniforms the draws equal the flat float64 CDF's but where u falls within fp32 exp rounding
    (~1e-8 of mass) of one of the V boundaries (about V x 1e-8 of draws), zero-probability tokens
    (-inf logits, the padding of a last partial block) are never drawn, u at either end included,
    and the draws follow the softmax."""
    from asyncrl.engines.hf import _BLOCKED_FROM, _draw, _inverse_cdf_blocked, _uniforms

    assert V >= _BLOCKED_FROM
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(6, V, generator=g) * 3
    logits[:, ::7] = -math.inf  # impossible tokens, in every block
    logits[1, V - 300 :] = -math.inf  # a row whose last blocks hold no mass
    logits[2, :] = -math.inf
    logits[2, [5, 130, V - 1]] = torch.tensor([0.0, 1.0, 2.0])  # mass in three blocks only
    logp = torch.log_softmax(logits, -1)
    u = torch.rand(6, 4000, generator=g, dtype=torch.float64)
    u[:, 0], u[:, 1] = 0.0, 1.0 - 2.0**-53
    got = _inverse_cdf_blocked(logp, u)
    cdf = logp.double().exp().cumsum(-1)
    flat = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max_(V - 1)
    assert (got != flat).float().mean() < max(2e-8 * V, 1e-4)
    assert bool(torch.isfinite(logp.gather(-1, got)).all()) and int(got.max()) < V
    assert got[2, 0] == 5 and got[2, 1] == V - 1

    scipy_stats = pytest.importorskip("scipy.stats")
    W = _BLOCKED_FROM + 100  # through _draw: log-softmax and all, on 2,000 rows of a smaller V
    row = torch.full((1, W), -math.inf)
    support = [3, 1000, W - 129, W - 2]
    row[0, support] = torch.tensor([0.0, 0.5, 1.0, 1.5])
    u = _uniforms(torch.Generator().manual_seed(0), 2_000, 8, 1.0, torch.device("cpu"))
    draws, lp = _draw(row.expand(2_000, W), 1.0, 8, u)
    p = torch.softmax(row[0], -1)
    counts = [int((draws == i).sum()) for i in support]
    assert sum(counts) == draws.numel()
    assert scipy_stats.chisquare(counts, [float(p[i]) * draws.numel() for i in support]).pvalue > 1e-3
    torch.testing.assert_close(lp, p.log()[draws])
