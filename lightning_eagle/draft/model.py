"""The K3 EAGLE-3 draft (`eagle3_training.md` §3): ``fc`` over the three aux states, one fused decoder layer over
``[input_layernorm(embed), hidden_norm(h)]`` (2H) with NoPE gated MLA and a SiTU MLP, a final norm and an
``lm_head`` over the draft vocabulary, plus the ``d2t``/``t2d`` vocab-map buffers. The same frame with a DeepSeek MLA
layer (``architecture="deepseek_mla"``) lives in :mod:`lightning_eagle.draft.deepseek_mla`.

Module names are the serving layout of §14 (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``embed_tokens``), so the
draft's ``state_dict`` *is* the export key set (with ``embed_tokens`` optional; the engine format of a deepseek_mla
draft names the layer ``layers.0.``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.latent_attention import DEFAULT_KV_CACHE, LatentKV, latent_ttt_attention
from lightning_eagle.draft.materialize import normal_init
from lightning_eagle.draft.pretrained import check_export
from lightning_eagle.draft.ttt_attention import get_ttt_attention
from lightning_eagle.ops.mla import NoPEMLA
from lightning_eagle.ops.norm import K3RMSNorm
from lightning_eagle.ops.situ import SituMLP
from lightning_eagle.run_settings import check_kv_cache

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE-3 fused first layer, whatever its attention and MLP::

        combined = [input_layernorm(embed) ‖ hidden_norm(h)]        # 2H, embeddings first
        h = h + attention(combined)                                 # residual = the carried hidden h
        h = h + mlp(post_attention_layernorm(h))

    Subclasses build the modules and say how attention projects (:meth:`qkv`, positions included), how its output
    leaves (:meth:`attention_output`) and its softmax :attr:`scale`; the attention *core* is a parameter
    (:meth:`run` takes ``attend(q, k, v) -> o``), so the TTT cache (:meth:`forward`) and incremental inference
    (``inference.draft_runner``) share every other op.
    """

    input_layernorm: nn.Module
    hidden_norm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    # Whether :meth:`latent_qkv` / :meth:`latent_kv` exist, i.e. ``kv_cache="latent"`` can run on this layer.
    supports_latent_kv_cache = False

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[input_layernorm(embed) ‖ hidden_norm(h)]`` — embeddings first."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def qkv(
        self, combined: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``combined [B,T,2H]`` → ``q, k [B,n,T,d_qk]``, ``v [B,n,T,d_v]`` (keys as they are cached)."""
        raise NotImplementedError

    def attention_output(self, o: torch.Tensor, combined: torch.Tensor) -> torch.Tensor:
        """``o [B,T,n·d_v]`` → ``[B,T,H]``."""
        raise NotImplementedError

    def latent_qkv(
        self, combined: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``combined`` → ``q [B,n,T,d_qk]``, the normalised KV latent ``[B,1,T,r]`` and the shared rope key
        ``[B,1,T,d_rope]`` as cached (rotated, if the layer rotates) — what ``kv_cache="latent"`` caches."""
        raise NotImplementedError(f"{type(self).__name__} has no latent K/V form (kv_cache='latent')")

    def latent_kv(self) -> LatentKV:
        """How :meth:`latent_qkv`'s latents expand into this layer's per-head K/V."""
        raise NotImplementedError(f"{type(self).__name__} has no latent K/V form (kv_cache='latent')")

    @property
    def scale(self) -> float:
        """The attention softmax scale."""
        return self.self_attn.scale

    def run(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        attend: Attend,
        positions: torch.Tensor | None = None,
        project: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """One step with the attention core ``attend(q, k, v) -> o [B,n,T,d_v]``; returns the new (raw) hidden.
        ``project`` (default :meth:`qkv`) makes what ``attend`` takes (:meth:`latent_qkv` for a latent cache)."""
        combined = self.combine(embeds, hidden)
        q, k, v = (project or self.qkv)(combined, positions)
        o = attend(q, k, v)
        B, n, T, d_v = o.shape
        h = hidden + self.attention_output(o.transpose(1, 2).reshape(B, T, n * d_v), combined)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cache: TTTCache,
        backend: str,
        positions: torch.Tensor | None = None,
        kv_cache: str = DEFAULT_KV_CACHE,
    ) -> torch.Tensor:
        """One TTT step: this step's K/V are appended to ``cache``, the queries attend over it (§4.2). ``kv_cache``
        (``kv_cache``): ``"expanded"`` caches per-head K/V, ``"latent"`` the MLA latent and rope key
        (:mod:`lightning_eagle.draft.latent_attention`)."""
        if check_kv_cache(kv_cache) == "latent":
            return self._latent_forward(embeds, hidden, cache, backend, positions)
        ttt_attention = get_ttt_attention(backend)

        def attend(q, k, v):
            q, k, v = cache.to_attention_layout(q, k, v)
            cache.append(k, v)
            return cache.to_token_layout(ttt_attention(q, cache, self.scale))

        return self.run(embeds, hidden, attend, positions)

    def _latent_forward(self, embeds, hidden, cache: TTTCache, backend: str, positions) -> torch.Tensor:
        get_ttt_attention(backend)  # validates before any work
        latent_kv = self.latent_kv()

        def attend(q, latent, k_rope):
            q, latent, k_rope = cache.to_attention_layout(q, latent, k_rope)
            cache.append(latent, k_rope)
            return cache.to_token_layout(latent_ttt_attention(backend, q, cache, self.scale, latent_kv))

        return self.run(embeds, hidden, attend, positions, project=self.latent_qkv)


