"""The draft unroll's forward: what autograd keeps per TTT step (``training/ttt.py``, ``draft/``), tensor by tensor.

Each function names the tensors it counts and why they are alive: an op saves the inputs its backward needs;
``x.float()`` of an fp32 tensor is the tensor itself; a view keeps its base storage alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.parallel.memory_plan.inputs import FP32, PlanInputs


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
