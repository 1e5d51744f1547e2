"""The memory plan's draft unroll (``parallel/memory_plan/draft_forward.py``, ``draft_backward.py``) for the
long-context mechanisms, against a census of the real ``ttt_loss`` on the meta device (the method of
``test_parallel_memory_plan.py``: every storage an op creates watched through a weak reference; "kept after the
forward" exact, the unroll peak within 3 %):

* ``flash_lse`` without any ``[T,T]`` mask (unpadded / right-padded rows: a tensor-free ``CausalBlock``);
* ``ttt_kv_cache="latent"`` (the cache keeps MLA's normalised latent + rope key), with and without checkpointing;
* ``loss_backend="chunked"`` (fused chunked ``lm_head`` + soft CE, the teacher recomputed per chunk);
* draft sequence parallelism (Ulysses) modelled from the code: per-step tensors at ``T/sp`` slots, the all-to-all
  transients, eager probabilities over the whole sequence.

Meta tensors have no values, so the census answers the unroll's few host reads as the all-ones masks it feeds
imply: ``any()`` of the "real slot after a padding slot" test is False, ``all()`` of "every row full" is True, and
``nonzero()`` of a step's supervised-slot mask has one row per slot written True (the census teacher supervises
every slot, the plan's worst case).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from test_parallel_memory_plan import MEDIUM, TINY, LiveBytes, k3_inputs, plan_inputs
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_eagle.draft import KimiK3Eagle3Draft
from lightning_eagle.parallel.memory import SkipInit
from lightning_eagle.parallel.memory_plan import PlanInputs
from lightning_eagle.parallel.memory_plan.draft_backward import unroll_peak
from lightning_eagle.parallel.memory_plan.draft_forward import (
    DraftDims,
    attention_core_saved,
    cache_entry_bytes,
    step_kept,
    unroll_shared_saved,
)
from lightning_eagle.parallel.memory_plan.draft_shapes import draft_shapes

aten = torch.ops.aten
_ANY = (aten.any.default, aten.any.dim, aten.any.dims)
_ALL = (aten.all.default, aten.all.dim, aten.all.dims)


class CensusBytes(LiveBytes):
    """:class:`LiveBytes` that answers host reads of meta tensors as the census's all-ones masks imply."""

    def __init__(self, ignore: set[int], true_counts: dict[int, int]) -> None:
        super().__init__(ignore)
        self.scalars: dict[int, bool] = {}  # storage of a 0-dim any()/all() result -> the value .item() reads
        self.true_counts = dict(true_counts)  # bool storage -> how many of its elements are True

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata not in self.refs and storage._cdata not in self.ignore:
            self.refs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = args[0] if args else None
        meta = isinstance(x, torch.Tensor) and x.is_meta
        if meta and func is aten._local_scalar_dense.default:
            return self.scalars[x.untyped_storage()._cdata]
        if meta and func is aten.nonzero.default:
            count = self.true_counts.get(x.untyped_storage()._cdata, x.numel())
            out = torch.empty(count, x.dim(), dtype=torch.long, device="meta")
            self._track(out)
            self.peak = max(self.peak, self.live())
            return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if meta and (func in _ANY or func in _ALL):
            self.scalars[out.untyped_storage()._cdata] = func in _ALL
        elif meta and func is aten.copy_.default and x.dtype == torch.bool:
            storage = x.untyped_storage()._cdata  # a slice of a zero mask set from an all-True one
            self.true_counts[storage] = self.true_counts.get(storage, 0) + x.numel()
        elif meta and func in (aten.zeros.default, aten.new_zeros.default) and out.dtype == torch.bool:
            self.true_counts[out.untyped_storage()._cdata] = 0
        return out


@contextlib.contextmanager
def meta_autocast_as_cpu():
    """The fused chunked loss records and re-enters the autocast state of its input's device, which torch has no
    notion of for ``meta``: answer as for CPU (autocast off there), which runs the same ops."""
    is_enabled, get_dtype, autocast = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast

    def cpu(device_type):
        return "cpu" if device_type == "meta" else device_type

    torch.is_autocast_enabled = lambda *device: is_enabled(*map(cpu, device))
    torch.get_autocast_dtype = lambda device: get_dtype(cpu(device))
    torch.autocast = lambda device_type, *a, **k: autocast(cpu(device_type), *a, **k)
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast = is_enabled, get_dtype, autocast


