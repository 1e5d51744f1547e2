"""The frozen target's no-grad forward (``k3/model.py``, ``k3/layer.py``), walked layer by layer: the residual stream,
AttnRes bank and aux taps it holds, FSDP2 gathers, and each layer's working set (AttnRes mix, KDA chunk form, MLA
through SDPA, dense SiTU MLP, or the MoE layer with its expert-parallel dispatch and grouped expert forward).

The grouped expert forward: under expert parallelism a rank receives each token of the group that needs any of its
experts; ``RoutedExperts.forward`` computes only the (row, slot) pairs routed to its own experts (expanding every
received row into all ``k`` slots would cost ≈ 14× more at EP 64 on the real K3: ~112 GB of transients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.kda_ops import safe_chunk_size
from lightning_eagle.k3.token_chunks import TokenSegments
from lightning_eagle.parallel.memory import TargetShapes
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.terms import FP32


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


def decode_ws(weights: int, s: int, scratch: int = 8) -> tuple[int, int]:
    """(peak while decoding, held while computing) for one layer's local MXFP4 experts (``k3/mxfp4.py``): decoding a
    tensor of ``w`` weights holds ``scratch`` bytes per weight at its worst (8 by default: its fp32 values, the int32
    nibble indices and the looked-up fp32 values of half of them, 2 + 2 B/weight; :func:`decode_scratch` gives what
    each device's kernels hold); gate_up (2/3 of the weights) is decoded first, then down while the decoded gate_up
    (``s`` B/weight) is alive. Then the decoded layer is held through its GEMMs."""
    gate_up, down = 2 * weights // 3, weights // 3
    return max(scratch * gate_up, s * gate_up + scratch * down), s * weights


def decode_scratch(device: str, s: int) -> int:
    """Bytes per weight ``decode_mxfp4`` holds at its worst, counted on each device: the int32 byte indices (2 B per
    weight, one per byte) beside the looked-up fp32 values (4 B) — on CPU also the int64 copy of the indices that
    advanced indexing makes there (4 B; measured) — or later the fp32 values beside the cast result (``4 + s``)."""
    return max(2 + 4 + (4 if device == "cpu" else 0), 4 + s)


def routed_experts_ws(
    inputs: PlanInputs, N: int, experts_per_rank: int, decoded_held: bool = False, scratch: int = 8
) -> tuple[int, str]:
    """One MoE layer's routed part on this rank: the expert-parallel dispatch buffers (``parallel/dispatcher.py``: the
    rows sent, received and unpacked, each ``[H_l]`` in the target dtype plus the top-k ids and weights), then the
    grouped expert forward over ``P`` pairs (``k3/experts.py``: sort indices, the gathered ``[P, H_l]`` rows, the
    ``[P, 2I]`` gate/up product and the SiTU intermediates, or later the down output, its reordering and fp32
    weighting) with one layer's local experts decoded — or the fp32 combine of the partial sums.

    ``decoded_held``: the decoded layer is held by the caller (a token-chunked layer decodes once, in its first
    segment, and keeps it for the rest: :meth:`~lightning_eagle.k3.experts.RoutedExperts.decoded_once`), so it is
    left out here. ``scratch``: bytes per weight while a tensor decodes (:func:`decode_ws`)."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    Hl, Ie, k = c.expert_hidden_size, c.moe_intermediate_size, c.num_experts_per_token
    shape = moe_shape(c, N, inputs.ep, inputs.moe_load_factor)
    P = shape.pairs
    weights = experts_per_rank * 3 * Hl * Ie
    if inputs.expert_storage == "mxfp4" and not decoded_held:
        decoding, decoded = decode_ws(weights, s, scratch)
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


def moe_layer_ws(inputs: PlanInputs, N: int, decoded_held: bool = False, scratch: int = 8) -> tuple[int, str, str]:
    """(bytes, which part, note) of one MoE channel mixer (``k3/moe.py``) on ``N`` tokens, its input excluded: the
    latent input ``z`` and the top-k routing with the routed experts; or later the shared experts' SiTU beside the
    combined routed output."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    routed, note = routed_experts_ws(inputs, N, c.num_experts // inputs.ep, decoded_held, scratch)
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
    its normalised input (beside the mix ``m_in``), on the whole batch (the unchunked forward)."""
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
    """The worst point of the target's forward (:func:`target_forward_peaks`)."""
    return max(target_forward_peaks(inputs, shapes), key=lambda p: p.total)


