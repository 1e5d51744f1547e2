"""Per-rank **peak** memory of a draft-training run, planned from its config: will it fit the GPUs?

``python -m lightning_eagle.parallel.memory --config kimi_k3_eagle3 --gpu-gb 80 --target-config k3`` prints every
term below (decimal GB) and, last, ``fits: …`` or ``does not fit: …`` with the smallest cluster that fits.

A training step goes through four phases, each with its own transient memory on top of what every rank holds for
the whole run (``resident``). The plan is ``resident + max over phases``:

==================  ======================================================================================
resident            target dense weights (replicated, or this rank's FSDP2 shard), routed experts of this EP
                    rank (MXFP4-packed or dequantised), draft parameters, AdamW states (2 per trainable
                    parameter, in the parameter dtype: torch AdamW keeps ``exp_avg``/``exp_avg_sq`` like the
                    parameter and this library keeps no fp32 master copy, so a bf16 draft has bf16 states;
                    a float32 draft has float32 ones), gradients kept between micro-batches (gradient
                    accumulation), a runtime reserve.
target forward      no-grad capture: FSDP2 gathers (the running unit + the prefetched next one), the residual
                    stream, AttnRes bank and aux taps, and the largest per-layer working set (AttnRes mix, KDA
                    chunk form, MLA through SDPA, dense SiTU MLP, or the MoE layer: expert-parallel dispatch
                    buffers, the (token, slot) pairs of the grouped expert forward, one layer's local experts
                    decoded from MXFP4, the fp32 combine).
teacher             the full ``lm_head`` gathered for the chunked teacher, one logit tile, the ``[B,T,N_d]``
                    fp32 teacher.
draft unroll        the K-step TTT forward and backward: what autograd saves per step (or, with activation
                    checkpointing, each step's input plus one step recomputed in the backward), the K/V cache,
                    the per-step fp32 log-probabilities the loss keeps, and the backward's working set
                    (gradient buffers, attention backward).
optimizer step      gradients + the optimizer's temporaries.
==================  ======================================================================================

Where the numbers come from. Parameter counts come from the real modules built on the meta device (target: one
decoder layer per kind, :mod:`lightning_eagle.parallel.memory`; draft: the whole
:class:`~lightning_eagle.draft.KimiK3Eagle3Draft`). Activation terms are derived from the code of the forward and
backward (each function names the tensors it counts and why they are alive): an op saves the inputs its backward
needs; ``x.float()`` of an fp32 tensor is the tensor itself; a view keeps its base storage alive.
``tests/parallel/test_parallel_memory_plan.py`` checks them two ways: against a census of the real draft unroll on
the meta device (every storage alive after each op, exactly: "kept after the forward" equal, the unroll peak within
3 %, at the real K3 widths too), and against the peak RSS measured on CPU for a tiny and a medium K3 (within 15 %;
the medium run is within 2 % on every phase).

The grouped expert forward. Under expert parallelism a rank receives each token of the group that needs any of its
experts; ``RoutedExperts.forward`` computes only the (row, slot) pairs routed to its own experts (expanding every
received row into all ``k`` slots would cost ≈ 14× more at EP 64 on the real K3: ~112 GB of transients).

Stated assumptions (none can be derived from a config): a micro-batch is ``batch_size`` rows of exactly
``max_length`` tokens (the worst case of right-padded batches); routing is uniform, with the hottest
expert-parallel rank receiving ``moe_load_factor`` times the expected rows; FSDP2 keeps at most two units gathered;
the CUDA runtime (context, NCCL buffers, allocator fragmentation) takes a fixed ``reserve``. ``device="cpu"`` plans
the CPU kernels instead (fused CPU flash attention, single-tensor AdamW), for the measured validation.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.draft.config import DEFAULT_TTT_STEPS, Eagle3DraftConfig
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.kda_ops import safe_chunk_size
from lightning_eagle.parallel.memory import GB, TargetShapes, _SkipInit, check_ep_size, routed_bytes, target_shapes

RESIDENT = "resident"
PHASES = ("target forward", "teacher", "draft unroll", "optimizer step")
MODELLED_BACKENDS = ("eager", "flash_lse")
EXPERT_STORAGES = ("dequantized", "mxfp4")
FP32 = 4  # bytes


# ---- what the plan is computed from ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads from a run config (:func:`run_config_from_yaml`), plus the stated assumptions."""

    target: KimiK3TextConfig
    draft: Eagle3DraftConfig  # built with the run's overrides; ``draft_vocab_size`` is N_d
    world: int = 1
    ep: int = 1
    shard_dense: bool | None = None  # None: on when world > 1 (the strategy's default)
    draft_shard: bool = False
    target_dtype: torch.dtype = torch.bfloat16
    expert_storage: str = "mxfp4"
    draft_dtype: torch.dtype = torch.bfloat16
    batch_size: int = 1
    seq_len: int = 4096
    ttt_steps: int = DEFAULT_TTT_STEPS
    attention_backend: str = "flash_lse"
    activation_checkpointing: bool = False
    accumulate_grad_batches: int = 1
    teacher_vocab_chunk: int = 16384
    teacher_seq_chunk: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None  # None: the draft config's
    device: str = "cuda"
    moe_load_factor: float = 1.25
    reserve_bytes: int = int(4 * GB)

    def __post_init__(self) -> None:
        check_ep_size(self.target, self.ep)
        if self.world < 1 or self.world % self.ep:
            raise ValueError(f"expert_parallel_size ({self.ep}) must divide the world size ({self.world})")
        if self.attention_backend not in MODELLED_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is not modelled by the memory plan; "
                f"choose one of {MODELLED_BACKENDS}"
            )
        unmodelled = {"architecture": "k3", "fc_norm": False, "norm_output": False}
        for name, value in unmodelled.items():
            if getattr(self.draft, name) != value:
                raise ValueError(f"draft {name}={getattr(self.draft, name)!r} is not modelled by the memory plan")
        if self.expert_storage not in EXPERT_STORAGES:
            raise ValueError(f"target_expert_storage must be one of {EXPERT_STORAGES}, got {self.expert_storage!r}")

    @property
    def dense_sharded(self) -> bool:
        return self.shard_dense if self.shard_dense is not None else self.world > 1

    @property
    def taps(self) -> tuple[int, ...]:
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else self.draft.aux_layer_ids
        return tuple(ids or ())


@dataclass(frozen=True)
class Term:
    phase: str
    name: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    terms: tuple[Term, ...]

    def phase_bytes(self, phase: str) -> int:
        return sum(t.nbytes for t in self.terms if t.phase == phase)

    @property
    def resident_bytes(self) -> int:
        return self.phase_bytes(RESIDENT)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.phase_bytes(self.peak_phase)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)


# ---- the draft's parameters, counted on the meta device -------------------------------------------------------------
# Trainable parameters by the order their gradients appear when one TTT step is back-propagated (the reverse of the
# forward): lm_head and the final norm, the MLP and its norm, the attention output projections, the rest of the layer.
_BACKWARD_GROUPS = {
    "head": ("lm_head.", "norm."),
    "mlp": ("midlayer.mlp.", "midlayer.post_attention_layernorm."),
    "attention output": ("midlayer.self_attn.o_proj.", "midlayer.self_attn.g_proj."),
    "attention input": ("midlayer.", "embed_tokens."),
}


@dataclass(frozen=True)
class DraftShapes:
    """The draft's parameters (numel) by role, from the real module."""

    trainable: int
    frozen: int
    buffer_bytes: int  # d2t (int64) + t2d (bool)
    largest_trainable: int  # numel of the largest trainable parameter
    projection: int  # fc (+ fc_norm): used once per unroll, not by every TTT step
    groups: tuple[tuple[str, int, int], ...]  # (group, numel, largest numel) of the per-step trainables, backward order

    @property
    def unrolled(self) -> int:
        """Trainable numel used by every TTT step: autograd sums each one's K gradients in one buffer."""
        return sum(numel for _, numel, _ in self.groups)