def unroll_census(inputs: PlanInputs) -> tuple[int, int]:
    """(bytes kept after the unroll's forward, peak during forward + backward) of the real ``ttt_loss`` on meta with
    ``inputs``' attention backend, TTT K/V cache, loss backend and checkpointing; ``.grad`` already allocated
    (gradient accumulation's steady state) and the inputs (teacher included) not counted."""
    from lightning_eagle.training.teacher import ChunkedTeacher, Teacher
    from lightning_eagle.training.ttt import checkpointed_draft_step, draft_step, ttt_loss

    B, T, N_d = inputs.batch_size, inputs.seq_len, inputs.draft.draft_vocab_size
    H_t = inputs.target.hidden_size
    with torch.device("meta"), SkipInit():
        draft = KimiK3Eagle3Draft(
            inputs.draft, attention_backend=inputs.attention_backend, ttt_kv_cache=inputs.ttt_kv_cache
        ).to(inputs.draft_dtype)
        for p in draft.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        ids, ones = torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long)
        aux = torch.zeros(B, T, 3 * H_t, dtype=inputs.target_dtype)
        pos = torch.ones(B, T, dtype=torch.bool)
        if inputs.loss_backend == "chunked":  # the training source: final hidden + the selected lm_head rows
            source = torch.zeros(B, T, H_t, dtype=inputs.target_dtype)
            head = torch.zeros(N_d, H_t, dtype=inputs.target_dtype)
            teacher = ChunkedTeacher(top=ids, pos=pos, draft_argmax=ids, source=source, head=head)
            teacher_tensors = [source, head]
        else:
            teacher = Teacher(torch.zeros(B, T, N_d), pos, ids)
            teacher_tensors = [teacher.probs]
    existing = [*draft.parameters(), *draft.buffers(), *(p.grad for p in draft.parameters() if p.grad is not None)]
    existing += [ids, ones, aux, pos, *teacher_tensors]
    mode = CensusBytes({t.untyped_storage()._cdata for t in existing}, {pos.untyped_storage()._cdata: B * T})
    step = checkpointed_draft_step if inputs.activation_checkpointing else draft_step
    with meta_autocast_as_cpu(), mode:
        out = ttt_loss(
            draft, ids, ones, ids, aux, teacher=teacher, ttt_steps=inputs.ttt_steps, draft_step_fn=step,
            loss_backend=inputs.loss_backend, loss_chunk=inputs.loss_chunk,
        )  # fmt: skip
        kept = mode.live()
        out.loss.backward()
    return kept, mode.peak


def planned(inputs: PlanInputs):
    d = DraftDims.of(inputs)
    shared = unroll_shared_saved(d, inputs.target_dtype, inputs.draft_dtype)
    return unroll_peak(d, inputs.activation_checkpointing, shared, draft_shapes(inputs.draft))


def k3(**changes) -> PlanInputs:
    return k3_inputs(seq_len=2048, ttt_steps=4, activation_checkpointing=True, **changes)


def quickstart(spec: dict, **changes) -> PlanInputs:
    return replace(plan_inputs(spec), device="cuda", **changes)  # meta runs the device-agnostic (CUDA) kernels


CASES = [
    # the census cases of test_parallel_memory_plan.py, with the host reads answered (flash_lse has no mask now)
    pytest.param(lambda: k3(), id="k3-ckpt-flash-no-mask"),
    pytest.param(lambda: k3_inputs(seq_len=256, ttt_steps=3, draft_dtype=torch.float32), id="k3-fp32-buffers"),
    pytest.param(lambda: quickstart(TINY), id="quickstart-eager"),
    # real K3 widths, T = 2048, K = 4, checkpointed
    pytest.param(lambda: k3(ttt_kv_cache="latent"), id="k3-ckpt-latent"),
    pytest.param(lambda: k3(loss_backend="chunked"), id="k3-ckpt-chunked"),
    pytest.param(lambda: k3(ttt_kv_cache="latent", loss_backend="chunked"), id="k3-ckpt-latent-chunked"),
    # without checkpointing, and in fp32 (x.float() is the tensor itself: other sharing)
    pytest.param(lambda: k3_inputs(seq_len=512, ttt_steps=3, ttt_kv_cache="latent"), id="k3-latent"),
    pytest.param(lambda: k3_inputs(seq_len=512, ttt_steps=3, loss_backend="chunked"), id="k3-chunked"),
    pytest.param(lambda: k3_inputs(seq_len=256, ttt_steps=3, draft_dtype=torch.float32, ttt_kv_cache="latent",
                                   loss_backend="chunked", loss_chunk=128), id="k3-fp32-latent-chunked"),
    # the quickstart-like specs with the new settings (several loss chunks per step)
    pytest.param(lambda: quickstart(TINY, ttt_kv_cache="latent"), id="quickstart-eager-latent"),
    pytest.param(lambda: quickstart(TINY, loss_backend="chunked", loss_chunk=512), id="quickstart-eager-chunked"),
    pytest.param(lambda: quickstart(TINY, attention_backend="flash_lse", ttt_kv_cache="latent",
                                    loss_backend="chunked", loss_chunk=512), id="quickstart-flash-latent-chunked"),
    pytest.param(lambda: quickstart(MEDIUM), id="medium-flash-no-mask"),
    pytest.param(lambda: quickstart(MEDIUM, ttt_kv_cache="latent", loss_backend="chunked", loss_chunk=256),
                 id="medium-latent-chunked"),
]  # fmt: skip


