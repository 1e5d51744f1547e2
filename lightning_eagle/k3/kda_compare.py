"""Whole-model comparison of the fast KDA backends against the naive per-token twin (`k3_target.md` §10).

Why a whole model: on an H200, flash-linear-attention 0.6.0's ``chunk`` kernel matched fla's own naive reference on
isolated random inputs yet moved a full tiny model's logits by up to 3.7. So a GPU KDA kernel is trusted only after the
k3-tiny model run with it agrees with the same model run with :func:`~lightning_eagle.k3.kda_ops.naive_recurrent_kda`.

The comparison builds k3-tiny (fp32, random weights, TF32 off) on the device, runs one right-padded batch through it
once per backend and compares the logits at real tokens: ``max |Δ| ≤ rtol · max |naive logits|`` passes. Its results
go into :mod:`lightning_eagle.k3.kda_records` (``python -m lightning_eagle.commands.check_kda`` does both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from lightning_eagle.k3.kda_ops import fla_kda_available
from lightning_eagle.k3.kda_records import KDACheckResult
from lightning_eagle.k3.model import KimiK3ForCausalLM, set_backends
from lightning_eagle.k3.presets import config_from_name

DEFAULT_RTOL = 1e-3  # of the logit range: fp32 reduction-order noise is ~1e-5, the fla chunk failure was ~4x the range
FLA_BACKENDS = ("fla", "fla_chunk")  # fused_recurrent, chunk


def candidate_backends(device: torch.device | str) -> list[str]:
    """The fast backends that can run on ``device``: the chunked torch path everywhere, fla's kernels on CUDA."""
    return ["chunk", *FLA_BACKENDS] if fla_kda_available(torch.device(device)) else ["chunk"]


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """TF32 off for matmuls and cuDNN convolutions (the short conv), so only the recurrence differs between runs."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def tiny_model_and_batch(device: torch.device, seq_len: int = 200, batch: int = 2, seed: int = 0):
    """k3-tiny in fp32 with random weights and a batch whose second row is right-padded (a quarter of it).

    The default length is not a multiple of the chunk sizes (16 here, 64 in fla), so partial chunks are covered."""
    model = KimiK3ForCausalLM(config_from_name("k3-tiny"), kda_backend="naive").init_weights(seed).freeze().to(device)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    if batch > 1:
        attention_mask[1, seq_len - seq_len // 4 :] = 0
    return model, input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def compare_kda_backends(
    device: torch.device | str,
    backends: Sequence[str] | None = None,
    rtol: float = DEFAULT_RTOL,
    seq_len: int = 200,
    seed: int = 0,
) -> list[KDACheckResult]:
    """Run k3-tiny with each backend and with ``naive``; compare logits at real tokens."""
    device = torch.device(device)
    backends = candidate_backends(device) if backends is None else list(backends)
    with full_fp32():
        model, input_ids, attention_mask = tiny_model_and_batch(device, seq_len, seed=seed)
        valid = attention_mask.bool()
        set_backends(model, kda_backend="naive")
        reference = model(input_ids, attention_mask).logits[valid].float()
        tolerance = rtol * reference.abs().max().item()
        results = []
        for backend in backends:
            set_backends(model, kda_backend=backend)
            try:
                logits = model(input_ids, attention_mask).logits[valid].float()
            except Exception as error:  # a kernel that cannot run here fails the check; the message says why
                results.append(KDACheckResult(backend, None, tolerance, False, f"{type(error).__name__}: {error}"))
                continue
            diff = (logits - reference).abs().max().item()
            passed = bool(torch.isfinite(logits).all()) and diff <= tolerance
            results.append(KDACheckResult(backend, diff, tolerance, passed))
    return results