class KimiK3Eagle3Layer(Eagle3DecoderLayer):
    """The K3-faithful layer: NoPE gated MLA over the 2H input and a SiTU MLP (§3.3–3.5). Positions are ignored."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = K3RMSNorm(H, eps=eps)
        self.hidden_norm = K3RMSNorm(H, eps=eps)
        # The draft's latent norms use rms_norm_eps (reference parity; the target's use 1e-6) — §3.4.
        self.self_attn = NoPEMLA.from_config(config, input_size=2 * H, output_size=H, latent_norm_eps=eps)
        self.post_attention_layernorm = K3RMSNorm(H, eps=eps)
        self.mlp = SituMLP(H, config.intermediate_size, config.activation_situ_beta, config.activation_situ_linear_beta)

    def qkv(self, combined, positions=None):
        del positions  # NoPE: bit-identical whatever the positions (§3.4)
        return self.self_attn.project(combined)

    def attention_output(self, o, combined):
        return self.self_attn.gate_output(o, combined)

    supports_latent_kv_cache = True

    def latent_qkv(self, combined, positions=None):
        del positions  # NoPE
        return self.self_attn.project_latent(combined)

    def latent_kv(self) -> LatentKV:
        attn = self.self_attn
        return LatentKV(attn.kv_b_proj.weight, attn.num_heads, attn.qk_nope_head_dim)

    def attention(self, combined: torch.Tensor, cache: TTTCache, backend: str) -> torch.Tensor:
        """Project, append this step's K/V to the cache, attend over it, gate and project out (``[B,T,H]``)."""
        q, k, v = self.qkv(combined)
        cache.append(k, v)
        o = get_ttt_attention(backend)(q, cache, self.scale)  # [B,n,T,d_v]
        B, n, T, d_v = o.shape
        return self.attention_output(o.transpose(1, 2).reshape(B, T, n * d_v), combined)


