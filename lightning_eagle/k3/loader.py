"""Load the released K3 checkpoint layout into :class:`KimiK3ForCausalLM`.

Handles: outer VLM or bare text ``config.json``; single or sharded safetensors (``model.safetensors.index.json``);
the ``language_model.`` prefix; skipped ``vision_tower.*`` / ``mm_projector.*``; ``A_log`` stored zero-padded to a
multiple of 128; MXFP4 (``weight_packed``/``weight_scale``) or plain routed experts stacked into
``gate_up_proj = [w1ᵀ | w3ᵀ]`` and ``down_proj = w2ᵀ``; fp32-kept tensors. The model is built on the meta device and
each tensor is materialised exactly once; with ``expert_range`` only that slice of experts is read from disk.

With ``shard``, a function that splits the meta-device model's dense parameters into dim-0 ``DTensor`` shards (e.g.
:func:`lightning_eagle.parallel.dense_shard.shard_dense_weights`), the model is cast and sharded on meta, materialised
once on ``device``, and every sharded tensor is filled from only this rank's rows of the file (no rank reads the full
dense state).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_eagle.k3.config import text_config_from_dict
from lightning_eagle.k3.experts import RoutedExperts
from lightning_eagle.k3.fp32_parameters import is_fp32_parameter
from lightning_eagle.k3.mxfp4 import decode_mxfp4

TEXT_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
SUPPORTED_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiK3ForCausalLM", "KimiLinearForCausalLM")
_EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$"
)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}  # fmt: skip
_FLOAT_NAMES = "a floating-point dtype (BF16/F16/F32/F64)"  # plain (non-MXFP4) tensors


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the key(s), the file and what was expected."""


def read_config(path: Path):
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file}: invalid JSON ({err})") from None
    archs = data.get("architectures") or []
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(f"{config_file}: architectures {archs} are not a Kimi K3 model {SUPPORTED_ARCHITECTURES}")
    try:
        return text_config_from_dict(data, source=str(config_file))
    except (TypeError, ValueError) as err:
        message = str(err)  # text_config_from_dict names the file itself in some messages
        prefixed = message if message.startswith(str(config_file)) else f"{config_file}: {message}"
        raise CheckpointError(prefixed) from None


class SafetensorsCheckpoint:
    """Key → file map over one or many safetensors files; tensors are read lazily, one at a time."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err})") from None
            self.files = {key: path / name for key, name in weight_map.items()}
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise CheckpointError(f"{index}: lists shard {file.name}, which does not exist")
        else:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{path}: no model.safetensors(.index.json) found")
            self.files = {}
            for file in shards:
                for key in self._open(file).keys():
                    self.files[key] = file
        self._handles: dict[Path, object] = {}

    def _open(self, file: Path):
        if file not in getattr(self, "_handles", {}):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{file}: cannot read safetensors file ({err})") from None
            if not hasattr(self, "_handles"):
                return handle
            self._handles[file] = handle
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self.files)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        file = self.files[key]
        handle = self._open(file)
        if key not in handle.keys():
            raise CheckpointError(f"{file}: the index lists {key!r} here but the file does not contain it")
        sl = handle.get_slice(key)
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype())

    def dtype_name(self, key: str) -> str:
        """The stored safetensors dtype string (``"BF16"``, ``"I32"``, ``"F8_E4M3"``, …)."""
        return self._open(self.files[key]).get_slice(key).get_dtype()

    def get(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor, or only its dim-0 ``rows`` (only those bytes are read from the file)."""
        file = self.files[key]
        try:
            if rows is None:
                return self._open(file).get_tensor(key)
            return self._open(file).get_slice(key)[rows]
        except Exception as err:
            raise CheckpointError(f"{file}: cannot read tensor {key!r} ({err})") from None


QUICKSTART_TARGET = Path(__file__).resolve().parents[1] / "assets" / "k3-tiny-chat"


def config_fingerprint(config_text: str) -> str:
    """16 hex digits of the target's ``config.json``: what checkpoints and feature dumps record and compare."""
    return hashlib.sha256(config_text.encode()).hexdigest()[:16]


