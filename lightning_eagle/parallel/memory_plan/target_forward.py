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
from lightning_eagle.parallel.memory import TargetShapes
from lightning_eagle.parallel.memory_plan.inputs import FP32, PlanInputs


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
