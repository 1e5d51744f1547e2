"""The EAGLE-3 draft unroll's forward: what autograd keeps per TTT step (``training/ttt.py``, ``draft/``), tensor by
tensor.

Each function names the tensors it counts and why they are alive: an op saves the inputs its backward needs;
``x.float()`` of an fp32 tensor is the tensor itself; a view keeps its base storage alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.backends import TTT_ATTENTION_BACKEND
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.terms import FP32


def ttt_attention_backend(inputs: PlanInputs) -> str:
    """The TTT attention that runs on the planned device (``auto`` resolved as ``fit`` resolves it there)."""
    return TTT_ATTENTION_BACKEND.resolve(
        inputs.draft_settings.attention_backend, inputs.device, flex_available=inputs.flex_available
    )


# ---- draft activation shapes ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftDims:
    """The sizes the TTT unroll's tensors are made of. ``s``: draft dtype bytes; ``s_t``: target dtype bytes."""

    B: int
    T: int  # slots this rank unrolls: the sequence, or its 1/sp share under draft sequence parallelism
    T_keys: int  # keys a query attends over: the whole (padded) sequence
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
    kv_cache: str = "expanded"  # kv_cache: "expanded" per-head K/V, "latent" MLA latent + rope key
    loss: str = "plain"  # loss_backend: "plain" [*,N_d] logits + log-probs per step, "chunked" fused per row chunk
    loss_chunk: int = 1024  # rows per chunk of the chunked loss
    sp: int = 1  # draft sequence-parallel size (Ulysses: heads sharded over sp ranks inside the attention)

    @classmethod
    def of(cls, inputs: PlanInputs) -> DraftDims:
        c = inputs.draft  # PlanInputs refuses kv_cache='latent' under draft sequence parallelism
        return cls(
            B=inputs.batch_size,
            T=inputs.local_seq_len,
            T_keys=inputs.local_seq_len * inputs.draft_sp,
            K=inputs.objective.ttt_steps,
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
            backend=ttt_attention_backend(inputs),
            cpu=inputs.device == "cpu",
            kv_cache=inputs.draft_settings.kv_cache,
            loss=inputs.loss_backend,
            loss_chunk=inputs.loss_chunk,
            sp=inputs.draft_sp,
        )

    @property
    def d_qk(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def BT(self) -> int:
        return self.B * self.T

    def supervised(self, k: int) -> int:
        """Slots of step ``k`` with a target (``t + k < T``) on the rank that has the most: ``B·min(T, T_keys−k)``."""
        return self.B * min(self.T, self.T_keys - k)

    @property
    def fp32(self) -> bool:
        return self.s == FP32

    @property
    def concatenated(self) -> bool:
        """A backend that runs one kernel over the concatenated keys of every step so far."""
        return self.backend in ("sdpa_mask", "flex_attention")

    @property
    def latent(self) -> bool:
        return self.kv_cache == "latent"

    @property
    def chunked(self) -> bool:
        return self.loss == "chunked"

    def chunk_rows(self, k: int) -> int:
        """Rows of the chunked loss's largest chunk at step ``k``."""
        return min(self.loss_chunk, self.supervised(k))


# ---- the draft's forward: what autograd keeps per TTT step ----------------------------------------------------------
def norm_saved(d: DraftDims, width: int, input_needs_grad: bool = True, input_is_kept: bool = False) -> int:
    """One K3 RMSNorm over ``[B,T,width]`` with a trainable weight (``ops/norm.py``), plus its output (which the
    next Linear saves as its input). ``x32 = x.float()`` and the row ``rsqrt`` are saved by the pow/mul when ``x``
    needs grad — in fp32 ``x32`` is ``x`` itself, counted elsewhere when ``input_is_kept``; ``normed`` is saved by
    ``weight * normed``; the output is a new tensor."""
    x32 = 0 if not input_needs_grad or input_is_kept else d.BT * width * FP32
    rsqrt = d.BT * FP32 if input_needs_grad else 0
    return x32 + rsqrt + 2 * d.BT * width * d.s


def expanded_kv_bytes(d: DraftDims) -> int:
    """One step's per-head K/V as ``ops/mla.py`` ``expand_latent_kv`` makes them: ``k`` = cat(k_nope, k_rot)
    ``[B,n,T,d_qk]`` is a new tensor; ``v`` is a view of the ``kv_b_proj`` output, which stays alive whole
    ``[B,T,n·(d_nope+d_v)]``."""
    return d.BT * d.n * (d.d_qk + d.d_nope + d.d_v) * d.s


def cache_entry_bytes(d: DraftDims) -> int:
    """The storages one step's cache entry holds.

    ``expanded``: the K/V of :func:`expanded_kv_bytes`; under sequence parallelism the all-to-all hands the cache
    separate head-sharded ``k [B,n/sp,T_keys,d_qk]`` and ``v [B,n/sp,T_keys,d_v]`` (the reshape of each permuted
    part copies), the same bytes as ``[B,n,T/sp,·]`` without the ``k_nope`` half of the ``kv_b_proj`` output.
    ``latent``: the normalised latent ``[B,1,T,r]`` (``kv_a_layernorm``'s output) and the rope key, a view of the
    whole ``kv_a_proj_with_mqa`` output ``[B,T,r+d_rope]``."""
    if d.latent:
        return d.BT * (2 * d.kv_lora + d.d_rope) * d.s
    if d.sp > 1:
        return d.BT * d.n * (d.d_qk + d.d_v) * d.s
    return expanded_kv_bytes(d)


def attention_projection_saved(d: DraftDims) -> int:
    """``combined [B,T,2H]`` (saved by q_a / kv_a / g_proj), the q path and the kv latent path, and ``q`` itself
    (saved by the attention core; a view of the ``q_b_proj`` output, or under sequence parallelism its head-sharded
    copy of the same bytes). With a latent cache the latent norm's output and the ``kv_a`` output are the cache
    entry's (:func:`cache_entry_kept`)."""
    combined = d.BT * 2 * d.H * d.s
    q_path = 0 if d.q_lora is None else norm_saved(d, d.q_lora)
    q = d.BT * d.n * d.d_qk * d.s
    # kv_a_layernorm reads the latent slice of the kv_a output: its fp32 "copy" is a view of the whole output in fp32.
    if d.fp32:
        latent_x32 = 0 if d.latent else d.BT * (d.kv_lora + d.d_rope) * FP32
    else:
        latent_x32 = d.BT * d.kv_lora * FP32
    kv_path = latent_x32 + norm_saved(d, d.kv_lora, input_is_kept=True) - (d.BT * d.kv_lora * d.s if d.latent else 0)
    return combined + q_path + q + kv_path


def attention_core_saved(d: DraftDims, k: int) -> int:
    """What the TTT attention of step ``k`` keeps besides q and the cache (``draft/ttt_attention.py``,
    ``draft/latent_attention.py``).

    ``flash_lse``: the output ``[B,n,T,d_v]`` and the fp32 LSE ``[B,n,T]`` (the fused CPU kernel's step-0 output is
    a view of its padded ``[B,n,T,max(d_qk,d_v)]`` result). ``eager``: the fp32 probabilities ``[B,n,T,T+k]`` (and
    their cast to the draft dtype, which the two matmuls save), and for ``k ≥ 1`` the stacked later-step K/V and a
    contiguous copy of ``q`` that the diagonal einsums save. A latent cache adds, every step, the step-0 block
    ``K_0``/``V_0`` that step expanded for its kernel (:func:`expanded_kv_bytes`; ``eager``: ``K_0`` and the
    contiguous copy of ``V_0`` its matmul saves); ``eager`` expands the later steps too, but keeps only their stacked
    copies."""
    if d.concatenated:
        return concatenated_attention_saved(d, k)
    if d.backend == "flash_lse":
        expanded_block = expanded_kv_bytes(d) if d.latent else 0
    elif d.sp == 1:  # the block matmul saves a contiguous copy of V_0 (a strided view of the kv_b output)
        expanded_block = d.BT * d.n * ((d.d_qk if d.latent else 0) + d.d_v) * d.s
    else:  # head-sharded K/V are contiguous already: the cache entry itself is saved
        expanded_block = 0
    if d.backend == "flash_lse":
        width = max(d.d_qk, d.d_v) if (d.cpu and k == 0) else d.d_v
        return d.BT * d.n * (width * d.s + FP32) + expanded_block
    probs = d.B * d.n * d.T * (d.T_keys + k) * (FP32 if d.fp32 else FP32 + d.s)
    diagonal = (k * (d.d_qk + d.d_v) + d.d_qk) * d.BT * d.n * d.s if k else 0
    return probs + diagonal + expanded_block


def concatenated_attention_saved(d: DraftDims, k: int) -> int:
    """``sdpa_mask`` / ``flex_attention`` (CUDA; analytic, not censused): one fused kernel over the concatenated keys
    ``[K_0 ; … ; K_k]`` saves the concatenated K and V (``(k+1)·T`` keys per row, a new tensor each step), its
    output and the fp32 LSE; ``sdpa_mask`` also its boolean ``[B,1,T,(k+1)·T]`` mask and the additive bias of the
    same shape in the draft dtype that the memory-efficient kernel makes of it (flex's block mask is tile-sized)."""
    concatenated = (k + 1) * d.BT * d.n * (d.d_qk + d.d_v) * d.s
    out = d.BT * d.n * (d.d_v * d.s + FP32)
    mask = d.B * d.T_keys * (k + 1) * d.T_keys * (1 + d.s) if d.backend == "sdpa_mask" else 0
    return concatenated + out + mask


def attention_output_saved(d: DraftDims) -> int:
    """``o`` reshaped to ``[B,T,n·d_v]`` (a copy), and with the gate ``σ(g_proj(x))`` and ``o·σ`` (``gate_output``)."""
    return (3 if d.gate else 1) * d.BT * d.n * d.d_v * d.s


def situ_saved(d: DraftDims) -> int:
    """SiTU (``ops/situ.py``) keeps six fp32 ``[B,T,I]`` tensors (the two tanh results, the capped gate, the sigmoid,
    their product, the capped up branch) and the cast result that ``down_proj`` saves."""
    return (6 * FP32 + d.s) * d.BT * d.I


def loss_saved(d: DraftDims, k: int) -> int:
    """``plain``: ``log_softmax(logits.float())`` of the supervised slots ``[B,T−k,N_d]`` in fp32, kept until the
    backward (every step's loss is computed in the loop and back-propagated once at the end). ``chunked``
    (``training/chunked_loss.py`` ``FusedHeadSoftCE``): nothing ``[*,N_d]``-sized; the function saves the step output
    ``h [B,T,H]`` (its backward recomputes the final norm and the logits per chunk; the next step keeps the same
    tensor, or an fp32 copy of it) and the supervised slots' int64 indices ``[R]``."""
    if d.chunked:
        return d.BT * d.H * d.s + d.supervised(k) * 8
    return d.supervised(k) * d.N_d * FP32


def final_norm_saved(d: DraftDims) -> int:
    """The final norm before ``lm_head`` (``plain``); the chunked loss runs it inside its function, saving nothing."""
    return 0 if d.chunked else norm_saved(d, d.H)


def step_saved_parts(d: DraftDims, k: int) -> dict[str, int]:
    """What autograd keeps for TTT step ``k`` (its K/V cache entry excluded), by part of the layer.

    The step input ``h`` (step 0: ``fc`` output; later: the previous step's output) is kept by ``hidden_norm``; in
    fp32 that is the previous step's final-norm input (``plain``) or the tensor the chunked loss saved, already
    counted there. The embedding is frozen, so ``input_layernorm`` keeps only its ``normed``."""
    hidden_kept = d.fp32 and k > 0
    norms = (
        # input_layernorm and hidden_norm: their outputs are concatenated (only `combined` is saved)
        norm_saved(d, d.H, input_needs_grad=False) - d.BT * d.H * d.s
        + norm_saved(d, d.H, input_is_kept=hidden_kept) - d.BT * d.H * d.s
        + norm_saved(d, d.H)  # post_attention_layernorm: its input h (mid-step residual) is new
    )  # fmt: skip
    return {
        "norms": norms,
        "attention projections": attention_projection_saved(d),
        "attention core": attention_core_saved(d, k),
        "attention output": attention_output_saved(d),
        "SiTU MLP": situ_saved(d),
        "final norm": final_norm_saved(d),
        "loss": loss_saved(d, k),
    }


def checkpointed_step_kept(d: DraftDims, k: int) -> int:
    """With activation checkpointing (``training/ttt.py`` ``checkpointed_draft_step``) a step keeps its input
    hidden (for the recompute; for ``k > 0`` the previous step's output: in fp32 the previous final-norm input, with
    the chunked loss the tensor it saved), and outside the checkpoint the final norm and the loss's saved tensors."""
    hidden = 0 if (k > 0 and (d.fp32 or d.chunked)) else d.BT * d.H * d.s
    return hidden + final_norm_saved(d) + loss_saved(d, k)


def unroll_shared_saved(d: DraftDims, target_dtype: torch.dtype, draft_dtype: torch.dtype) -> int:
    """Held once per unroll: ``eager``'s additive ``[B,1,T,T]`` causal ∧ padding mask in the draft dtype
    (:func:`eager_mask_bytes`; ``flash_lse`` builds none: right-padded rows are a tensor-free ``CausalBlock``), and
    ``fc``'s input cast to the draft dtype when the aux states come in another dtype."""
    cast = d.BT * 3 * d.H_t * d.s if target_dtype != draft_dtype else 0
    return eager_mask_bytes(d) + cast


def eager_mask_bytes(d: DraftDims) -> int:
    """``eager``'s additive ``[B,1,T,T]`` mask (over the whole sequence): held by the cache, which lives through the
    forward — and, with activation checkpointing, through the backward too (every recompute's closure holds it); no
    op saves the mask itself."""
    return d.B * d.T_keys * d.T_keys * d.s if d.backend == "eager" else 0


def cache_entry_kept(d: DraftDims, k: int, checkpointing: bool) -> int:
    """Cache entry ``k`` after the forward. A checkpointed step keeps every entry as an input of its recompute.

    ``expanded``: ``flash_lse`` saves every entry as it is (later entries individually); ``eager`` saves entry 0 and
    *stacked copies* of the later ones (counted in :func:`attention_core_saved`), so the originals die with the
    cache list (and the ``kv_b`` output behind ``V_0``: the block matmul saved a contiguous copy). ``latent``: the
    normalised latent is saved by every expansion of it; the ``kv_a`` output behind
    the rope key only where a tensor saves that view — ``flash_lse``'s function saves the later steps' rope keys
    (step 0's is expanded and dropped), in fp32 the latent norm saves the whole output as its ``x.float()``."""
    if checkpointing:
        return cache_entry_bytes(d)
    if d.latent:
        kv_a = d.BT * (d.kv_lora + d.d_rope) * d.s
        keeps_kv_a = d.fp32 or (d.backend == "flash_lse" and k > 0)
        return d.BT * d.kv_lora * d.s + (kv_a if keeps_kv_a else 0)
    if d.concatenated or (d.backend == "eager" and k > 0):  # only the concatenation (or the stack) is saved
        return 0
    if d.backend == "eager" and d.sp == 1:  # K_0 only: V_0's matmul saved a copy (attention_core_saved)
        return d.BT * d.n * d.d_qk * d.s
    return cache_entry_bytes(d)


def step_kept(d: DraftDims, k: int, checkpointing: bool) -> int:
    """Everything step ``k`` keeps at the end of the forward, its cache entry included."""
    saved = checkpointed_step_kept(d, k) if checkpointing else sum(step_saved_parts(d, k).values())
    return saved + cache_entry_kept(d, k, checkpointing)


def unroll_kept_after_forward(d: DraftDims, checkpointing: bool, shared: int) -> int:
    """Everything the K steps keep at the end of the forward (what the backward starts from)."""
    return shared + sum(step_kept(d, k, checkpointing) for k in range(d.K))