def named_target(target: str | Path) -> Path:
    """``"quickstart"`` = the bundled tiny K3 that has learned the bundled corpus; anything else is a directory."""
    return QUICKSTART_TARGET if str(target) == "quickstart" else Path(target).expanduser()


def resolve_target_path(target: str | Path) -> Path:
    """:func:`named_target`, checked to be a checkpoint folder (``FileNotFoundError`` naming the path if not)."""
    path = named_target(target)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"target checkpoint {str(path)!r} {what} (expected a K3 checkpoint folder: config.json + *.safetensors, "
            "or 'quickstart' for the bundled tiny K3)"
        )
    return path


def load_k3_checkpoint(
    path: str | Path,
    build: Callable[[object], nn.Module],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    shard: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """The body of :meth:`KimiK3ForCausalLM.from_pretrained` (the public way in): reads ``config.json``, calls
    ``build(text_config)`` on the meta device (the model's own settings stay with the caller), fills every tensor once
    and returns the model frozen."""
    path = named_target(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    config = read_config(path)
    ckpt = SafetensorsCheckpoint(path)
    with torch.device("meta"):
        model = build(config)
    if shard is not None:
        # Shards have fixed dtypes: cast on meta first (fp32 islands stay fp32), then materialise once, uninitialised.
        shard(model.cast_to(dtype))
        model.to_empty(device=torch.device(device))
    StateLoader(model, ckpt, dtype, torch.device(device)).load()
    return model.freeze()


class StateLoader:
    """Maps checkpoint keys onto module parameters, validates everything first, then materialises."""

    def __init__(self, model: nn.Module, ckpt: SafetensorsCheckpoint, dtype: torch.dtype, device: torch.device):
        self.model, self.ckpt, self.dtype, self.device = model, ckpt, dtype, device
        keys = [k for k in ckpt.keys() if not k.startswith(SKIPPED_PREFIXES)]
        self.prefix = TEXT_PREFIX if any(k.startswith(TEXT_PREFIX) for k in keys) else ""
        self.names = {k[len(self.prefix) :]: k for k in keys if k.startswith(self.prefix)}
        self.foreign = [k for k in keys if not k.startswith(self.prefix)]

    def where(self, key: str) -> str:
        return f"{key!r} in {self.ckpt.files[key].name}"

    def load(self) -> None:
        experts = {n for n, m in self.model.named_modules() if isinstance(m, RoutedExperts)}
        plain = {n: p for n, p in self.model.named_parameters() if n.rpartition(".")[0] not in experts}
        expert_keys = defaultdict(dict)  # experts module name → {(e, w): {kind: ckpt key}}
        missing, unexpected, bad_shape, bad_dtype = [], list(self.foreign), [], []
        for name, key in self.names.items():
            m = _EXPERT_KEY.match(name)
            if m:
                expert_keys[m.group(1)].setdefault((int(m.group(2)), m.group(3)), {})[m.group(4)] = key
            elif name not in plain:
                unexpected.append(key)
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in self.names:
            plain.pop("lm_head.weight", None)
        for name, p in plain.items():
            if name not in self.names:
                missing.append(self.prefix + name)
                continue
            key = self.names[name]
            shape, dtype = self.ckpt.meta(key)
            if dtype is None or not dtype.is_floating_point:
                bad_dtype.append(f"{self.where(key)}: expected {_FLOAT_NAMES}, got {self.ckpt.dtype_name(key)}")
            expected = tuple(p.shape)
            if name.endswith("A_log"):
                expected = (math.ceil(p.shape[0] / 128) * 128,)
                if shape == tuple(p.shape):
                    expected = shape  # unpadded A_log is accepted too
            if shape != expected:
                bad_shape.append(f"{self.where(key)}: expected {expected}, got {shape}")
        for mod_name in experts:
            module = self.model.get_submodule(mod_name)
            found = expert_keys.pop(mod_name, {})
            for (e, _w), _kinds in found.items():
                if not 0 <= e < module.num_experts:
                    unexpected.extend(_kinds.values())
            for e in range(module.start, module.start + module.count):
                for w in ("w1", "w2", "w3"):
                    kinds = found.get((e, w), {})
                    shape = (module.intermediate_size, module.hidden_size)
                    if w == "w2":
                        shape = shape[::-1]
                    stem = f"{self.prefix}{mod_name}.{e}.{w}"
                    if "weight" in kinds and module.storage == "mxfp4":
                        bad_shape.append(
                            f"{stem}: expert_storage='mxfp4' needs MXFP4 experts, the checkpoint has "
                            "plain weights (load with expert_storage='dequantized')"
                        )
                    elif "weight" in kinds:
                        got, dtype = self.ckpt.meta(kinds["weight"])
                        if got != shape:
                            bad_shape.append(f"{self.where(kinds['weight'])}: expected {shape}, got {got}")
                        if dtype is None or not dtype.is_floating_point:
                            name = self.ckpt.dtype_name(kinds["weight"])
                            bad_dtype.append(f"{self.where(kinds['weight'])}: expected {_FLOAT_NAMES}, got {name}")
                    elif "weight_packed" in kinds and "weight_scale" in kinds:
                        got_p, dt_p = self.ckpt.meta(kinds["weight_packed"])
                        got_s, dt_s = self.ckpt.meta(kinds["weight_scale"])
                        if shape[1] % 32:
                            bad_shape.append(f"{stem}: MXFP4 needs an input width divisible by 32, got {shape[1]}")
                        elif got_p != (shape[0], shape[1] // 2) or got_s != (shape[0], shape[1] // 32):
                            bad_shape.append(
                                f"{self.where(kinds['weight_packed'])}: expected packed {(shape[0], shape[1] // 2)} "
                                f"+ scale {(shape[0], shape[1] // 32)} for logical {shape}, got {got_p} + {got_s}"
                            )
                        elif dt_p != torch.uint8 or dt_s != torch.uint8:
                            bad_shape.append(f"{stem}: MXFP4 packed/scale must be uint8, got {dt_p}/{dt_s}")
                    else:
                        missing.append(f"{stem}.weight (or .weight_packed + .weight_scale)")
        for mod_name, found in expert_keys.items():  # experts for a module the model does not have
            unexpected.extend(k for kinds in found.values() for k in kinds.values())
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s): {_short(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} key(s): {_short(unexpected)}")
        if bad_shape:
            problems.append(f"mis-shaped {len(bad_shape)} tensor(s): {_short(bad_shape)}")
        if bad_dtype:
            problems.append(f"wrong dtype for {len(bad_dtype)} tensor(s): {_short(bad_dtype)}")
        if problems:
            files = sorted({f.name for f in self.ckpt.files.values()})
            raise CheckpointError(
                f"checkpoint {files[0] if len(files) == 1 else files} does not match "
                f"{type(self.model).__name__} ({self.model.config.num_hidden_layers} layers): " + "; ".join(problems)
            )
        with _same_outcome_on_every_rank(any(isinstance(p, DTensor) for p in plain.values())):
            for name, p in plain.items():
                self._assign(name, self._read_plain(name, p))
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in self.names:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        for mod_name in experts:
            self._load_experts(mod_name, self.model.get_submodule(mod_name))
        leftover = [n for n, p in [*self.model.named_parameters(), *self.model.named_buffers()] if p.is_meta]
        if leftover:
            raise CheckpointError(f"parameters left unmaterialised: {_short(leftover)}")

    def _read_plain(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The values of parameter ``p``: all of them, or this rank's dim-0 rows for a sharded (``DTensor``) one."""
        key = self.names[name]
        if isinstance(p, DTensor):
            t = self.ckpt.get(key, _local_rows(p))  # only this rank's rows are read
            tail = self.ckpt.get(key, slice(p.shape[0], None)) if name.endswith("A_log") else None
        else:
            t = self.ckpt.get(key)
            tail, t = (t[p.shape[0] :], t[: p.shape[0]]) if name.endswith("A_log") else (None, t)
        if tail is not None and tail.numel() and bool((tail != 0).any()):
            raise CheckpointError(f"{self.where(key)}: A_log padding beyond {p.shape[0]} heads is not zero")
        if not torch.isfinite(t.float()).all():
            raise CheckpointError(f"{self.where(key)}: contains NaN or Inf")
        target = torch.float32 if is_fp32_parameter(name) else self.dtype
        return t.to(device=self.device, dtype=target)

    def _assign(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        current = getattr(module, attr)
        if not current.is_meta:  # materialised (and possibly sharded) in advance: fill in place
            (current.to_local() if isinstance(current, DTensor) else current).data.copy_(tensor)
            return
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))

    def _load_experts(self, mod_name: str, module) -> None:
        if module.storage == "mxfp4":
            return self._load_packed_experts(mod_name, module)
        n, Hl, inter = module.count, module.hidden_size, module.intermediate_size
        I2 = 2 * inter
        if module.gate_up_proj.is_meta:
            gate_up = torch.empty(n, Hl, I2, dtype=self.dtype, device=self.device)
            down = torch.empty(n, inter, Hl, dtype=self.dtype, device=self.device)
        else:  # materialised in advance (sharded load): fill in place
            gate_up, down = module.gate_up_proj.data, module.down_proj.data
        for local in range(n):
            e = module.start + local
            # Destinations are transposed (non-contiguous) views of the stacked tensors.
            for w, dest in (
                ("w1", gate_up[local, :, :inter].t()),
                ("w3", gate_up[local, :, inter:].t()),
                ("w2", down[local].t()),
            ):
                stem = f"{mod_name}.{e}.{w}"
                if stem + ".weight" in self.names:
                    dest.copy_(self.ckpt.get(self.names[stem + ".weight"]))
                else:
                    packed = self.ckpt.get(self.names[stem + ".weight_packed"]).to(self.device)
                    scale = self.ckpt.get(self.names[stem + ".weight_scale"]).to(self.device)
                    decode_mxfp4(packed, scale, out=dest, name=self.prefix + stem)
        module.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        module.down_proj = nn.Parameter(down, requires_grad=False)

    def _load_packed_experts(self, mod_name: str, module) -> None:
        """Copy the MXFP4 bytes as stored (no decode): gate/up rows are ``[w1; w3]``, down is ``w2``."""
        inter = module.intermediate_size
        buffers = {
            name: torch.empty_like(b, device=self.device) if b.is_meta else b
            for name, b in module.named_buffers(recurse=False)
        }
        for local in range(module.count):
            e = module.start + local
            for w, rows, stem_kind in (
                ("w1", slice(0, inter), "gate_up"),
                ("w3", slice(inter, 2 * inter), "gate_up"),
                ("w2", slice(None), "down"),
            ):
                stem = f"{mod_name}.{e}.{w}"
                scale = self.ckpt.get(self.names[stem + ".weight_scale"])
                if bool((scale == 255).any()):
                    raise CheckpointError(f"{self.where(self.names[stem + '.weight_scale'])}: MXFP4 scale byte 255")
                buffers[f"{stem_kind}_packed"][local, rows] = self.ckpt.get(self.names[stem + ".weight_packed"])
                buffers[f"{stem_kind}_scale"][local, rows] = scale
        for name, tensor in buffers.items():
            setattr(module, name, tensor)


def _local_rows(param: DTensor) -> slice:
    """The dim-0 rows of the full tensor that this rank's shard holds (FSDP2 splits like ``torch.chunk``:
    ``ceil(n / world)`` rows per rank; the last ranks may hold fewer or none)."""
    mesh = param.device_mesh
    per_rank = -(-param.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, param.shape[0])
    return slice(start, start + param.to_local().shape[0])


class _same_outcome_on_every_rank:
    """Each rank checks only its own rows; a bad value on one rank must stop all of them (the others would block in
    the first all-gather forever). Ranks agree through one all-reduce of a failure flag."""

    def __init__(self, sharded: bool) -> None:
        self.sharded = sharded and dist.is_available() and dist.is_initialized()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.sharded:
            return False
        failed = torch.tensor([0 if exc is None else 1 + dist.get_rank()], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if exc is None and int(failed):
            raise CheckpointError(f"rank {int(failed) - 1} found a bad tensor in its shard of the checkpoint (its "
                                  "error names the key); every rank stops")  # fmt: skip
        return False


def _short(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", … ({len(items) - limit} more)" if len(items) > limit else "")