def target_forward_peaks(inputs: PlanInputs, shapes: TargetShapes) -> list[LayerPeak]:
    """Walk the target's forward layer by layer (``k3/model.py``, ``k3/layer.py``): the embedding, each decoder layer
    and the output mixer, in order. With ``target_token_chunk`` the chunked forward (:func:`chunked_forward_peaks`).

    Held along the way: the residual prefix, the AttnRes bank (one ``[B,T,H]`` block sum per commit layer ``ℓ %
    block_size == 0``) and the aux taps captured so far (a ``prefix`` tap is the same tensor as the next bank entry
    when the next layer commits), the boolean MLA mask when rows are padded (B > 1); FSDP2 gathers the running unit
    and prefetches the next."""
    if inputs.target_token_chunk is not None:
        return chunked_forward_peaks(inputs, shapes)
    c, s = inputs.target, inputs.target_dtype.itemsize
    N, H, L, T = inputs.batch_size * inputs.seq_len, c.hidden_size, c.num_hidden_layers, inputs.seq_len
    bs = c.attn_res_block_size
    row = N * H * s
    mask = inputs.batch_size * T * T if inputs.batch_size > 1 else 0
    gathered = fsdp_gathers(inputs, shapes)

    def bank_after(i: int) -> int:
        return 0 if bs is None else i // bs + 1

    def taps_held(i: int) -> int:
        def in_bank(t: int) -> bool:
            return bs is not None and (t + 1) % bs == 0 and t + 1 < L

        return sum(1 for t in inputs.aux_layer_ids if t < i and not in_bank(t))

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
    peaks.append(
        LayerPeak(L, final_stream, 0, max(final_ws, len(inputs.aux_layer_ids) * row + row), "output mixer + taps")
    )
    return peaks


def fsdp_gathers(inputs: PlanInputs, shapes: TargetShapes):
    """``u ↦`` bytes FSDP2 holds gathered while unit ``u`` (0 = the embedding, ``i + 1`` = layer ``i``) runs: that
    unit and the prefetched next one (0 when the dense weights are replicated)."""
    units = [shapes.embedding, *shapes.layers]

    def gathered(u: int) -> int:
        if not inputs.dense_sharded:
            return 0
        return sum(unit.nbytes(inputs.target_dtype) for unit in units[u : u + 2] if unit.shardable)

    return gathered


# ---- the token-chunked forward (``target_token_chunk``) --------------------------------------------------------------
# ``k3/token_chunks.py``, ``K3DecoderLayer._forward_segments``, ``KimiK3TextModel.forward_segments``: every layer runs
# its per-token parts on one segment of ``N = B·C`` tokens at a time, writing into one preallocated ``[B,T,H]`` output.
# The counts below were taken op by op from a census of the real chunked forward on the meta device
# (``tests/planning/test_planning_memory_plan_target.py``).


def segment_bounds(inputs: PlanInputs) -> list[tuple[int, int]]:
    """The ``[start, stop)`` token segments of one row on one rank (no empty EP-agreement segments)."""
    T, C = inputs.seq_len, inputs.target_token_chunk
    return TokenSegments(T, C, math.ceil(T / C)).bounds


def mix_peak(N: int, H: int, m: int) -> int:
    """``attn_res_mix`` over ``m`` bank entries at its worst: the fp32 stacked values, their normalised keys, the
    weighted values (``[N, m+1, H]`` each) and their fp32 sum ``[N, H]``."""
    return attn_res_mix_ws(N, H, m) + N * H * FP32