class KimiK3Eagle3Draft(nn.Module):
    """EAGLE-3 draft for a frozen K3 target. Built in fp32; cast only the draft to the training dtype (``d2t`` int64
    and ``t2d`` bool keep their dtypes through ``.to(dtype)``).

    One TTT step: ``h = draft.layer(ids, h, attention_mask, cache)``; ``z = draft.logits(h)``; the unroll lives in
    :func:`lightning_eagle.training.ttt_loss`.

    :func:`build_draft` builds the class ``config.architecture`` names: this K3-faithful one, or a subclass such as
    :class:`~lightning_eagle.draft.deepseek_mla.DeepseekMLAEagle3Draft` for ``"deepseek_mla"``. Subclasses set
    :attr:`architecture`, :attr:`layer_class` and :attr:`norm_class` and register with
    :func:`register_draft_architecture`.
    """

    architecture = "k3"
    layer_class: type[Eagle3DecoderLayer] = KimiK3Eagle3Layer
    norm_class: type[nn.Module] = K3RMSNorm

    def __init__(
        self,
        config: Eagle3DraftConfig,
        attention_backend: str = "eager",
        kv_cache: str = DEFAULT_KV_CACHE,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be a bool, got {activation_checkpointing!r}")
        # as every family's drafter: recompute each step's activations in the backward (the TTT unroll reads it)
        self.activation_checkpointing = activation_checkpointing
        config.validate()  # §3.6: the draft constructor refuses GQA / non-NoPE even for a hand-edited config
        if config.architecture != self.architecture:
            raise ValueError(
                f"{type(self).__name__} builds architecture={self.architecture!r}, the config says "
                f"{config.architecture!r}; build it with lightning_eagle.draft.build_draft(config), which picks the "
                "class"
            )
        self.config = config
        H, V, N_d = config.hidden_size, config.vocab_size, config.draft_vocab_size
        weight = torch.empty(V, H)
        if weight.device.type != "meta":  # normal_ on meta goes through torch._refs, which imports dynamo (seconds)
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(V, H, _weight=weight)
        self.fc = nn.Linear(config.num_aux_hidden_states * config.target_hidden_size, H, bias=False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                [
                    self.norm_class(config.target_hidden_size, eps=config.rms_norm_eps)
                    for _ in range(config.num_aux_hidden_states)
                ]
            )
        self.midlayer = self.layer_class(config)
        self.norm = self.norm_class(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, N_d, bias=False)
        # Default map: the first N_d target ids (identity when N_d == V); the vocab-map builder sets the real one.
        self.register_buffer("d2t", torch.zeros(N_d, dtype=torch.long), persistent=True)
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool), persistent=True)
        if self.t2d.device.type != "meta":  # meta: values come from the loaded state dict
            self.t2d[:N_d] = True
        self.attention_backend = attention_backend
        self.kv_cache = kv_cache
        if config.freeze_embeddings:
            self.freeze_embeddings()

    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters (one of this draft's modules) as SpecForge does: every Linear weight
        N(0, ``config.initializer_range``), norm gains 1 (:func:`~lightning_eagle.draft.materialize.normal_init`;
        :data:`~lightning_eagle.draft.config.DEFAULT_INITIALIZER_RANGE` cites it). What
        :func:`~lightning_eagle.draft.materialize.materialize` runs; the frozen embedding is the target's."""
        normal_init(module, self.config.initializer_range)

    # ---- knobs -------------------------------------------------------------------------------------------------------
    @property
    def attention_backend(self) -> str:
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        get_ttt_attention(name)  # validates
        self._attention_backend = name

    @property
    def kv_cache(self) -> str:
        """What the TTT cache holds per step: ``"expanded"`` (per-head K/V, default) or ``"latent"`` (the MLA latent
        and rope key, expanded inside each step: :mod:`lightning_eagle.draft.latent_attention`)."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, name: str) -> None:
        if check_kv_cache(name) == "latent" and not self.midlayer.supports_latent_kv_cache:
            raise ValueError(
                f"kv_cache='latent' is not supported by the {self.architecture!r} draft "
                f"({type(self.midlayer).__name__} has no latent K/V form); use kv_cache='expanded'"
            )
        self._kv_cache = name

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the draft computes in: its frozen embedding's (under FSDP2 mixed precision the trained weights
        are fp32 shards between their bf16 gathers, so their dtype is not it)."""
        return self.embed_tokens.weight.dtype

    # ---- the four pieces of a TTT step ----------------------------------------------------------------------------
    def project(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``fc`` (+ per-chunk ``fc_norm``) over the concatenated aux states ``[B,T,3H_t]`` → ``[B,T,H]``."""
        if self.config.fc_norm:
            chunks = aux_hidden_states.chunk(self.config.num_aux_hidden_states, dim=-1)
            aux_hidden_states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden_states.to(self.compute_dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: TTTCache,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One TTT step: appends this step's K/V to ``cache`` and returns the new (unshifted) hidden ``[B,T,H]``.

        ``position_ids`` (``[B,T]`` or ``[T]``): the absolute positions of this step's queries and keys; the K3 layer
        ignores them (NoPE, §3.4), a rotary layer defaults them to the TTT convention ``t + len(cache)``
        (:meth:`step_positions`). ``attention_mask`` is the ``[B,T]`` right-padding mask, constant over the unroll
        (the cache refuses a change).
        """
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} does not support sequence packing: attention_mask must be the [B,T] padding "
                f"mask, got shape {tuple(attention_mask.shape)}"
            )
        cache.bind_mask(attention_mask)
        embeds = self.embed(input_ids).to(hidden.dtype)
        positions = self.step_positions(input_ids, len(cache), position_ids)
        h = self.midlayer(embeds, hidden, cache, self.attention_backend, positions, kv_cache=self.kv_cache)
        return self.output_hidden(h)

    forward = layer

    def step_positions(
        self, input_ids: torch.Tensor, step: int, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The rotary positions of TTT step ``step``; None for the NoPE K3 layer (it has no use for them)."""
        del input_ids, step
        return position_ids

    def step_with(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, attend: Attend, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One draft step with a caller-supplied attention core ``attend(q, k, v) -> o`` (incremental inference):
        the same ops as :meth:`layer` except the cache."""
        embeds = self.embed(input_ids).to(hidden.dtype)
        return self.output_hidden(self.midlayer.run(embeds, hidden, attend, positions))

    def output_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """What the next step receives: ``h``, or ``norm(h)`` with ``norm_output``."""
        return self.norm(h) if self.config.norm_output else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(h))`` over the draft vocabulary (``lm_head(h)`` with ``norm_output``)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def fsdp_units(self) -> list[nn.Module]:
        """What ``model.draft.shard`` makes FSDP2 units (each gathered for its forward and backward): ``fc`` (+ each
        ``fc_norm``), the decoder layer, the final norm and ``lm_head``. The frozen embedding stays replicated (no
        gradient, no optimizer state; every rank looks tokens up locally)."""
        return [self.fc, *(getattr(self, "fc_norm", None) or []), self.midlayer, self.norm, self.lm_head]

    # ---- embeddings and vocabulary map ------------------------------------------------------------------------------
    def freeze_embeddings(self) -> None:
        self.embed_tokens.weight.requires_grad_(False)

    @torch.no_grad()
    def copy_embeddings_from(self, weight: torch.Tensor) -> None:
        """Copy the target's ``embed_tokens.weight`` (a sharded DTensor is gathered first), cast to our dtype."""
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)}, the draft needs "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)"
            )
        self.embed_tokens.weight.copy_(weight.to(device=self.embed_tokens.weight.device))

    @property
    def selected_token_ids(self) -> torch.Tensor:
        """Target id of each draft id: ``arange(N_d) + d2t`` (ascending in this library)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        """Install the map from the ascending target ids of the draft vocabulary (§9): ``d2t = selected − arange``,
        ``t2d[selected] = True``. ``lm_head`` row i must mean target id ``selected[i]``."""
        selected = selected_token_ids.reshape(-1).to(device=self.d2t.device, dtype=torch.long)
        validate_selected_token_ids(selected, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(selected - torch.arange(selected.numel(), device=selected.device))
        self.t2d.zero_()
        self.t2d[selected] = True

    # ---- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        target_embedding: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        attention_backend: str = "eager",
        kv_cache: str = DEFAULT_KV_CACHE,
    ) -> KimiK3Eagle3Draft:
        """Load our export (``midlayer.*``), its engine format or a NeMo Automodel export (``model.layers.0.*``) as the
        draft class ``config.json`` names (a ``deepseek_mla`` export gives a
        :class:`~lightning_eagle.draft.deepseek_mla.DeepseekMLAEagle3Draft`), checked by
        :func:`~lightning_eagle.draft.pretrained.check_export`.

        Tensors keep their stored dtype unless ``dtype`` is given. An export without ``embed_tokens.weight`` (frozen
        embedding omitted, §14.1) needs the target's: pass ``target_embedding`` or call ``copy_embeddings_from``
        later. Until then the embedding is NaN, which marks it missing: the inference entry points that also get the
        target (``speculative_generate``, ``evaluate_acceptance``, ``DraftRunner(draft, target)``) fill it from the
        target's, and anything else that uses it yields NaN instead of plausible garbage.
        """
        folder = Path(path)
        config, state = check_export(folder)
        has_embeddings = "embed_tokens.weight" in state
        with torch.device("meta"):
            draft = build_draft(config, attention_backend=attention_backend, kv_cache=kv_cache)
        if not has_embeddings:
            if target_embedding is not None:
                if hasattr(target_embedding, "full_tensor"):
                    target_embedding = target_embedding.full_tensor()
                if tuple(target_embedding.shape) != (config.vocab_size, config.hidden_size):
                    raise ValueError(
                        f"target_embedding has shape {tuple(target_embedding.shape)}, the draft in {folder} needs "
                        f"{(config.vocab_size, config.hidden_size)} (vocab_size, hidden_size)"
                    )
                # in the dtype asked for: a bf16 export served in fp32 shares the fp32 target table unrounded (as vLLM)
                state["embed_tokens.weight"] = target_embedding.detach().to(dtype or state["fc.weight"].dtype).clone()
            else:
                warnings.warn(
                    f"{folder} has no embed_tokens.weight (frozen embedding omitted); the draft's embedding is NaN "
                    "until copy_embeddings_from(target embed_tokens.weight) is called",
                    stacklevel=2,
                )
                shape = (config.vocab_size, config.hidden_size)
                state["embed_tokens.weight"] = torch.full(shape, float("nan"), dtype=state["fc.weight"].dtype)
        draft.load_state_dict(state, strict=True, assign=True)
        if config.freeze_embeddings:
            draft.freeze_embeddings()
        if dtype is not None:
            draft.to(dtype)
        return draft.to(device)


# The draft classes by ``config.architecture``: each class registers itself where it is defined (the package imports
# them all), so building never imports a subclass's module from here.
DRAFT_ARCHITECTURES: dict[str, type[KimiK3Eagle3Draft]] = {}


def register_draft_architecture(cls: type[KimiK3Eagle3Draft]) -> type[KimiK3Eagle3Draft]:
    """Class decorator: ``build_draft`` builds ``cls`` for configs whose ``architecture`` is ``cls.architecture``."""
    DRAFT_ARCHITECTURES[cls.architecture] = cls
    return cls


def build_draft(
    config: Eagle3DraftConfig,
    attention_backend: str = "eager",
    kv_cache: str = DEFAULT_KV_CACHE,
    activation_checkpointing: bool = False,
) -> KimiK3Eagle3Draft:
    """The draft ``config.architecture`` names (``"k3"``: :class:`KimiK3Eagle3Draft`; ``"deepseek_mla"``:
    :class:`~lightning_eagle.draft.deepseek_mla.DeepseekMLAEagle3Draft`), built in fp32 (or on the ambient device)."""
    cls = DRAFT_ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"unknown draft architecture {config.architecture!r}; choose one of {sorted(DRAFT_ARCHITECTURES)}"
        )
    return cls(config, attention_backend, kv_cache, activation_checkpointing)


register_draft_architecture(KimiK3Eagle3Draft)


def validate_selected_token_ids(selected: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """``selected`` must be N_d distinct, strictly ascending target ids in ``[0, V)`` (§9 step 4)."""
    if selected.dim() != 1 or selected.numel() != draft_vocab_size:
        raise ValueError(f"expected {draft_vocab_size} selected token ids, got shape {tuple(selected.shape)}")
    if selected.numel() and (selected.min() < 0 or selected.max() >= vocab_size):
        raise ValueError(f"selected token ids must lie in [0, {vocab_size})")
    if selected.numel() > 1 and not bool((selected[1:] > selected[:-1]).all()):
        raise ValueError(
            "selected token ids must be distinct and sorted ascending (lm_head row order == t2d order, §9); "
            "sort them and permute lm_head rows accordingly"
        )