def draft_shapes(config: Eagle3DraftConfig) -> DraftShapes:
    """Build the real draft on the meta device (no init) and count its parameters by role."""
    from lightning_eagle.draft import KimiK3Eagle3Draft

    with torch.device("meta"), _SkipInit():
        draft = KimiK3Eagle3Draft(config)
    trainable = {n: p.numel() for n, p in draft.named_parameters() if p.requires_grad}
    grouped: dict[str, list[int]] = {g: [] for g in _BACKWARD_GROUPS}
    projection = 0
    for name, numel in trainable.items():
        group = next((g for g, prefixes in _BACKWARD_GROUPS.items() if name.startswith(prefixes)), None)
        if group is None:  # fc, fc_norm
            projection += numel
        else:
            grouped[group].append(numel)
    return DraftShapes(
        trainable=sum(trainable.values()),
        frozen=sum(p.numel() for p in draft.parameters() if not p.requires_grad),
        buffer_bytes=sum(b.numel() * b.element_size() for b in draft.buffers()),
        largest_trainable=max(trainable.values(), default=0),
        projection=projection,
        groups=tuple((g, sum(sizes), max(sizes, default=0)) for g, sizes in grouped.items()),
    )


# ---- draft activation shapes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftDims:
    """The sizes the TTT unroll's tensors are made of. ``s``: draft dtype bytes; ``s_t``: target dtype bytes."""

    B: int
    T: int
    K: int
    H: int  # draft hidden
    H_t: int  # target hidden (aux states are [B,T,3·H_t])
    n: int  # heads
    d_nope: int
    d_rope: int
    d_v: int
    q_lora: int | None
    kv_lora: int
    I: int  # noqa: E741  (MLP width)
    N_d: int  # draft vocabulary
    V: int  # target vocabulary
    s: int
    s_t: int
    gate: bool
    backend: str
    cpu: bool

    @classmethod
    def of(cls, inputs: PlanInputs) -> DraftDims:
        c = inputs.draft
        return cls(
            B=inputs.batch_size,
            T=inputs.seq_len,
            K=inputs.ttt_steps,
            H=c.hidden_size,
            H_t=c.target_hidden_size or c.hidden_size,
            n=c.num_attention_heads,
            d_nope=c.qk_nope_head_dim,
            d_rope=c.qk_rope_head_dim,
            d_v=c.v_head_dim,
            q_lora=c.q_lora_rank,
            kv_lora=c.kv_lora_rank,
            I=c.intermediate_size,
            N_d=c.draft_vocab_size,
            V=c.vocab_size,
            s=inputs.draft_dtype.itemsize,
            s_t=inputs.target_dtype.itemsize,
            gate=c.mla_use_output_gate,
            backend=inputs.attention_backend,
            cpu=inputs.device == "cpu",
        )

    @property
    def d_qk(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def BT(self) -> int:
        return self.B * self.T

    @property
    def fp32(self) -> bool:
        return self.s == FP32


# ---- the draft's forward: what autograd keeps per TTT step ----------------------------------------------------------
def norm_saved(d: DraftDims, width: int, input_needs_grad: bool = True, input_is_kept: bool = False) -> int:
    """One K3 RMSNorm over ``[B,T,width]`` with a trainable weight (``ops/norm.py``), plus its output (which the
    next Linear saves as its input). ``x32 = x.float()`` and the row ``rsqrt`` are saved by the pow/mul when ``x``
    needs grad — in fp32 ``x32`` is ``x`` itself, counted elsewhere when ``input_is_kept``; ``normed`` is saved by
    ``weight * normed``; the output is a new tensor."""
    x32 = 0 if not input_needs_grad or input_is_kept else d.BT * width * FP32
    rsqrt = d.BT * FP32 if input_needs_grad else 0
    return x32 + rsqrt + 2 * d.BT * width * d.s


def cache_entry_bytes(d: DraftDims) -> int:
    """The K/V one step appends (``ops/mla.py`` ``project``): ``k`` = cat(k_nope, k_rot) ``[B,n,T,d_qk]`` is a new
    tensor; ``v`` is a view of the ``kv_b_proj`` output, so the cache keeps that whole ``[B,T,n·(d_nope+d_v)]``."""
    return d.BT * d.n * (d.d_qk + d.d_nope + d.d_v) * d.s


def attention_projection_saved(d: DraftDims) -> int:
    """``combined [B,T,2H]`` (saved by q_a / kv_a / g_proj), the q path and the kv latent path, and ``q`` itself
    (saved by the attention core; it is a view of the ``q_b_proj`` output)."""
    combined = d.BT * 2 * d.H * d.s
    q_path = 0 if d.q_lora is None else norm_saved(d, d.q_lora)
    q = d.BT * d.n * d.d_qk * d.s
    # kv_a_layernorm reads the latent slice of the kv_a output: its fp32 "copy" is a view of the whole output in fp32.
    latent_x32 = d.BT * (d.kv_lora + d.d_rope) * FP32 if d.fp32 else d.BT * d.kv_lora * FP32
    kv_path = latent_x32 + norm_saved(d, d.kv_lora, input_is_kept=True)
    return combined + q_path + q + kv_path


def attention_core_saved(d: DraftDims, k: int) -> int:
    """What the TTT attention of step ``k`` keeps besides q and the cache (``draft/ttt_attention.py``).

    ``flash_lse``: the output ``[B,n,T,d_v]`` and the fp32 LSE ``[B,n,T]`` (the fused CPU kernel's step-0 output is
    a view of its padded ``[B,n,T,max(d_qk,d_v)]`` result). ``eager``: the fp32 probabilities ``[B,n,T,T+k]`` (and
    their cast to the draft dtype, which the two matmuls save), and for ``k ≥ 1`` the stacked later-step K/V and a
    contiguous copy of ``q`` that the diagonal einsums save."""
    if d.backend == "flash_lse":
        width = max(d.d_qk, d.d_v) if (d.cpu and k == 0) else d.d_v
        return d.BT * d.n * (width * d.s + FP32)
    probs = d.B * d.n * d.T * (d.T + k) * (FP32 if d.fp32 else FP32 + d.s)
    diagonal = (k * (d.d_qk + d.d_v) + d.d_qk) * d.BT * d.n * d.s if k else 0
    return probs + diagonal


def attention_output_saved(d: DraftDims) -> int:
    """``o`` reshaped to ``[B,T,n·d_v]`` (a copy), and with the gate ``σ(g_proj(x))`` and ``o·σ`` (``gate_output``)."""
    return (3 if d.gate else 1) * d.BT * d.n * d.d_v * d.s


def situ_saved(d: DraftDims) -> int:
    """SiTU (``ops/situ.py``) keeps six fp32 ``[B,T,I]`` tensors (the two tanh results, the capped gate, the sigmoid,
    their product, the capped up branch) and the cast result that ``down_proj`` saves."""
    return (6 * FP32 + d.s) * d.BT * d.I


def loss_saved(d: DraftDims, k: int) -> int:
    """``log_softmax(logits.float())`` of the supervised slots ``[B,T−k,N_d]`` in fp32, kept until the backward:
    every step's loss is computed in the loop and back-propagated once at the end."""
    return d.B * (d.T - k) * d.N_d * FP32


def step_saved_parts(d: DraftDims, k: int) -> dict[str, int]:
    """What autograd keeps for TTT step ``k`` (its K/V cache entry excluded), by part of the layer.

    The step input ``h`` (step 0: ``fc`` output; later: the previous step's output) is kept by ``hidden_norm``; in
    fp32 that is the previous step's final-norm input, already counted there. The embedding is frozen, so
    ``input_layernorm`` keeps only its ``normed``."""
    hidden_kept = d.fp32 and k > 0
    norms = (
        # input_layernorm and hidden_norm: their outputs are concatenated (only `combined` is saved)
        norm_saved(d, d.H, input_needs_grad=False) - d.BT * d.H * d.s
        + norm_saved(d, d.H, input_is_kept=hidden_kept) - d.BT * d.H * d.s
        + norm_saved(d, d.H)  # post_attention_layernorm: its input h (mid-step residual) is new
        + norm_saved(d, d.H)  # final norm (logits): the step output
    )  # fmt: skip
    return {
        "norms": norms,
        "attention projections": attention_projection_saved(d),
        "attention core": attention_core_saved(d, k),
        "attention output": attention_output_saved(d),
        "SiTU MLP": situ_saved(d),
        "loss": loss_saved(d, k),
    }


def checkpointed_step_kept(d: DraftDims, k: int) -> int:
    """With activation checkpointing (``training/ttt.py`` ``checkpointed_draft_step``) a step keeps its input
    hidden (for the recompute; in fp32 it is the previous step's final-norm input), and outside the checkpoint
    the final norm before ``lm_head`` and the loss's log-probabilities."""
    hidden = 0 if (d.fp32 and k > 0) else d.BT * d.H * d.s
    return hidden + norm_saved(d, d.H) + loss_saved(d, k)


def unroll_shared_saved(d: DraftDims, target_dtype: torch.dtype, draft_dtype: torch.dtype) -> int:
    """Kept once per unroll: the additive ``[B,1,T,T]`` causal ∧ padding mask in the draft dtype (built once by the
    cache), and ``fc``'s input cast to the draft dtype when the aux states come in another dtype."""
    mask = d.B * d.T * d.T * d.s
    cast = d.BT * 3 * d.H_t * d.s if target_dtype != draft_dtype else 0
    return mask + cast


def cache_entry_kept(d: DraftDims, k: int, checkpointing: bool) -> int:
    """Cache entry ``k`` after the forward: ``flash_lse`` saves every entry as it is (later entries individually);
    ``eager`` saves entry 0 and *stacked copies* of the later ones (counted in :func:`attention_core_saved`), so the
    originals die with the cache list; a checkpointed step keeps every entry as an input of its recompute."""
    if d.backend == "eager" and not checkpointing and k > 0:
        return 0
    return cache_entry_bytes(d)


def step_kept(d: DraftDims, k: int, checkpointing: bool) -> int:
    """Everything step ``k`` keeps at the end of the forward, its cache entry included."""
    saved = checkpointed_step_kept(d, k) if checkpointing else sum(step_saved_parts(d, k).values())
    return saved + cache_entry_kept(d, k, checkpointing)


def unroll_kept_after_forward(d: DraftDims, checkpointing: bool, shared: int) -> int:
    """Everything the K steps keep at the end of the forward (what the backward starts from)."""
    return shared + sum(step_kept(d, k, checkpointing) for k in range(d.K))


# ---- the draft's backward -------------------------------------------------------------------------------------------
def loss_backward_ws(d: DraftDims, k: int) -> int:
    """Soft-CE backward of step ``k``: the gradients w.r.t. the fp32 log-probs and the fp32 logits, ``[B,T−k,N_d]``
    each, are alive together."""
    return 2 * d.B * (d.T - k) * d.N_d * FP32


def mlp_backward_ws(d: DraftDims) -> int:
    """SiTU backward: the ``down_proj`` input gradient (draft dtype) and two fp32 ``[B,T,I]`` gradients at once."""
    return (d.s + 2 * FP32) * d.BT * d.I


def attention_backward_ws(d: DraftDims, k: int) -> int:
    """Backward of step ``k``'s TTT attention (``_LSEMergedTTTAttention.backward`` / eager autograd).

    ``flash_lse``: the block kernel's backward — on CUDA the chunked kernel holds fp32 ``k, v`` copies, fp32
    ``dq, dk, dv`` and six fp32 ``[B,n,256,T]`` score tiles; the fused CPU kernel pads grad/q/k/v/out to one width
    and returns padded grads — or the diagonal part after it: the stacked later-step K/V in fp32, their fp32
    gradients and the casts back (``k·[B,n,T,d_qk+d_v]·(4+4+s)``), fp32 ``q``/``dO``, and the kernel's returned
    grads. ``eager``: the gradients of the ``[B,n,T,T+k]`` probabilities (see below) and the stacked later-step K/V
    gradients."""
    BTn = d.BT * d.n
    if d.backend == "eager":
        # The two slices' zero-filled gradients and the block matmul's gradient (3 in the draft dtype), or later the
        # summed gradient with its fp32 copy and the fp32 softmax backward.
        probs = d.B * d.n * d.T * (d.T + k)
        return probs * max(3 * d.s, d.s + 2 * FP32) + k * BTn * (d.d_qk + d.d_v) * d.s
    if d.cpu:
        kernel = 6 * BTn * max(d.d_qk, d.d_v) * d.s
    else:
        # Per 256-query chunk: the previous chunk's probs/dP/dS are still referenced while the next chunk's scores,
        # scores − LSE and exp are formed: six fp32 [B,n,256,T] tiles (one chunk only: four).
        tiles = (6 if d.T > 256 else 4) * d.B * d.n * min(256, d.T) * d.T * FP32
        kernel = BTn * ((d.d_qk + d.d_v) * FP32 + (2 * d.d_qk + d.d_v) * FP32 + d.d_v * d.s) + tiles
    if k == 0:
        return kernel
    returned = BTn * (2 * d.d_qk + d.d_v) * d.s
    diagonal = k * BTn * (d.d_qk + d.d_v) * (2 * FP32 + d.s) + BTn * (d.d_qk + d.d_v) * FP32 + returned
    return max(kernel, diagonal)


def situ_forward_ws(d: DraftDims, saved: bool) -> int:
    """Transient of one SiTU forward beyond what it saves: the gate/up Linear outputs, their fp32 copies (not in
    fp32) and one temporary; without saving (a checkpointed step's first forward) all its fp32 intermediates."""
    copies = 0 if d.fp32 else 2 * FP32
    return (2 * d.s + copies + (1 if saved else 4) * FP32) * d.BT * d.I


@dataclass(frozen=True)
class UnrollPeak:
    kept_after_forward: int
    peak: int  # the unroll's own peak (gradient buffers included), on top of resident and inputs
    where: str
    stages: dict[str, int] = field(default_factory=dict)


def last_step_forward(d: DraftDims, checkpointing: bool, shared: int, kept: list[int]) -> int:
    """The forward's own peak: the last step's SiTU, before its final norm and loss exist (eager: the cache list,
    whose later entries the unroll drops on return, is still alive)."""
    peak = shared + sum(kept) - loss_saved(d, d.K - 1) - norm_saved(d, d.H) + situ_forward_ws(d, not checkpointing)
    if d.backend == "eager" and not checkpointing:
        peak += (d.K - 1) * cache_entry_bytes(d)
    return peak


def step_backward_stages(
    d: DraftDims, j: int, checkpointing: bool, shared: int, kept: list[int], shapes: DraftShapes
) -> dict[str, int]:
    """Live bytes at the worst point of each stage of back-propagating step ``j`` (loss → ``lm_head`` → MLP →
    attention output → attention core), with steps ``> j`` already freed.

    Gradient buffers: a parameter used by every step gets one, created while step K−1 is back-propagated (one
    weight at a time); each later step adds its new gradient out of place (new gradient + sum in flight). The
    gradients w.r.t. the cached K/V of steps ``≤ j`` wait in buffers until their step."""
    s, first = d.s, j == d.K - 1
    groups = {name: (numel * s, largest * s) for name, numel, largest in shapes.groups}

    def in_flight(group: str) -> int:
        return groups[group][1] * (1 if first else 2)

    def created(group: str) -> int:
        return groups[group][0] if first else 0

    parts = step_saved_parts(d, j)
    final_norm = norm_saved(d, d.H)
    buffers = 0 if first else shapes.unrolled * s + (j + 1) * d.BT * d.n * (d.d_qk + d.d_v) * s
    live = shared + sum(kept[: j + 1]) + buffers
    logits_grad = d.B * d.T * d.N_d * s
    stages = {"loss / lm_head": live + max(loss_backward_ws(d, j), logits_grad + in_flight("head"))}
    live += created("head") - loss_saved(d, j) - final_norm
    if checkpointing:  # the step's forward again, saving this time, with a second copy of its K/V
        live += sum(parts.values()) - parts["loss"] - final_norm + cache_entry_bytes(d)
        stages["recompute"] = live + situ_forward_ws(d, saved=True)
    stages["MLP"] = live + max(d.BT * d.I * s + in_flight("mlp"), mlp_backward_ws(d))
    live += created("mlp") - parts["SiTU MLP"] - norm_saved(d, d.H) - parts["attention output"]
    live += created("attention output")
    stages["attention"] = live + attention_backward_ws(d, j)
    return {f"{stage} backward of step {j}": value for stage, value in stages.items()}


def unroll_peak(d: DraftDims, checkpointing: bool, shared: int, shapes: DraftShapes) -> UnrollPeak:
    """The draft unroll's peak over its forward and a backward followed step by step (``j = K−1 … 0``; autograd
    back-propagates the last step first). The last candidate is ``fc``'s gradient, once per unroll, at the end."""
    kept = [step_kept(d, k, checkpointing) for k in range(d.K)]
    stages = {"last step forward": last_step_forward(d, checkpointing, shared, kept)}
    for j in reversed(range(d.K)):
        stages.update(step_backward_stages(d, j, checkpointing, shared, kept, shapes))
    stages["fc backward"] = shared + kept[0] + (shapes.unrolled + shapes.projection) * d.s
    where = max(stages, key=stages.__getitem__)
    return UnrollPeak(kept_after_forward=shared + sum(kept), peak=stages[where], where=where, stages=stages)


# ---- the target's forward (no grad) -------------------------------------------------------------------------------
def situ_nograd_ws(rows: int, width: int, s: int) -> int:
    """A SiTU MLP's ``gate``/``up`` outputs ``[rows, width]`` plus the fp32 intermediates ``situ_and_mul`` holds at
    once without autograd: the fp32 copies (not in fp32), the capped gate, its product with the sigmoid, and the
    up branch's tanh with its capped result."""
    return rows * width * (2 * s + 4 * FP32 + (0 if s == FP32 else 2 * FP32))


def attn_res_mix_ws(N: int, H: int, m: int) -> int:
    """``attn_res_mix`` over ``m`` bank entries and the prefix: the fp32 stacked values, their RMS-normalised keys and
    the weighted values, each ``[N, m+1, H]``."""
    return 3 * (m + 1) * N * H * FP32


def kda_chunk_ws(config: KimiK3TextConfig, N: int, s: int) -> int:
    """KDA token mixer with the plain-torch chunk form (``k3/kda.py`` + ``kda_ops.chunk_kda``), no padding mask; ``u``
    = one fp32 ``[N, n·d]`` tensor. The forward keeps the three raw projections (``projections``, only needed for
    ``output_final_state``) and the three conv+SiLU streams, the L2-normalised q/k and the decay (9u); ``chunk_kda``
    adds the cumulative decay, its exp, k̃, k̂, q̃ (5u), the ``[v|k̃]`` right-hand side (2u) and the row-by-row solve
    (≈ 6u: new rows, their stack and the product with ``L``) — 22u, plus three ``[N, n, C]`` in-chunk matrices."""
    lac = config.linear_attn_config
    n, d = lac["num_heads"], lac["head_dim"]
    chunk = safe_chunk_size(float(lac["gate_lower_bound"]), max_chunk=16)
    u = N * n * d * FP32
    return 22 * u + 3 * N * n * chunk * FP32 + N * n * d * s


def mla_sdpa_ws(config: KimiK3TextConfig, N: int, s: int) -> int:
    """MLA through SDPA (``ops/mla.py``): q, the ``kv_b_proj`` output (v is a view of it), k, v zero-padded to the qk
    width and the padded output are alive at once, then the output reshaped, the gate and the gated product."""
    n, dqk, dv = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    width = max(dqk, dv)
    kv_b = config.qk_nope_head_dim + dv
    return N * n * s * (2 * dqk + kv_b + (width if dv != width else 0) + width + 4 * dv)


@dataclass(frozen=True)
class MoEShape:
    """Rows a rank's experts see in one MoE layer and the (token, slot) pairs of its grouped forward."""

    rows_sent: int  # S: rows this rank sends (a token once per EP rank that owns one of its experts)
    rows_received: int  # M: rows this rank's experts run on
    pairs: int  # (token, slot) pairs the grouped expert forward computes


def moe_shape(config: KimiK3TextConfig, N: int, ep: int, load_factor: float) -> MoEShape:
    """Expected rows under uniform routing: a token needs EP rank r unless none of its k experts is among r's
    ``E/ep`` (probability ``C(E−E/ep, k)/C(E, k)``); the hottest rank receives ``load_factor`` times the mean
    (capped at every token of the group).

    Pairs: ``RoutedExperts.forward`` (``k3/experts.py``) computes only the slots routed to this rank's experts:
    ``N·k`` on average per rank (the group's ``ep·N·k`` slots spread over ``ep`` ranks), times the load factor."""
    E, k = config.num_experts, config.num_experts_per_token
    if ep == 1:
        return MoEShape(rows_sent=0, rows_received=N, pairs=N * k)
    miss = math.comb(E - E // ep, k) / math.comb(E, k)
    sent = math.ceil(N * ep * (1 - miss))
    received = min(math.ceil(sent * load_factor), N * ep)
    local = math.ceil(N * k * load_factor)
    return MoEShape(rows_sent=sent, rows_received=received, pairs=local)


def decode_ws(weights: int, s: int) -> tuple[int, int]:
    """(peak while decoding, held while computing) for one layer's local MXFP4 experts (``k3/mxfp4.py``): decoding a
    tensor of ``w`` weights holds its fp32 values (4 B/weight), the int32 nibble indices and the looked-up fp32 values
    of half of them (2 + 2 B/weight): 8 B per weight; gate_up (2/3 of the weights) is decoded first, then down while
    the decoded gate_up (``s`` B/weight) is alive. Then the decoded layer is held through its GEMMs."""
    gate_up, down = 2 * weights // 3, weights // 3
    return max(8 * gate_up, s * gate_up + 8 * down), s * weights


def routed_experts_ws(inputs: PlanInputs, N: int, experts_per_rank: int) -> tuple[int, str]:
    """One MoE layer's routed part on this rank: the expert-parallel dispatch buffers (``parallel/dispatcher.py``: the
    rows sent, received and unpacked, each ``[H_l]`` in the target dtype plus the top-k ids and weights), then the
    grouped expert forward over ``P`` pairs (``k3/experts.py``: sort indices, the gathered ``[P, H_l]`` rows, the
    ``[P, 2I]`` gate/up product and the SiTU intermediates, or later the down output, its reordering and fp32
    weighting) with one layer's local experts decoded — or the fp32 combine of the partial sums."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    Hl, Ie, k = c.expert_hidden_size, c.moe_intermediate_size, c.num_experts_per_token
    shape = moe_shape(c, N, inputs.ep, inputs.moe_load_factor)
    P = shape.pairs
    weights = experts_per_rank * 3 * Hl * Ie
    if inputs.expert_storage == "mxfp4":
        decoding, decoded = decode_ws(weights, s)
    else:
        decoding = decoded = 0  # the stored parameters are used as they are
    row = Hl * s + k * (8 + 4)  # x, topk_idx (int64), topk_weight (fp32), packed into one byte row
    dispatch = (shape.rows_sent + 2 * shape.rows_received) * row if inputs.ep > 1 else 0
    indices = P * (4 * 8 + 1)  # local ids, sort key, sorted keys, order (int64) and the valid mask
    pairs = P * Hl * s
    compute = max(
        decoded + situ_nograd_ws(P, Ie, s),  # the [P, 2I] gate/up product and SiTU's intermediates
        decoded + P * (3 * Ie * s + Hl * s),  # down GEMM: gate/up product, SiTU output, down output
        decoded + P * Hl * (2 * s + 2 * FP32),  # masked/reordered output, fp32 copy and weighted
        decoding,
    )
    # After the experts, the fp32 partial sums travel back and are combined: [M], [S] and [N] rows at the latent width.
    combine = (shape.rows_received + shape.rows_sent + N) * Hl * FP32 if inputs.ep > 1 else 0
    note = f"{P:,} (token, slot) pairs"
    if inputs.ep > 1:
        note += f" from {shape.rows_received:,} received rows (load factor {inputs.moe_load_factor})"
    return dispatch + max(indices + pairs + compute, combine), note


@dataclass(frozen=True)
class LayerPeak:
    """The target forward at its worst layer: what is held there and the layer's own working set."""

    index: int  # -1: the embedding, L: the output mixer and final norm
    stream: int  # residual prefix, AttnRes bank, aux taps captured so far, masks
    gathers: int  # FSDP2: this unit + the prefetched next one, gathered
    working_set: int
    kind: str  # what dominates the working set
    moe_note: str = ""

    @property
    def total(self) -> int:
        return self.stream + self.gathers + self.working_set


def moe_layer_ws(inputs: PlanInputs, N: int) -> tuple[int, str, str]:
    """(bytes, which part, note) of one MoE channel mixer (``k3/moe.py``) on ``N`` tokens, its input excluded: the
    latent input ``z`` and the top-k routing with the routed experts; or later the shared experts' SiTU beside the
    combined routed output."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    routed, note = routed_experts_ws(inputs, N, c.num_experts // inputs.ep)
    routing = N * c.num_experts_per_token * (8 + 4) + N * c.expert_hidden_size * s
    parts = {
        "MoE routed experts": routing + routed,
        "MoE shared experts": N * c.hidden_size * s
        + situ_nograd_ws(N, c.num_shared_experts * c.moe_intermediate_size, s),
    }
    part = max(parts, key=parts.__getitem__)
    return parts[part], part, note


def layer_working_set(inputs: PlanInputs, i: int, bank: int) -> tuple[int, str, str]:
    """(bytes, what dominates, MoE note) of decoder layer ``i``'s forward beyond the residual stream: the AttnRes
    mixes (``a_in`` stays alive for the whole layer), the token mixer on its normalised input, the channel mixer on
    its normalised input (beside the mix ``m_in``)."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    N, H = inputs.batch_size * inputs.seq_len, c.hidden_size
    row = N * H * s
    attn_res = c.attn_res_block_size is not None
    token = kda_chunk_ws(c, N, s) if c.is_kda(i) else mla_sdpa_ws(c, N, s)
    candidates = {("KDA chunk form" if c.is_kda(i) else "MLA (SDPA)"): row + token}
    note = ""
    if c.is_moe(i):
        moe, part, note = moe_layer_ws(inputs, N)
        candidates[part] = 2 * row + moe
    else:
        candidates["dense SiTU MLP"] = 2 * row + situ_nograd_ws(N, c.intermediate_size, s)
    if attn_res:
        candidates["AttnRes mix"] = attn_res_mix_ws(N, H, bank)
    kind = max(candidates, key=candidates.__getitem__)
    return (row if attn_res else 0) + candidates[kind], kind, note


def target_forward_peak(inputs: PlanInputs, shapes: TargetShapes) -> LayerPeak:
    """Walk the target's forward layer by layer (``k3/model.py``, ``k3/layer.py``) and return its worst point.

    Held along the way: the residual prefix, the AttnRes bank (one ``[B,T,H]`` block sum per commit layer ``ℓ %
    block_size == 0``) and the aux taps captured so far (a ``prefix`` tap is the same tensor as the next bank entry
    when the next layer commits), the boolean MLA mask when rows are padded (B > 1); FSDP2 gathers the running unit
    and prefetches the next."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    N, H, L, T = inputs.batch_size * inputs.seq_len, c.hidden_size, c.num_hidden_layers, inputs.seq_len
    bs = c.attn_res_block_size
    row = N * H * s
    mask = inputs.batch_size * T * T if inputs.batch_size > 1 else 0
    units = [shapes.embedding, *shapes.layers]
    sharded = inputs.dense_sharded

    def gathered(u: int) -> int:
        if not sharded:
            return 0
        return sum(unit.nbytes(inputs.target_dtype) for unit in units[u : u + 2] if unit.shardable)

    def bank_after(i: int) -> int:
        return 0 if bs is None else i // bs + 1

    def taps_held(i: int) -> int:
        def in_bank(t: int) -> bool:
            return bs is not None and (t + 1) % bs == 0 and t + 1 < L

        return sum(1 for t in inputs.taps if t < i and not in_bank(t))

    peaks = [LayerPeak(-1, row, gathered(0), 0, "embedding")]
    working_sets: dict[tuple[bool, bool, int], tuple[int, str, str]] = {}  # by layer kind and bank size
    for i in range(L):
        stream = row * (1 + bank_after(i) + taps_held(i)) + mask
        kind = (c.is_kda(i), c.is_moe(i), bank_after(i))
        if kind not in working_sets:
            working_sets[kind] = layer_working_set(inputs, i, bank_after(i))
        ws, what, note = working_sets[kind]
        peaks.append(LayerPeak(i, stream, gathered(i + 1), ws, what, note))
    # After the last layer: the output mixer over the whole bank, the final norm, the taps stacked into [B,T,3H].
    final_stream = row * (1 + bank_after(L - 1) + taps_held(L)) + mask
    final_ws = (attn_res_mix_ws(N, H, bank_after(L - 1)) if bs is not None else 0) + 2 * row
    peaks.append(LayerPeak(L, final_stream, 0, max(final_ws, len(inputs.taps) * row + row), "output mixer + taps"))
    return max(peaks, key=lambda p: p.total)


# ---- the terms of each phase ----------------------------------------------------------------------------------------
def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def _shard(numel: int, inputs: PlanInputs) -> int:
    """Elements of a draft tensor set one rank holds: all of them, or ``ceil(numel / world)`` with ``draft_shard``."""
    return -(-numel // inputs.world) if inputs.draft_shard else numel


def resident_terms(inputs: PlanInputs, target: TargetShapes, draft: DraftShapes) -> list[Term]:
    c, t_dt, s = inputs.target, inputs.target_dtype, inputs.draft_dtype.itemsize
    experts = c.num_experts // inputs.ep
    full = target.dense_bytes(t_dt)
    dense_note = (
        f"FSDP2 shards over {inputs.world} ranks (full copy {_gb(full)})" if inputs.dense_sharded else "replicated"
    )
    storage = "MXFP4 packed" if inputs.expert_storage == "mxfp4" else f"dequantised {_dtype_name(t_dt)}"
    trainable = _shard(draft.trainable, inputs)
    sharded = f", sharded over {inputs.world}" if inputs.draft_shard else ""
    terms = [
        Term(RESIDENT, "target dense weights", target.dense_held_bytes(t_dt, inputs.world, inputs.dense_sharded),
             dense_note),
        Term(RESIDENT, "target routed experts",
             routed_bytes(target.routed_weights_per_expert * experts, t_dt, inputs.expert_storage),
             f"{experts} experts/layer at expert_parallel_size {inputs.ep}, {storage}"),
        Term(RESIDENT, "draft parameters", (trainable + draft.frozen) * s + draft.buffer_bytes,
             f"{draft.trainable / 1e9:.3g} B trainable{sharded} + {draft.frozen / 1e9:.3g} B frozen embedding, "
             f"{_dtype_name(inputs.draft_dtype)}"),
        Term(RESIDENT, "AdamW states", 2 * trainable * s,
             f"exp_avg + exp_avg_sq in the parameter dtype ({_dtype_name(inputs.draft_dtype)}; no fp32 master copy)"),
    ]  # fmt: skip
    if inputs.accumulate_grad_batches > 1:
        terms.append(Term(RESIDENT, "gradients between micro-batches", trainable * s,
                          f"accumulate_grad_batches={inputs.accumulate_grad_batches}"))  # fmt: skip
    terms.append(Term(RESIDENT, "runtime reserve", inputs.reserve_bytes,
                      "assumption: CUDA context, NCCL buffers, allocator fragmentation"))  # fmt: skip
    return terms


def target_forward_terms(inputs: PlanInputs, target: TargetShapes) -> list[Term]:
    phase = PHASES[0]
    peak = target_forward_peak(inputs, target)
    where = {-1: "the embedding", inputs.target.num_hidden_layers: "the output mixer"}.get(peak.index)
    where = where or f"layer {peak.index}"
    terms = [
        Term(phase, "residual stream, AttnRes bank, aux taps", peak.stream, f"at {where}"),
        Term(phase, "layer working set", peak.working_set, f"{peak.kind} of {where}"
             + (f"; {peak.moe_note}" if peak.moe_note and "MoE" in peak.kind else "")),
    ]  # fmt: skip
    if inputs.dense_sharded:
        terms.append(Term(phase, "dense weights gathered (FSDP2)", peak.gathers, gather_note(inputs, target, where)))
    return terms


def gather_note(inputs: PlanInputs, target: TargetShapes, where: str) -> str:
    """Which FSDP2 gather dominates: the running unit + the prefetched next one (largest adjacent pair), the
    embedding (with layer 0 prefetched) or the teacher's ``lm_head`` (its own phase)."""
    dt = inputs.target_dtype
    units = [target.embedding, *target.layers]
    pairs = [
        (units[i].nbytes(dt) + units[i + 1].nbytes(dt), units[i].name, units[i + 1].name) for i in range(len(units) - 1)
    ]
    size, first, second = max(pairs)
    head = target.lm_head.nbytes(dt)
    return (
        f"running unit + prefetched next at {where}; largest pair {first} + {second} {_gb(size)}, "
        f"lm_head {_gb(head)} (teacher phase)"
    )


def target_outputs_bytes(inputs: PlanInputs) -> int:
    """The capture's ``[B,T,3H]`` aux states and post-norm final hidden, plus the shifted copy of the hidden that
    ``shared_step`` hands to the unroll; alive through the teacher and the whole unroll."""
    N, H = inputs.batch_size * inputs.seq_len, inputs.target.hidden_size
    return (3 + 2) * N * H * inputs.target_dtype.itemsize


def teacher_terms(inputs: PlanInputs, target: TargetShapes) -> list[Term]:
    """``training/teacher.py`` ``teacher_from_hidden``: fp32 ``[B·T, N_d]`` draft-vocab logits, then their softmax;
    per ``seq_chunk × vocab_chunk`` tile the logits in the target dtype, their fp32 copy and the draft columns."""
    phase = PHASES[1]
    N, V, N_d = inputs.batch_size * inputs.seq_len, inputs.target.vocab_size, inputs.draft.draft_vocab_size
    st = inputs.target_dtype.itemsize
    rows, cols = min(inputs.teacher_seq_chunk, N), min(inputs.teacher_vocab_chunk, V)
    tile = rows * cols * (st + FP32) + rows * min(cols, N_d) * FP32
    logits = N * N_d * FP32
    terms = [
        Term(phase, "target outputs (aux states, final hidden)", target_outputs_bytes(inputs)),
        Term(phase, "teacher logits + softmax / chunk tile", logits + max(tile, logits) + V * 8,
             f"[B,T,N_d] fp32 ×2 (tile {rows}×{cols}: {_gb(tile)})"),
    ]  # fmt: skip
    if inputs.dense_sharded and target.lm_head.params:
        terms.append(Term(phase, "lm_head gathered for the teacher", target.lm_head.nbytes(inputs.target_dtype)))
    return terms


def draft_unroll_terms(inputs: PlanInputs, draft: DraftShapes) -> list[Term]:
    phase = PHASES[2]
    d = DraftDims.of(inputs)
    ckpt = inputs.activation_checkpointing
    shared = unroll_shared_saved(d, inputs.target_dtype, inputs.draft_dtype)
    up = unroll_peak(d, ckpt, shared, draft)
    cache = sum(cache_entry_kept(d, k, ckpt) for k in range(d.K))
    N = d.BT
    saved_note = "checkpointed: step inputs, final norms, log-probs" if ckpt else "what autograd saves per step"
    terms = [
        Term(phase, "target outputs + teacher", target_outputs_bytes(inputs) + N * d.N_d * FP32 + N * 9,
             "aux, final hidden ×2, teacher probs [B,T,N_d] fp32"),
        Term(phase, "TTT K/V cache", cache, f"{d.K} steps"),
        Term(phase, "TTT saved activations", up.kept_after_forward - cache - shared,
             f"{saved_note}; {d.K} steps at T={d.T}, backend {d.backend}"),
        Term(phase, "TTT mask + fc input cast", shared, "[B,1,T,T] additive mask in the draft dtype"),
        Term(phase, "backward: gradient buffers + working set", up.peak - up.kept_after_forward,
             f"peak at {up.where}"),
    ]  # fmt: skip
    if inputs.draft_shard:
        gathered = (draft.trainable - _shard(draft.trainable, inputs)) * d.s
        terms.append(Term(phase, "draft parameters gathered (FSDP2)", gathered))
    return terms


def optimizer_terms(inputs: PlanInputs, draft: DraftShapes) -> list[Term]:
    """AdamW: the CUDA default (foreach) takes ``sqrt(exp_avg_sq)`` of every parameter at once; the CPU default
    (single tensor) one parameter at a time (the sqrt and its quotient). The module's grad-norm logging copies one
    gradient at a time to fp32 before the step."""
    phase = PHASES[3]
    s = inputs.draft_dtype.itemsize
    trainable = _shard(draft.trainable, inputs)
    largest = _shard(draft.largest_trainable, inputs)
    foreach = trainable * s if inputs.device != "cpu" else 2 * largest * s
    terms = [Term(phase, "optimizer temporaries", max(foreach, largest * FP32),
                  "foreach AdamW: sqrt(exp_avg_sq) of every parameter" if inputs.device != "cpu" else
                  "single-tensor AdamW")]  # fmt: skip
    if inputs.accumulate_grad_batches == 1:
        terms.append(Term(phase, "gradients", trainable * s))
    return terms


def build_plan(inputs: PlanInputs, target: TargetShapes | None = None, draft: DraftShapes | None = None) -> MemoryPlan:
    """The per-rank plan of ``inputs``; pass precomputed shapes when planning many layouts of one run."""
    target = target or target_shapes(inputs.target)
    draft = draft or draft_shapes(inputs.draft)
    terms = [
        *resident_terms(inputs, target, draft),
        *target_forward_terms(inputs, target),
        *teacher_terms(inputs, target),
        *draft_unroll_terms(inputs, draft),
        *optimizer_terms(inputs, draft),
    ]
    return MemoryPlan(inputs, tuple(terms))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- does it fit, and if not, what does --------------------------------------------------------------------------
def legal_ep_sizes(num_experts: int, world: int) -> list[int]:
    """Expert-parallel sizes that divide both the expert count and the world (``k3_target.md`` §5.1)."""
    return [ep for ep in range(1, min(num_experts, world) + 1) if num_experts % ep == 0 and world % ep == 0]


@dataclass(frozen=True)
class Fit:
    nodes: int
    ep: int
    plan: MemoryPlan


def smallest_fit(inputs: PlanInputs, gpu_bytes: int, gpus_per_node: int, max_nodes: int = 256) -> Fit | None:
    """The fewest nodes (of ``gpus_per_node`` GPUs) on which some legal EP size fits, with the smallest such EP."""
    target, draft = target_shapes(inputs.target), draft_shapes(inputs.draft)
    for nodes in range(1, max_nodes + 1):
        world = nodes * gpus_per_node
        for ep in legal_ep_sizes(inputs.target.num_experts, world):
            layout = replace(inputs, world=world, ep=ep)
            if sum(t.nbytes for t in resident_terms(layout, target, draft)) > gpu_bytes:
                continue  # the weights alone do not fit: no need to plan the phases
            plan = build_plan(layout, target, draft)
            if plan.peak_bytes <= gpu_bytes:
                return Fit(nodes, ep, plan)
    return None


# ---- the report ----------------------------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan) -> str:
    """The table of every term (decimal GB), each phase's total, and the peak."""
    rows = [("phase", "term", "GB", "note")]
    for phase in (RESIDENT, *PHASES):
        for t in plan.terms:
            if t.phase == phase:
                rows.append((phase, t.name, f"{t.nbytes / GB:.3f}", t.note))
        total = plan.phase_bytes(phase)
        label = "resident total" if phase == RESIDENT else f"{phase} total (on top of resident)"
        rows.append(("", label, f"{total / GB:.3f}", "peak phase" if phase == plan.peak_phase else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"peak per GPU: {plan.peak_bytes / GB:.2f} GB = resident {plan.resident_bytes / GB:.2f} GB + "
                 f"{plan.peak_phase} {plan.phase_bytes(plan.peak_phase) / GB:.2f} GB")  # fmt: skip
    return "\n".join(lines)


def verdict(plan: MemoryPlan, gpu_bytes: int, fit: Fit | None, gpus_per_node: int, searched_nodes: int) -> str:
    """The last line: ``fits: …`` or ``does not fit: …`` with the margin or overflow and the smallest fit."""
    peak, cap = plan.peak_bytes / GB, gpu_bytes / GB
    if plan.peak_bytes <= gpu_bytes:
        return f"fits: peak {peak:.1f} GB of {cap:.0f} GB per GPU (margin {cap - peak:.1f} GB)"
    line = f"does not fit: peak {peak:.1f} GB of {cap:.0f} GB per GPU (over by {peak - cap:.1f} GB)"
    if fit is None:
        return line + f"; no layout up to {searched_nodes} nodes x {gpus_per_node} GPUs fits"
    return (
        line + f"; smallest fit: {fit.nodes} nodes x {gpus_per_node} GPUs (world {fit.nodes * gpus_per_node}) with "
        f"expert_parallel_size {fit.ep} (peak {fit.plan.peak_bytes / GB:.1f} GB)"
    )


# ---- reading a LightningCLI config ----------------------------------------------------------------------------------
class PlanConfigError(ValueError):
    """A run config the plan cannot read; the message names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _init_args(section: Any, name: str) -> dict[str, Any]:
    """A config section as a dict of arguments (plain keys, or LightningCLI's ``class_path`` + ``init_args``)."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise PlanConfigError(name, f"expected a mapping, got {section!r}")
    return dict(section.get("init_args") or {}) if "class_path" in section else dict(section)


def _defaults(callable_: Callable[..., Any]) -> dict[str, Any]:
    """Keyword defaults of a constructor: the module's and data module's defaults are the plan's (one source)."""
    import inspect

    return {
        k: p.default
        for k, p in inspect.signature(callable_).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanConfigError(name, f"expected a positive integer, got {value!r}")
    return value


def _devices(value: Any) -> int | None:
    """GPUs per node from ``trainer.devices``: an int, a list of ids or a digit string; None when not a count."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _dtype(value: Any, name: str) -> torch.dtype:
    from lightning_eagle.dtypes import DTYPES

    if value not in DTYPES:
        raise PlanConfigError(name, f"unknown dtype {value!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[value]


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise PlanConfigError(name, f"expected true or false, got {value!r}")
    return value


@dataclass
class RunConfig:
    """A run config read for planning: the inputs, GPUs per node, and notices to print (e.g. a preset fallback)."""

    inputs: PlanInputs
    gpus_per_node: int
    nodes: int
    notices: list[str] = field(default_factory=list)
    target_label: str = ""


def _target_config(value: Any, fallback: str | None) -> tuple[KimiK3TextConfig, str, list[str]]:
    """The target's text config from ``model.target`` (a checkpoint folder or ``quickstart``), else — stated, never
    silent — from ``--target-config`` (a preset name, a folder or a ``config.json``)."""
    from lightning_eagle.k3 import PRESETS, config_from_name
    from lightning_eagle.k3.loader import CheckpointError, named_target, read_config

    if not isinstance(value, str):
        raise PlanConfigError("model.target", f"expected a checkpoint folder, got {value!r}")
    folder = named_target(value)
    try:
        if (folder / "config.json").is_file():
            return read_config(folder), f"{value} ({folder / 'config.json'})", []
        if fallback is None:
            raise PlanConfigError(
                "model.target",
                f"checkpoint folder {str(folder)!r} is not here (no config.json); pass --target-config with a preset "
                f"({', '.join(sorted(PRESETS))}; the published K3 is 'k3') or a config.json to plan with it",
            )
        if fallback in PRESETS:
            config, label = config_from_name(fallback), f"preset {fallback!r}"
        else:
            path = Path(fallback)
            config, label = read_config(path.parent if path.name == "config.json" else path), str(path)
    except CheckpointError as err:
        raise PlanConfigError("model.target", str(err)) from None
    notice = f"note: model.target {value!r} is not here (no config.json); planning with --target-config {label}"
    return config, label, [notice]


def run_config_from_yaml(
    path: str | Path,
    *,
    target_config: str | None = None,
    world: int | None = None,
    ep: int | None = None,
    shard_dense: bool | None = None,
    device: str = "cuda",
    reserve_gb: float = 4.0,
    moe_load_factor: float = 1.25,
) -> RunConfig:
    """Read a LightningCLI YAML (``trainer``, ``model``, ``data``) into :class:`PlanInputs`, with the defaults of
    ``Eagle3Module``, ``ChatDataModule`` and ``ExpertParallelStrategy`` for whatever it leaves out."""
    import yaml

    from lightning_eagle.configs import resolve_config_path
    from lightning_eagle.data.datamodule import ChatDataModule
    from lightning_eagle.training.module import MODULE_DRAFT_FIELDS, Eagle3Module

    file = Path(resolve_config_path(str(path)))
    if not file.is_file():
        raise PlanConfigError("--config", f"{str(path)!r} is not a file")
    raw = yaml.safe_load(file.read_text()) or {}
    if not isinstance(raw, dict):
        raise PlanConfigError("--config", f"{file} does not hold a mapping")
    trainer = raw.get("trainer") or {}
    model = {**_defaults(Eagle3Module.__init__), **_init_args(raw.get("model"), "model")}
    data = {**_defaults(ChatDataModule.__init__), **_init_args(raw.get("data"), "data")}

    nodes = _positive_int(trainer.get("num_nodes", 1), "trainer.num_nodes")
    gpus = _devices(trainer.get("devices", "auto"))
    if world is None:
        if gpus is None:
            raise PlanConfigError("trainer.devices", f"{trainer.get('devices', 'auto')!r} is not a GPU count; "
                                  "set a number or pass --world")  # fmt: skip
        world = nodes * gpus
    gpus = gpus or max(world // nodes, 1)
    strategy = trainer.get("strategy") or "auto"
    expert_parallel = isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith(
        "ExpertParallelStrategy"
    )
    if expert_parallel:
        from lightning_eagle.parallel.strategy import ExpertParallelStrategy

        strategy_args = {**_defaults(ExpertParallelStrategy.__init__), **_init_args(strategy, "trainer.strategy")}
        ep = ep if ep is not None else _positive_int(strategy_args["expert_parallel_size"],
                                                     "trainer.strategy.init_args.expert_parallel_size")  # fmt: skip
        if shard_dense is None:
            shard_dense = strategy_args.get("target_shard_dense")
    else:  # single device / DDP: every rank holds the whole target
        ep = ep if ep is not None else 1
        shard_dense = False if shard_dense is None else shard_dense

    if model["target_source"] != "online":
        raise PlanConfigError("model.target_source", f"{model['target_source']!r} is not modelled (only 'online')")
    target, label, notices = _target_config(model["target"], target_config)
    overrides = dict(model.get("draft") or {})
    doubled = sorted(set(overrides) & set(MODULE_DRAFT_FIELDS))
    if doubled:
        raise PlanConfigError(f"model.draft.{doubled[0]}", f"set {MODULE_DRAFT_FIELDS[doubled[0]]} instead")
    ttt_steps = _positive_int(model["ttt_steps"], "model.ttt_steps")
    aux = model.get("aux_layer_ids")
    try:
        draft = Eagle3DraftConfig.from_target_config(
            target, **overrides, ttt_steps=ttt_steps, draft_vocab_size=data.get("draft_vocab_size"),
            aux_hidden_state_stream=model.get("aux_stream", "prefix"),
            **({"aux_layer_ids": list(aux)} if aux is not None else {}),
        )  # fmt: skip
    except (TypeError, ValueError) as err:
        raise PlanConfigError("model.draft", str(err)) from None
    accumulate = trainer.get("accumulate_grad_batches", 1)
    try:
        inputs = PlanInputs(
            target=target,
            draft=draft,
            world=world,
            ep=ep,
            shard_dense=shard_dense,
            draft_shard=_flag(model.get("draft_shard", False), "model.draft_shard"),
            target_dtype=_dtype(model["target_dtype"], "model.target_dtype"),
            expert_storage=model["target_expert_storage"],
            draft_dtype=_dtype(model["draft_dtype"], "model.draft_dtype"),
            batch_size=_positive_int(data["batch_size"], "data.batch_size"),
            seq_len=_positive_int(data["max_length"], "data.max_length"),
            ttt_steps=ttt_steps,
            attention_backend=model["attention_backend"],
            activation_checkpointing=_flag(model["draft_activation_checkpointing"],
                                           "model.draft_activation_checkpointing"),
            accumulate_grad_batches=_positive_int(accumulate, "trainer.accumulate_grad_batches"),
            teacher_vocab_chunk=_positive_int(model["teacher_vocab_chunk"], "model.teacher_vocab_chunk"),
            teacher_seq_chunk=_positive_int(model["teacher_seq_chunk"], "model.teacher_seq_chunk"),
            aux_layer_ids=tuple(draft.aux_layer_ids or ()),
            device=device,
            moe_load_factor=moe_load_factor,
            reserve_bytes=int(reserve_gb * GB),
        )  # fmt: skip
    except PlanConfigError:
        raise
    except ValueError as err:
        message = str(err)
        name = (
            "model.attention_backend" if "attention_backend" in message
            else "model.target_expert_storage" if "expert_storage" in message
            else "model.draft" if message.startswith("draft ")
            else "trainer.strategy.init_args.expert_parallel_size"
        )  # fmt: skip
        raise PlanConfigError(name, message) from None
    return RunConfig(inputs, gpus, nodes, notices, label)


def _header(run: RunConfig) -> str:
    i = run.inputs
    cluster = f"{run.nodes} node(s) x {run.gpus_per_node} GPU(s)"
    world = f"world {i.world} ({cluster})" if i.world == run.nodes * run.gpus_per_node else f"world {i.world}"
    dense = f"dense weights FSDP2-sharded over {i.world}" if i.dense_sharded else "dense weights replicated"
    draft = "sharded" if i.draft_shard else "replicated"
    ckpt = "on" if i.activation_checkpointing else "off"
    return "\n".join([
        f"target: {run.target_label}",
        f"{world}, expert_parallel_size {i.ep} ({i.target.num_experts // i.ep} experts/layer), {dense}, draft {draft}",
        f"micro-batch {i.batch_size} x {i.seq_len} tokens, ttt_steps {i.ttt_steps}, attention {i.attention_backend}, "
        f"activation checkpointing {ckpt}, target {_dtype_name(i.target_dtype)} ({i.expert_storage} experts), "
        f"draft {_dtype_name(i.draft_dtype)}, N_d {i.draft.draft_vocab_size}",
        f"assumptions: {i.device} kernels, MoE load factor {i.moe_load_factor}, "
        f"runtime reserve {i.reserve_bytes / GB:.1f} GB",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print the plan of a run config; the last line starts with ``fits`` or ``does not fit``. Exit 0 either way,
    2 for a config the plan cannot read (the message names the field)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_eagle.parallel.memory",
        description="Per-GPU peak memory plan of a draft-training run config (LightningCLI YAML).",
    )
    parser.add_argument("--config", required=True, help="the run's YAML (a path or a packaged config name)")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU in decimal GB (default 80)")
    parser.add_argument("--target-config", help="preset name (e.g. 'k3') or config.json used when model.target is "
                        "not a checkpoint folder on this machine")  # fmt: skip
    parser.add_argument("--world", type=int, help="override the world size (num_nodes x devices)")
    parser.add_argument("--ep", type=int, help="override expert_parallel_size")
    parser.add_argument(
        "--shard-dense",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override target_shard_dense (default: the config's, else on when world > 1)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="kernels to plan for")
    parser.add_argument("--reserve-gb", type=float, default=4.0, help="runtime reserve per GPU (default 4)")
    parser.add_argument(
        "--moe-load-factor",
        type=float,
        default=1.25,
        help="rows the hottest EP rank receives relative to uniform routing (default 1.25)",
    )
    parser.add_argument("--max-nodes", type=int, default=256, help="largest cluster the fit search tries")
    args = parser.parse_args(argv)
    try:
        run = run_config_from_yaml(
            args.config, target_config=args.target_config, world=args.world, ep=args.ep,
            shard_dense=args.shard_dense, device=args.device, reserve_gb=args.reserve_gb,
            moe_load_factor=args.moe_load_factor,
        )  # fmt: skip
    except PlanConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    gpu_bytes = int(args.gpu_gb * GB)
    plan = build_plan(run.inputs)
    fit = None
    if plan.peak_bytes > gpu_bytes:
        fit = smallest_fit(run.inputs, gpu_bytes, run.gpus_per_node, args.max_nodes)
    for notice in run.notices:
        print(notice)
    print(_header(run))
    print(format_plan(plan))
    print(verdict(plan, gpu_bytes, fit, run.gpus_per_node, args.max_nodes))
    return 0