@pytest.mark.parametrize("inputs", CASES)
def test_unroll_terms_match_the_census_of_the_long_context_unroll(inputs):
    """Kept after the forward: every byte but the unroll's ``[B,T]`` bookkeeping (hit/chain masks, argmaxes: under
    0.05 %); the peak within 3 %."""
    inputs = inputs()
    kept, peak = unroll_census(inputs)
    plan = planned(inputs)
    assert plan.kept_after_forward == pytest.approx(kept, rel=1e-3)
    assert plan.peak == pytest.approx(peak, rel=0.03), plan.where


def test_each_mechanism_removes_what_it_should():
    """At the real K3 widths, T = 65536 on 8 sequence-parallel ranks: flash_lse plans no [T,T] mask; the chunked loss
    keeps nothing [*,N_d]-sized per step; a checkpointed latent entry is (2r + d_rope) values per token instead of
    n·(d_qk + d_nope + d_v) (SP: n·(d_qk + d_v), head-sharded copies)."""
    base = dict(seq_len=65536, world=64, ep=64, activation_checkpointing=True)
    flash = DraftDims.of(k3_inputs(**base, draft_sp=8))
    eager = DraftDims.of(k3_inputs(**base, draft_sp=8, attention_backend="eager"))
    assert (flash.T, flash.T_keys) == (8192, 65536)
    assert unroll_shared_saved(flash, torch.bfloat16, torch.bfloat16) == 0
    assert unroll_shared_saved(eager, torch.bfloat16, torch.bfloat16) == 65536**2 * 2
    # eager's probabilities span every key: [B, n/sp, T, T+k] = [B, n, T/sp, T+k] bytes
    assert attention_core_saved(eager, 0) > flash.n * flash.T * 65536 * 4
    chunked = DraftDims.of(k3_inputs(**base, draft_sp=8, loss_backend="chunked"))
    per_step = step_kept(flash, 1, True) - step_kept(chunked, 1, True)
    assert per_step > chunked.BT * chunked.N_d * 4  # the log-probs [B,T/sp,N_d] fp32 are gone
    # and what is left is the hidden the fused loss saves, its row indices and the cache entry
    assert step_kept(chunked, 1, True) == chunked.BT * (7168 * 2 + 8) + cache_entry_bytes(chunked)
    latent = DraftDims.of(k3_inputs(**base, ttt_kv_cache="latent"))
    assert cache_entry_bytes(latent) == latent.BT * (2 * 512 + 64) * 2
    assert cache_entry_bytes(flash) == flash.BT * 96 * (192 + 128) * 2
    plain = DraftDims.of(k3_inputs(**base))
    assert cache_entry_bytes(plain) == plain.BT * 96 * (192 + 128 + 128) * 2


def test_sequence_parallel_adds_the_exchanges_and_shrinks_the_rest():
    """Ulysses at sp = 8: the unroll has the all-to-all stages, and its peak is far below the one-rank unroll of the
    whole sequence (per-token tensors at T/sp; the attention tiles at n/sp heads over all keys)."""
    base = dict(seq_len=16384, ttt_steps=4, world=8, ep=8, activation_checkpointing=True, loss_backend="chunked")
    shapes = None
    peaks = {}
    for sp in (1, 8):
        inputs = k3_inputs(**base, draft_sp=sp)
        shapes = shapes or draft_shapes(inputs.draft)
        d = DraftDims.of(inputs)
        peaks[sp] = unroll_peak(d, True, unroll_shared_saved(d, inputs.target_dtype, inputs.draft_dtype), shapes)
    assert not any("exchange" in stage for stage in peaks[1].stages)
    assert sum("attention exchange" in stage for stage in peaks[8].stages) == 4
    gradients = shapes.unrolled * 2  # the unrolled gradient buffers do not shrink with the slots
    assert peaks[8].peak - gradients < (peaks[1].peak - gradients) / 4


def test_latent_cache_with_sequence_parallelism_is_refused():
    inputs = k3_inputs(seq_len=4096, world=8, ep=8, draft_sp=2, ttt_kv_cache="latent")
    with pytest.raises(ValueError, match="ttt_kv_cache='latent' needs draft_sequence_parallel_size=1"):
        DraftDims.of(inputs)