def mla_segment_ws(inputs: PlanInputs, N: int, start: int, stop: int) -> int:
    """One MLA segment (``MLASegments.__call__``) beyond its input: q, the ``kv_b_proj`` output (v a view of it) and
    k stay alive through the call; q zero-padded to the buffer width if narrower; the SDPA output ``[B,C,n,w]`` with
    its fp32 log-sum-exp ``[B,n,C]``; then the output sliced to ``d_v`` and reshaped (a copy when ``d_v < w``; the
    SDPA output stays alive beneath it), beside two of the gate, its sigmoid and the gated product. The key/value
    prefix ``[0, stop)`` is a strided view of the buffers (last dimension contiguous), read in place by the flash
    kernels (CUDA flash and the CPU flash kernel take strided inputs: no copy; only meta's math fallback would copy
    it, in fp32).

    Masks: no mask tensor on CUDA (first segment ``is_causal``; later ones ``causal_lower_right``, which the CUDA
    flash kernel takes as bottom-right causal). On CPU ``causal_lower_right`` has no fused kernel and is
    materialised: a boolean ``[C, stop]`` plus the additive mask in q's dtype that SDPA converts it into."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    n, dqk, dv = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    w, kv_b = max(dqk, dv), c.qk_nope_head_dim + dv
    kept = (2 * dqk + kv_b + (w if dqk != w else 0)) * s  # q, kv_b output, k (and q padded), per token and head
    attention = w * s + FP32  # the SDPA output and its log-sum-exp
    gate = (
        w + (dv if dv != w else 0) + 2 * dv
    ) * s  # the output (its base), reshaped; gate + sigmoid or sigmoid + product
    ws = N * n * (kept + max(attention, gate))
    C = N // inputs.batch_size
    if inputs.device == "cpu" and start > 0 and C > 1:
        ws += C * stop * (1 + s)
    return ws


def chunked_stream_entries(inputs: PlanInputs, i: int) -> int:
    """Distinct ``[B,T,H]`` tensors alive when layer ``i`` runs (``i = L``: the output mixer): its input prefix (the
    output of layer ``i−1``, the embedding for ``i = 0``), the AttnRes bank (the input of each commit layer
    ``ℓ ≤ i``, ``ℓ % block_size == 0``) and the ``prefix`` aux taps captured so far (outputs of layers ``t < i``) —
    one tensor counted once when it is several of these."""
    bs = inputs.target.attn_res_block_size
    outputs = {i - 1} | {t for t in inputs.aux_layer_ids if t < i}
    if bs is not None:
        outputs |= {commit - 1 for commit in range(0, min(i, inputs.target.num_hidden_layers - 1) + 1, bs)}
    return len(outputs)


def chunked_layer_ws(inputs: PlanInputs, i: int) -> tuple[int, str, str]:
    """(bytes, what dominates, MoE note) of token-chunked layer ``i`` beyond the residual stream, at its worst
    segment: the largest of :func:`chunked_layer_parts`."""
    held, candidates, note = chunked_layer_parts(inputs, i)
    kind = max(candidates, key=candidates.__getitem__)
    return held + candidates[kind], kind, note


def chunked_layer_parts(inputs: PlanInputs, i: int) -> tuple[int, dict[str, int], str]:
    """(held, {part: bytes}, MoE note) of token-chunked layer ``i`` beyond the residual stream: what the layer holds
    for all its segments, and each part's worst point on top of it.

    Held for the whole layer: the preallocated ``[B,T,H]`` output; the previous segment's ``[N,H]`` result (the loop
    variable, alive until the next one is assigned); the token mixer's carried state — KDA's fp32 ``S [B,h,d,d]`` and
    its three conv tails, each a ``[B,W−1,D]`` view that keeps its whole ``[B,W−1+C,D]`` concatenation alive
    (``roll_conv_state``), or MLA's two zeroed ``[B,n,T,w]`` key/value buffers; an MoE layer's local experts decoded
    from MXFP4 once, in its first segment (``decoded_once``), held through every later segment, token mixer
    included.

    A segment's own rows ``[N,H]`` (``_mix``): the AttnRes mix ``a_in`` (absent when the bank is empty: ``a_in``
    is then a view of the prefix), the token mixer's normalised input, its output ``att``, the new prefix ``p``
    (``att`` itself at a commit layer), the mix ``m_in`` and its normalised copy, the channel mixer's working set
    (:func:`moe_layer_ws` with the decoded layer held, or the dense SiTU MLP); the first segment instead decodes."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    B, T, H = inputs.batch_size, inputs.seq_len, c.hidden_size
    bounds = segment_bounds(inputs)
    C = bounds[0][1]
    N = B * C
    row = N * H * s
    many = len(bounds) > 1
    # The output is allocated after the first segment's result: with one segment it is held only while written.
    held = B * T * H * s + row if many else 0
    if c.is_kda(i):
        lac = c.linear_attn_config
        h, d, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        # Held from the first segment's token mixer on (that one starts from none).
        state = B * h * d * d * FP32 + 3 * B * (W - 1 + C) * h * d * FP32
        held += state
        token = kda_chunk_ws(c, N, s) - (0 if many else state)
    else:
        w = max(c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
        held += 2 * B * c.num_attention_heads * T * w * s
        token = max(mla_segment_ws(inputs, B * (stop - start), start, stop) for start, stop in bounds)
    decoded = 0
    if c.is_moe(i) and inputs.expert_storage == "mxfp4":
        decoded = s * (c.num_experts // inputs.ep) * 3 * c.expert_hidden_size * c.moe_intermediate_size
    bs = c.attn_res_block_size
    attn_res = bs is not None
    commit = attn_res and i % bs == 0
    bank_before = 0 if bs is None else (i + bs - 1) // bs  # commits ℓ < i
    a_in = row if bank_before else 0
    new_p = row if not commit else 0  # p + att (at a commit layer p is att itself)
    if attn_res:
        channel_rows = a_in + 2 * row + new_p + row  # a_in, att, p, m_in, its norm
    else:
        channel_rows = 2 * row  # h = p + att, its norm
    before_moe = decoded if many else 0  # decoded in the first segment's MoE: held before it from the second on
    candidates = {("KDA chunk form" if c.is_kda(i) else "MLA (SDPA)"): before_moe + a_in + row + token}
    note = ""
    if attn_res:
        mixes = [mix_peak(N, H, bank_before)] if bank_before else []
        mixes.append(a_in + row + new_p + mix_peak(N, H, bank_before + (1 if commit else 0)))
        candidates["AttnRes mix"] = before_moe + max(mixes)
    if c.is_moe(i):
        moe, part, note = moe_layer_ws(inputs, N, decoded_held=True)
        if many:
            candidates[part] = decoded + channel_rows + moe
        first, first_part, _ = moe_layer_ws(inputs, N, scratch=decode_scratch(inputs.device, s))
        candidates[f"{first_part} (first segment)"] = channel_rows + first - (row if many else 0)
    else:
        candidates["dense SiTU MLP"] = channel_rows + situ_nograd_ws(N, c.intermediate_size, s)
    # The residual add after the channel mixer: its result beside its output r (and a_in, att, p, m_in); then the
    # segment's result written into the output (with one segment allocated only then).
    rows_at_add = (a_in + 2 * row + new_p + 2 * row) if attn_res else 3 * row
    candidates["output write"] = decoded + max(rows_at_add, row + (0 if many else B * T * H * s))
    return held, candidates, note


def chunked_forward_peaks(inputs: PlanInputs, shapes: TargetShapes) -> list[LayerPeak]:
    """:func:`target_forward_peaks` of the token-chunked forward: per layer the distinct ``[B,T,H]`` tensors of
    :func:`chunked_stream_entries` and :func:`chunked_layer_ws`; then the output mixer and final norm per segment
    into one more ``[B,T,H]`` output (beside the previous segment's result), and the taps stacked into ``[B,T,3H]``
    once the forward has returned (the taps, the final hidden and their concatenation)."""
    c, s = inputs.target, inputs.target_dtype.itemsize
    B, T, H, L = inputs.batch_size, inputs.seq_len, c.hidden_size, c.num_hidden_layers
    full = B * T * H * s
    gathered = fsdp_gathers(inputs, shapes)
    peaks = [LayerPeak(-1, full, gathered(0), 0, "embedding")]
    for i in range(L):
        ws, what, note = chunked_layer_ws(inputs, i)
        peaks.append(LayerPeak(i, full * chunked_stream_entries(inputs, i), gathered(i + 1), ws, what, note))
    bounds = segment_bounds(inputs)
    N = B * bounds[0][1]
    bs = c.attn_res_block_size
    bank = 0 if bs is None else (L - 1) // bs + 1
    # No AttnRes: the final norm alone (fp32 copy beside its squares, then the normalised fp32 rows).
    mixer = mix_peak(N, H, bank) if bs is not None else N * H * (2 * FP32 + (FP32 if s != FP32 else 0))
    segment = full + N * H * s + mixer if len(bounds) > 1 else max(mixer, full + N * H * s)
    taps = len(set(inputs.aux_layer_ids))
    stacked = (2 * taps + 1) * full - full * chunked_stream_entries(inputs, L)
    peaks.append(
        LayerPeak(L, full * chunked_stream_entries(inputs, L), 0, max(segment, stacked), "output mixer + taps")
    )
    return peaks
