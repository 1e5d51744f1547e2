"""Long prompts through speculative evaluation: chunked prefill (``prefill_chunk``) of target and draft equals the
single-shot prefill (its twin), its transients stay ``[C,L]`` per head, and the acceptance runs cap their prompts."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from inference_helpers import draft_for_target, make_target
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_eagle.inference import (
    DecodingSettings,
    DraftRunner,
    IncrementalTarget,
    evaluate_acceptance,
    plain_generate,
    speculative_generate,
)
from lightning_eagle.inference.batched import BatchedGenerator, GenerationRequest, batched_prefill
from lightning_eagle.inference.incremental_target import chunk_bounds
from lightning_eagle.inference.target_cache import KDALayerCache

AUX = [1, 3, 5]
TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32: chunking changes only the blocking of matmuls and the KDA recurrence form


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_caches_close(a: IncrementalTarget, b: IncrementalTarget) -> None:
    assert a.length == b.length
    for ca, cb in zip(a.caches, b.caches):
        if isinstance(ca, KDALayerCache):
            torch.testing.assert_close(ca.state, cb.state, **TOL)
            for ta, tb in zip(ca.tails, cb.tails):
                torch.testing.assert_close(ta, tb, **TOL)
        else:
            torch.testing.assert_close(ca.keys, cb.keys, **TOL)
            torch.testing.assert_close(ca.values, cb.values, **TOL)


def set_target_mla_backend(target, backend: str) -> None:
    for layer in target.model.layers:
        if not layer.is_kda:
            layer.self_attn.mla_backend = backend


# ---- target ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, chunk", [(1500, 256), (9, 1)])  # 256 does not divide 1500; C = 1 on a short prompt
def test_chunked_target_prefill_equals_one_forward(length, chunk):
    target = make_target(seed=3)
    prompt = torch.tensor([random_prompt(length, target.config.vocab_size, seed=length)])
    whole, chunked = IncrementalTarget(target, AUX), IncrementalTarget(target, AUX)
    ref = whole.prefill(prompt, return_logits=True)
    out = chunked.prefill(prompt, return_logits=True, chunk=chunk)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    torch.testing.assert_close(out.aux_hidden_states, ref.aux_hidden_states, **TOL)
    torch.testing.assert_close(out.hidden_states, ref.hidden_states, **TOL)
    assert_caches_close(chunked, whole)
    # the caches continue alike, and the chunked prefill left no rollback point inside the prompt
    step = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(chunked.extend(step).logits, whole.extend(step).logits, **TOL)
    chunked.rollback(length + 1)
    with pytest.raises(ValueError, match="cannot roll back"):
        chunked.rollback(length - 1)
    last = IncrementalTarget(target, AUX).prefill(prompt, chunk=chunk)  # "last" logits only
    torch.testing.assert_close(last.logits, ref.logits[:, -1:], **TOL)


def test_prefill_chunk_settings_are_checked():
    assert chunk_bounds(5, None) == [(0, 5)] and chunk_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]
    target = make_target(seed=3)
    draft = draft_for_target(target, draft_vocab_size=72)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
            speculative_generate(target, draft, [1, 2, 3], 2, prefill_chunk=bad)
    with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
        plain_generate(target, [1, 2, 3], 2, prefill_chunk=0)
    with pytest.raises(ValueError, match="prefill chunk starts at position 4"):
        session = IncrementalTarget(target)
        session.prefill_chunk(torch.tensor([[1, 2, 3]]), 0)
        session.prefill_chunk(torch.tensor([[4]]), 4)


# ---- draft ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"architecture": "deepseek_mla"}])
def test_chunked_draft_extend_equals_one_extend_and_the_cores_agree(overrides):
    target = make_target(seed=4)
    draft = draft_for_target(target, draft_vocab_size=72, seed=2, **overrides)
    T = 1100
    aux = torch.randn(1, T, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    next_ids = torch.tensor([random_prompt(T, target.config.vocab_size, seed=1)])
    runners = {}
    for backend in ("sdpa", "eager"):
        whole, chunked = DraftRunner(draft, mla_backend=backend), DraftRunner(draft, mla_backend=backend)
        ref = whole.extend(aux, next_ids)
        out = torch.cat([chunked.extend(aux[:, a:b], next_ids[:, a:b]) for a, b in chunk_bounds(T, 256)], dim=1)
        torch.testing.assert_close(out, ref, **TOL)
        for name in ("keys", "values", "last_hidden"):
            torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), **TOL)
        assert chunked.propose(4).tokens.tolist() == whole.propose(4).tokens.tolist()
        runners[backend] = (ref, whole)
    (ref_s, sdpa), (ref_e, eager) = runners["sdpa"], runners["eager"]
    torch.testing.assert_close(ref_s, ref_e, **TOL)  # the twins
    torch.testing.assert_close(sdpa.propose(4).logits, eager.propose(4).logits, **TOL)
    with pytest.raises(ValueError, match="mla_backend must be one of"):
        DraftRunner(draft, mla_backend="flash")


# ---- the speculative loop -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, chunk", [(1700, 256), (7, 1)])
def test_chunked_speculative_decoding_equals_single_shot_prefill(length, chunk):
    # A 6-token vocabulary with sharp heads: rounds accept 0..K drafts, so the accepted lengths are a real check.
    target = make_target(seed=6, vocab_size=6, lm_head_scale=20.0)
    draft = draft_for_target(target, draft_vocab_size=4, seed=1, lm_head_scale=20.0)
    prompt = random_prompt(length, 6, seed=length)
    whole, chunked = DraftRunner(draft), DraftRunner(draft)
    ref = speculative_generate(target, whole, prompt, 24, 3, aux_layer_ids=AUX, prefill_chunk=None)
    out = speculative_generate(target, chunked, prompt, 24, 3, aux_layer_ids=AUX, prefill_chunk=chunk)
    assert out.tokens == ref.tokens and out.accepted_per_round == ref.accepted_per_round
    for name in ("keys", "values", "last_hidden"):  # the draft's context after the last round
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), **TOL)
    assert speculative_generate(target, draft, prompt, 24, 3, prefill_chunk=chunk).tokens == ref.tokens
    assert len(set(ref.accepted_per_round)) > 1, "every round alike: the draft does not exercise acceptance"
    assert out.target_forwards == ref.target_forwards  # the prefill counts once
    assert plain_generate(target, prompt, 24, prefill_chunk=chunk).tokens == ref.tokens
    assert speculative_generate(target, draft, prompt, 1, 3, prefill_chunk=chunk).tokens == ref.tokens[:1]


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op returns, counted per attention head: one with n heads third from the end (``[B,n,·,·]``
    at B = 1, or ``[B·n,·,·]`` inside a batched matmul) counts ``numel / n``."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads, self.largest, self.shape = heads, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                per_head = t.numel() // (self.heads if t.dim() >= 3 and t.shape[-3] == self.heads else 1)
                if per_head > self.largest:
                    self.largest, self.shape = per_head, tuple(t.shape)
        return out


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_chunked_prefill_transients_are_chunk_by_length(backend):
    """A 2048-token prompt, C = 256: no tensor exceeds ``C × T`` elements per head; the single-shot prefill with the
    eager cores (the twin) does build ``[T,T]`` scores, so the bound is a real one."""
    target = make_target(seed=6)
    set_target_mla_backend(target, backend)
    draft = draft_for_target(target, draft_vocab_size=72, seed=1)
    heads = target.config.num_attention_heads
    assert draft.config.num_attention_heads == heads
    T, C = 2048, 256
    prompt = random_prompt(T, target.config.vocab_size, seed=0)

    def largest(chunk):
        runner = DraftRunner(draft, mla_backend=backend)
        with LargestTensor(heads) as seen:
            speculative_generate(target, runner, prompt, 3, 2, aux_layer_ids=AUX, prefill_chunk=chunk)
        return seen

    chunked = largest(C)
    assert chunked.largest <= C * T, f"chunked prefill built {chunked.shape}"
    if backend == "eager":
        assert largest(None).largest >= T * T


# ---- batched decoding -----------------------------------------------------------------------------------------------
def test_chunked_batched_prefill_equals_one_forward():
    target = make_target(seed=7)
    prompts = [random_prompt(n, target.config.vocab_size, seed=n) for n in (700, 300, 1000)]  # left padding > C
    ref_logits, ref = batched_prefill(target, prompts, prefill_chunk=None)
    logits, state = batched_prefill(target, prompts, prefill_chunk=256)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert torch.equal(state.valid, ref.valid)
    for (kind, a, b), (ref_kind, ra, rb) in zip(state.layers, ref.layers):
        assert kind == ref_kind
        if kind == "kda":
            torch.testing.assert_close(a, ra, **TOL)
            for t, rt in zip(b, rb):
                torch.testing.assert_close(t, rt, **TOL)
        else:  # keys/values at padding are never read
            keep = ref.valid[:, None, :, None]
            torch.testing.assert_close(a * keep, ra * keep, **TOL)
            torch.testing.assert_close(b * keep, rb * keep, **TOL)
    requests = [GenerationRequest(p, 6) for p in prompts]
    chunked = BatchedGenerator(target, max_batch_size=2, prefill_chunk=256).generate(requests)
    whole = BatchedGenerator(target, max_batch_size=2, prefill_chunk=None).generate(requests)
    assert [r.tokens for r in chunked] == [r.tokens for r in whole]
    assert [r.tokens for r in whole] == [plain_generate(target, p, 6).tokens for p in prompts]


# ---- acceptance runs ------------------------------------------------------------------------------------------------
def test_acceptance_caps_prompts_and_chunks_their_prefill():
    target = make_target(seed=6, vocab_size=6, lm_head_scale=20.0)
    draft = draft_for_target(target, draft_vocab_size=4, seed=1, lm_head_scale=20.0)
    prompts = [random_prompt(n, 6, seed=n) for n in (700, 40, 900, 60)]
    decoding = DecodingSettings(max_new_tokens=8, num_draft_tokens=3)
    options = {"stop_token_ids": None, "warmup": False}
    capped = evaluate_acceptance(target, draft, prompts, decoding, num_prompts=2, max_prompt_tokens=100, **options)
    short = evaluate_acceptance(target, draft, [prompts[1], prompts[3]], decoding, num_prompts=2, **options)
    assert capped.num_prompts == 2 and capped.accepted_per_round == short.accepted_per_round
    long_ones = [prompts[0], prompts[2]]
    chunked = evaluate_acceptance(target, draft, long_ones, replace(decoding, prefill_chunk=256), **options)
    whole = evaluate_acceptance(target, draft, long_ones, replace(decoding, prefill_chunk=None), compare_plain=False,
                                **options)  # fmt: skip
    assert chunked.accepted_per_round == whole.accepted_per_round and chunked.greedy_mismatches == 0
    with pytest.raises(ValueError, match="no prompts of at most max_prompt_tokens=10 tokens"):
        evaluate_acceptance(target, draft, prompts, decoding, max_prompt_tokens=10, **options)
    with pytest.raises(ValueError, match="max_prompt_tokens must be a positive int"):
        evaluate_acceptance(target, draft, prompts, decoding, max_prompt_tokens=0, **options)


def test_callback_prompt_cap(tmp_path):
    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.inference.callback import DEFAULT_CALLBACK_PROMPT_TOKENS, AcceptanceCallback

    def chat(n: int) -> dict:
        return {"messages": [{"role": "user", "content": "w" * n}, {"role": "assistant", "content": "ok"}]}

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(chat(n)) + "\n" for n in (50, 900, 6000)))
    dm = ChatDataModule(val_files=[str(val)], max_length=65536, cache_dir=str(tmp_path), thinking_effort=None)
    trainer = SimpleNamespace(datamodule=dm)
    lengths = sorted(len(p) for p in AcceptanceCallback(num_prompts=8, max_prompt_tokens=None).prompts(trainer))
    assert len(lengths) == 3 and lengths[-1] > DEFAULT_CALLBACK_PROMPT_TOKENS >= lengths[1]
    assert [len(p) for p in AcceptanceCallback(num_prompts=8).prompts(trainer)] == [lengths[0], lengths[1]]
    assert [len(p) for p in AcceptanceCallback(num_prompts=8, max_prompt_tokens=lengths[0]).prompts(trainer)] == [
        lengths[0]
    ]
    for bad in {"max_prompt_tokens": 0}, {"prefill_chunk": -1}:
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive int"):
            AcceptanceCallback(**bad)
