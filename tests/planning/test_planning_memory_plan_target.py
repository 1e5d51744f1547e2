"""The memory plan's token-chunked target forward (``planning/target_forward.py``, ``target_token_chunk``)
against what the real chunked forward (``k3/token_chunks.py``, ``K3DecoderLayer._forward_segments``) allocates:

* **Census on the meta device** (the method of ``test_planning_memory_plan.py``: every storage an op creates watched
  through a weak reference), per layer and per part of a layer — the token mixer (KDA), the channel mixer (dense
  SiTU / MoE), the rest (AttnRes mixes, norms, residual adds) — at a medium width and at the real K3 widths: within 3 %.
* **Measured on CPU**: the peak RSS growth of ``target.capture`` in a fresh process (the ``_measure`` technique)
  against the plan's "target forward" phase with ``device="cpu"``: within 5 %.

What meta cannot run as a device would, and how the census answers (none of it changes what is allocated):

* ``F.scaled_dot_product_attention`` on meta picks the math backend (fp32 copies of q/k/v and ``[C, stop]`` scores);
  the census sends it to the CUDA flash kernel's meta function (what CUDA runs for ``is_causal`` and for
  ``causal_lower_right``): output ``[B,C,n,w]``, fp32 log-sum-exp ``[B,n,C]``, the strided key prefix read in place;
* ``causal_lower_right`` (a tensor subclass) cannot be built inside a dispatch mode: it is built outside it;
* the router's ``torch.autocast`` has no meta device type: answered as CPU (``meta_autocast_as_cpu``);
* the ``grouped_mm`` probe reads a value back: meta is declared to run it (CUDA's backend);
* the rows are unpadded (the plan's assumption), so the mask is None: no host read of ``mask.max()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from plan_helpers import flat_plan_inputs, plan_with
from test_planning_memory_plan import MEDIUM, plan_inputs
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from lightning_eagle.draft import Eagle3DraftConfig
from lightning_eagle.k3 import config_from_name
from lightning_eagle.parallel.memory import SkipInit, target_shapes
from lightning_eagle.planning import PlanInputs, build_plan
from lightning_eagle.planning.census import LiveBytes, meta_autocast_as_cpu
from lightning_eagle.planning.cpu_probe import PROBE_ENV
from lightning_eagle.planning.target_forward import (
    chunked_layer_parts,
    chunked_stream_entries,
    target_forward_peak,
    target_forward_peaks,
)

REPO = Path(__file__).resolve().parents[2]


class FlashOnMeta(TorchFunctionMode):
    """SDPA on meta as the CUDA flash kernel runs it (causal, bottom-right aligned for a shorter query block)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask")
            assert mask is None or type(mask).__name__ == "CausalBias", "the census runs unpadded rows only"
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            return flash(q, k, v, 0.0, True, False, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def _lower_right_outside_the_mode(q_len: int, kv_len: int):
    with _disable_current_modes():
        return torch.nn.attention.bias.causal_lower_right(q_len, kv_len)


def target_census(inputs: PlanInputs, monkeypatch) -> dict[tuple, int]:
    """Peak live bytes of the real token-chunked ``capture`` on meta, per window: ``("embed",)``; ``(i, part)`` with
    part ``attn`` (inside the token mixer: KDA, or MLA from ``q_a_proj`` to ``o_proj``), ``mixer`` (inside the
    channel mixer) or ``rest`` (the rest of layer ``i``: AttnRes mixes, norms, the residual adds); ``("final",)``
    (output mixer, final norm, taps stacked). The weights and the input ids are not counted."""
    from lightning_eagle.k3 import KimiK3ForCausalLM, experts, token_chunks
    from lightning_eagle.k3.model import set_token_chunk

    monkeypatch.setattr(token_chunks, "causal_lower_right", _lower_right_outside_the_mode)
    monkeypatch.setitem(experts._GROUPED_MM_PROBES, ("meta", None, inputs.target_dtype), True)
    with torch.device("meta"), SkipInit():
        target = KimiK3ForCausalLM(inputs.target, expert_storage=inputs.expert_storage)
    target = set_token_chunk(target.cast_to(inputs.target_dtype).freeze(), inputs.target_token_chunk)
    ids = torch.zeros(inputs.batch_size, inputs.seq_len, dtype=torch.long, device="meta")
    mode = LiveBytes({t.untyped_storage()._cdata for t in [*target.parameters(), *target.buffers(), ids]})
    peaks: dict[tuple, int] = {}
    window = [("embed",)]

    def enter(name: tuple):
        def hook(*_):
            peaks[window[0]] = max(peaks.get(window[0], 0), mode.peak)
            window[0] = name
            mode.peak = 0  # from the window's first op on: what a returning call frees is not the next window's

        return hook

    handles = []
    for i, layer in enumerate(target.model.layers):
        handles.append(layer.register_forward_pre_hook(enter((i, "rest"))))
        # MLA's segment mixer calls project / gate_output, not forward: its window runs from q_a_proj to o_proj.
        attn = (
            (layer.self_attn, layer.self_attn) if layer.is_kda else (layer.self_attn.q_a_proj, layer.self_attn.o_proj)
        )
        for part, (first, last) in (("attn", attn), ("mixer", (layer.channel_mixer,) * 2)):
            handles.append(first.register_forward_pre_hook(enter((i, part))))
            handles.append(last.register_forward_hook(enter((i, "rest"))))
    handles.append(target.model.layers[-1].register_forward_hook(enter(("final",))))
    try:
        with meta_autocast_as_cpu(), FlashOnMeta(), mode:
            target.capture(ids, None, aux_layer_ids=list(inputs.aux_layer_ids))
            enter(("done",))()
    finally:
        for handle in handles:
            handle.remove()
    return peaks


def planned_windows(inputs: PlanInputs) -> dict[tuple, int]:
    """The plan's bytes for each census window (stream + held + the parts that run in it)."""
    c = inputs.target
    B, T, H, s = inputs.batch_size, inputs.seq_len, c.hidden_size, inputs.target_dtype.itemsize
    peaks = target_forward_peaks(inputs, target_shapes(c))
    windows = {("embed",): peaks[0].total, ("final",): peaks[-1].total}
    for i in range(c.num_hidden_layers):
        held, parts, _ = chunked_layer_parts(inputs, i)
        base = held + B * T * H * s * chunked_stream_entries(inputs, i)
        mixer = [v for k, v in parts.items() if k.startswith(("MoE", "dense"))]
        rest = [v for k, v in parts.items() if k in ("AttnRes mix", "output write")]
        windows[(i, "attn")] = base + parts["KDA chunk form" if c.is_kda(i) else "MLA (SDPA)"]
        windows[(i, "mixer")] = base + max(mixer)
        if rest:
            windows[(i, "rest")] = base + max(rest)
    return windows


def check_against_census(inputs: PlanInputs, monkeypatch, rel: float = 0.03) -> None:
    census = target_census(inputs, monkeypatch)
    planned = planned_windows(inputs)
    for key, value in planned.items():
        assert value == pytest.approx(census[key], rel=rel), (key, value, census[key])
    layers = {i: max(v for k, v in census.items() if k[0] == i) for i in range(inputs.target.num_hidden_layers)}
    for peak in target_forward_peaks(inputs, target_shapes(inputs.target))[1:-1]:
        assert peak.total == pytest.approx(layers[peak.index], rel=rel), (peak.index, peak.kind)
    assert target_forward_peak(inputs, target_shapes(inputs.target)).total == pytest.approx(
        max(census.values()), rel=rel
    )


def medium_inputs(B: int, T: int, C: int) -> PlanInputs:
    return plan_with(plan_inputs(MEDIUM), batch_size=B, seq_len=T, target_token_chunk=C, device="cuda")


@pytest.mark.parametrize(("B", "T", "C"), [(2, 1024, 256), (1, 768, 1024)], ids=["B2-4-segments", "one-segment"])
def test_chunked_target_forward_matches_the_census_medium(B, T, C, monkeypatch):
    check_against_census(medium_inputs(B, T, C), monkeypatch)


def k3_chunked_inputs(T: int, C: int, **target_changes) -> PlanInputs:
    """The real K3 widths (H 7168, 96 MLA heads of 192/128, KDA 96×128, experts 3072 at the 3584 latent) on five
    layers (dense KDA, MoE KDA, MoE MLA), AttnRes blocks of 2 so that the bank grows; fewer experts so that each
    part of a layer, not the decoded experts alone, is checked."""
    target = config_from_name("k3", num_hidden_layers=5, attn_res_block_size=2, **target_changes)
    draft = Eagle3DraftConfig.from_target_config(target, draft_vocab_size=32000, aux_layer_ids=[1, 2, 4])
    return flat_plan_inputs(target, draft, seq_len=T, target_token_chunk=C, aux_layer_ids=(1, 2, 4), reserve_bytes=0)


@pytest.mark.slow
def test_chunked_target_forward_matches_the_census_at_k3_widths(monkeypatch):
    """~1 min on a busy 2-core machine (the KDA chunk loop at H = 7168 on meta)."""
    check_against_census(k3_chunked_inputs(8192, 2048, num_experts=32), monkeypatch)


def test_chunked_plan_grows_linearly_in_T():
    """At the real K3 (93 layers, EP 64, MXFP4, dense weights replicated): from T = 16384 to 65536 the chunked
    forward's peak grows by at most its ``[B,T,H]`` tensors (the stream and the layer's output) and the MLA key/value
    buffers per added token — no ``[T,T]`` or ``[C,T]`` term on CUDA — while the unchunked forward at T = 16384
    already holds more."""
    target = config_from_name("k3")
    draft = Eagle3DraftConfig.from_target_config(target, draft_vocab_size=32000)
    base = flat_plan_inputs(  # dense weights replicated: no FSDP2 gathers, which differ from layer to layer
        target=target, draft=draft, seq_len=16384, world=64, ep=64, shard_dense=False, target_token_chunk=2048
    )
    shapes = target_shapes(target)
    short = target_forward_peak(base, shapes)
    long = target_forward_peak(plan_with(base, seq_len=65536), shapes)
    w = max(target.qk_nope_head_dim + target.qk_rope_head_dim, target.v_head_dim)
    entries = max(chunked_stream_entries(base, i) for i in range(target.num_hidden_layers + 1)) + 1
    per_token = entries * target.hidden_size * 2 + 2 * target.num_attention_heads * w * 2
    assert 0 < long.total - short.total <= (65536 - 16384) * per_token
    assert target_forward_peak(plan_with(base, target_token_chunk=None), shapes).total > long.total


# ---- measured on CPU -------------------------------------------------------------------------------------------------
CPU_SPEC = {**MEDIUM, "B": 1}


def cpu_inputs(T: int, C: int) -> PlanInputs:
    return plan_with(plan_inputs(CPU_SPEC), seq_len=T, target_token_chunk=C, device="cpu")


def _measure_capture(runs: list[tuple[int, int]]) -> list[int]:
    """Peak RSS growth of one token-chunked ``capture`` per (T, C), after a warm-up capture of two segments (every
    kernel of a later segment called once: the first call of a kernel leaves lazy global state behind)."""

    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.model import set_token_chunk

    torch.set_num_threads(1)
    from lightning_eagle.planning.cpu_probe import peak, reset_peak, rss

    inputs = cpu_inputs(*runs[0])
    target = KimiK3ForCausalLM(inputs.target, expert_storage=inputs.expert_storage).init_weights(0)
    target = target.cast_to(inputs.target_dtype).freeze()
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (T, C) in enumerate([(2 * runs[0][1], runs[0][1]), *runs]):
        set_token_chunk(target, C)
        ids = torch.randint(0, inputs.target.vocab_size, (1, T), generator=gen)
        ones = torch.ones_like(ids)
        before = rss()
        reset_peak()
        with torch.no_grad():
            cap = target.capture(ids, ones, aux_layer_ids=list(inputs.aux_layer_ids))
        out.append(peak() - before)
        del cap
    return out[1:]


@pytest.mark.slow
def test_chunked_target_forward_matches_peak_rss_measured_on_cpu():
    """The MEDIUM target (every K3 structure, MXFP4 experts, bf16) at B = 1, token_chunk 1024, T = 4096 in a fresh
    subprocess (T = 8192 measured 143.6 MB against 139.6 planned; ``benchmarks/long_context.py`` covers longer T);
    the plan's "target forward" phase (device="cpu": the materialised lower-right MLA mask, the
    CPU decode's int64 indices) within 5 %."""
    runs = [(4096, 1024)]
    env = {**os.environ, **PROBE_ENV, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tests"), str(Path(__file__).parent), env.get("PYTHONPATH", "")]
    )
    result = subprocess.run(
        [sys.executable, __file__, json.dumps(runs)], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(measured) == len(runs)
    for (T, C), got in zip(runs, measured):
        predicted = build_plan(cpu_inputs(T, C)).phase_bytes("target forward")
        assert got > 5e7  # far above the RSS noise
        assert predicted == pytest.approx(got, rel=0.05), (T, C, predicted, got)


if __name__ == "__main__":
    print(json.dumps(_measure_capture([tuple(r) for r in json.loads(sys.argv[1])])))
