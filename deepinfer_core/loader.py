"""Load an HF-format safetensors checkpoint directory into a DeepSeek model.

``load_model(model_dir, config, model)`` fills every parameter of an already constructed model
(built with ``torch.empty``) and then calls ``model.post_load()``. What the checkpoint's keys are
called and where each goes is the model's *checkpoint format* (its ``checkpoint_format``, in its
generation's folder: ``models/v3/checkpoint.py``, ``models/v4/checkpoint.py``,
``models/v41/checkpoint.py``); the rest (files, headers, shapes, FP8 / MXFP4 dequantisation, NaN
checks, errors) is shared, here:

* files: ``model.safetensors``, or the shards named by ``model.safetensors.index.json``, or
  else every ``*.safetensors`` file in the directory. Pickle checkpoints (``.bin``, ``.pt``) are
  refused; no remote code is ever run.
* keys (V2/V3's format; the others say how theirs differ): HF / DeepSeek names. Routed experts may be per expert
  (``mlp.experts.E.{gate,up,down}_proj.weight``, what DeepSeek ships and ``save_pretrained``
  writes) or already fused (``mlp.experts.gate_up_proj`` / ``down_proj``); they are copied into
  the model's fused tensors. MTP layer i is read from ``model.layers.{num_hidden_layers + i}``;
  its ``embed_tokens`` and ``shared_head.head`` are ignored (tied to the main model).
* expert parallelism: a model built with ``expert_slots`` (the logical expert of each slot this
  rank holds) gets only those experts of its decoder stack: each is read into its first slot (a
  second copy on the same rank is filled by ``parallel.expert_parallel.ExpertParallel``), the other
  ranks' experts are skipped unread, and a fused checkpoint tensor is read row by row for the
  rank's experts. The MTP layers keep every expert (``expert_slots``).
* MTP: when config.json announces ``num_nextn_predict_layers`` but the checkpoint has no key at
  all under those layers (``save_pretrained`` drops them), the loader calls
  ``model.drop_mtp_layers()`` and logs a warning, so ``model.num_mtp_layers`` and
  ``model.cache_groups(with_mtp=True)`` are final only after loading. Partially present MTP layers are an error.
* block FP8 (``float8_e4m3fn`` + float32 ``weight_scale_inv``, or ``float8_e8m0fnu`` scales as
  V4 ships them): dequantised to the parameter's dtype (W8A16) unless the model keeps FP8 weights
  (``keep_fp8=True``), then copied as is (e8m0 scales converted bit-exactly to float32).
* MXFP4 (V4 routed experts, ``expert_dtype: fp4``): int8 / uint8 / ``float4_e2m1fn_x2`` weights
  [out, in/2] with e8m0 scales [out, in/32], dequantised into the parameter
  (``dequantize_mxfp4``) unless the model keeps them packed (uint8 parameters: ``keep_fp4``,
  ``layers.Experts``), then copied byte for byte, codes and UE8M0 scales alike.
* tensors are read one at a time through ``safe_open`` (memory-mapped) and copied into their
  parameter straight away; dtype conversion happens in that copy.
* every loaded tensor (and every FP8 scale) is checked for NaN / inf after the copy, so a
  corrupt tensor or a value the compute dtype cannot hold is an error naming it, not NaN logits.

Every problem with the checkpoint raises ``CheckpointError`` naming the file and key, checked
from the headers before any tensor is read where possible.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

# the MXFP4 / e8m0 helpers live beside dequantize_fp8_block (the expert ops dequantise with them too);
# imported here under their old names
from deepinfer_core.ops.linear import MXFP4_GROUP, dequantize_fp8_block, dequantize_mxfp4, e8m0_to_float  # noqa: F401

logger = logging.getLogger("deepinfer.loader")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
FP8_HEADER_DTYPES = ("F8_E4M3",)
# Packed MXFP4: two E2M1 codes a byte. I8 / U8 headers count bytes ([out, in/2]); safetensors'
# F4 (torch.float4_e2m1fn_x2) counts values ([out, in]).
FP4_HEADER_DTYPES = ("I8", "U8", "F4")
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
# Keys of an MTP layer that duplicate the main model's embedding and head.
FINITE_CHUNK = 1 << 26  # elements per step of the non-finite scan (a 64 MiB bool temporary)
# Fused routed experts: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I].
class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model, with the file, the key and what to do."""


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: param[expert][rows] (expert / rows None: the whole thing).
    ``source``: only these rows of the checkpoint tensor, in this order (a fused expert tensor
    read for one rank's expert slots)."""

    param: str
    expert: int | None = None
    rows: slice | None = None
    source: tuple[int, ...] | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            tensor = tensor[self.expert]
        if self.rows is not None:
            tensor = tensor[self.rows]
        return tensor


@dataclass
class LoadPlan:
    """What a checkpoint format makes of a checkpoint's keys: ``expected`` checkpoint key -> its
    slot, for every tensor the model needs (keys the checkpoint lacks included, named as the
    checkpoint would name them: they are reported missing); ``companions`` quantised weight key
    -> its scale's key, for weights dequantised at load; ``ignored`` keys read by no one."""

    expected: dict[str, Slot]
    companions: dict[str, str]
    ignored: set[str]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, or CheckpointError saying what is wrong."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}") from e
        files = []
        for name in sorted(set(weight_map.values())):
            path = model_dir / name
            if not path.is_file():
                some = [k for k, v in weight_map.items() if v == name][:3]
                raise CheckpointError(
                    f"{index} references shard {name!r} (keys such as {some}) but {path} does not exist: "
                    "download the missing shard or fix the index"
                )
            files.append(path)
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES) if model_dir.is_dir() else []
    hint = (
        f" It holds pickle checkpoint files {pickles[:3]}, which are refused (they can run arbitrary code): "
        "convert them to safetensors first."
        if pickles
        else " DeepInfer loads safetensors checkpoints only (.bin/pickle files are refused)."
    )
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file found.{hint}")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError / OSError for bad files
        raise CheckpointError(f"{path}: cannot read the safetensors file ({e}); it is truncated or corrupt: download it again") from e


def expert_slots(model, param: str) -> tuple[int, ...] | None:
    """The expert-parallel slots of parameter ``param`` (a model's ``expert_slots``): those of the
    decoder stack's routed experts; None for everything else (the MTP layers keep every expert)."""
    slots = getattr(model, "expert_slots", None)
    return slots if slots is not None and param.startswith("model.") else None


def first_slots(num_slots: int, slots: tuple[int, ...] | None) -> dict[int, int]:
    """Logical expert -> the first of a fused expert tensor's ``num_slots`` slots holding it
    (``slots``: the expert of each slot, a model's ``expert_slots``; None: slot e holds expert e)."""
    if slots is None:
        return {e: e for e in range(num_slots)}
    first: dict[int, int] = {}
    for slot, expert in enumerate(slots):
        first.setdefault(expert, slot)
    return first


def _list(keys, files: dict[str, Path] | None = None, limit: int = 5) -> str:
    keys = sorted(keys)
    shown = [f"{k} ({files[k].name})" if files else k for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(shown) + more


def checkpoint_format(model):
    """The model's checkpoint format (its ``checkpoint_format``, models/contract.py): what the
    checkpoint's keys are called and where each goes (``scale_keys``, ``resolve_mtp``, ``plan``)."""
    return model.checkpoint_format


def load_model(model_dir: str | Path, config, model: torch.nn.Module, *, progress: bool = True) -> None:
    """Fill ``model`` (a DeepseekV3ForCausalLM for ``config``, or any model whose checkpoint
    format ``checkpoint_format`` finds) from the checkpoint in ``model_dir``.

    Drops the model's MTP layers when the checkpoint has none (see the module docstring), then
    calls ``model.post_load()``. Raises CheckpointError for any missing, unexpected or misshapen
    tensor, unreadable file, or FP8 / MXFP4 weight without its scale.
    """
    files = checkpoint_files(model_dir)
    handles = {path: _open(path) for path in files}
    key_file: dict[str, Path] = {}
    for path, handle in handles.items():
        for key in handle.keys():
            if key in key_file:
                raise CheckpointError(f"key {key} is stored twice, in {key_file[key]} and {path}: the checkpoint is inconsistent")
            key_file[key] = path
    index = Path(model_dir) / INDEX_FILE
    if index.is_file():
        for key, name in json.loads(index.read_text())["weight_map"].items():
            if key_file.get(key, Path()).name != name:
                raise CheckpointError(f"{index} maps {key} to {name} but that shard does not hold it: fix the index or the shard")

    fmt = checkpoint_format(model)
    scale_keys: set[str] = set()  # the scales of the quantised weights
    for key, path in key_file.items():
        dtype = handles[path].get_slice(key).get_dtype()
        if dtype not in FP8_HEADER_DTYPES and dtype not in FP4_HEADER_DTYPES:
            continue
        scales = fmt.scale_keys(key)
        scale_keys.update(s for s in scales if s in key_file)
        if scales and not any(scale in key_file for scale in scales):
            what, fix = (
                ("FP8 weight", "the checkpoint is incomplete or not DeepSeek block-FP8")
                if dtype in FP8_HEADER_DTYPES
                else ("packed FP4 (MXFP4) weight", "the checkpoint is incomplete or not DeepSeek's MXFP4")
            )
            raise CheckpointError(
                f"{path}: {what} {key} has no scale {' or '.join(scales)} in the checkpoint: {fix}; download it again"
            )
    fmt.resolve_mtp(model, config, key_file)
    params = model.state_dict(keep_vars=True)
    plan = fmt.plan(model, config, key_file)
    expected, companions, ignored = plan.expected, plan.companions, plan.ignored
    missing = set(expected) - set(key_file)
    if missing:
        raise CheckpointError(
            f"{model_dir}: the checkpoint lacks {len(missing)} tensor(s) the model needs: {_list(missing)}; "
            "the checkpoint does not match config.json (or is incomplete)"
        )
    unexpected = set(key_file) - set(expected) - ignored - set(companions.values())
    if unexpected:
        raise CheckpointError(
            f"{model_dir}: the checkpoint has {len(unexpected)} tensor(s) the model does not use: "
            f"{_list(unexpected, key_file)}; the checkpoint does not match config.json"
        )

    # Header-only checks: shapes and FP8 / MXFP4 scales, before reading any data.
    for key, slot in expected.items():
        handle = handles[key_file[key]]
        header = handle.get_slice(key)
        shape, dtype = tuple(header.get_shape()), header.get_dtype()
        param = params[slot.param]
        want = tuple(slot.view(param).shape)
        if slot.source is not None:  # the whole fused tensor is in the checkpoint: every expert
            want = (config.n_routed_experts, *want[1:])
        if param.dtype == torch.uint8:  # packed MXFP4 kept as stored (keep_fp4): codes or their scales
            _check_packed(key, shape, dtype, want, config, key in scale_keys, key_file)
            continue
        if dtype in FP4_HEADER_DTYPES and param.is_floating_point() and param.dtype != torch.float8_e4m3fn:
            _check_mxfp4(key, shape, dtype, want, config, companions, handles, key_file)
            continue
        if shape != want:
            raise CheckpointError(
                f"{key_file[key]}: {key} has shape {list(shape)} but config.json implies {list(want)}: "
                "the checkpoint and its config.json disagree"
            )
        if dtype in FP8_HEADER_DTYPES and param.dtype != torch.float8_e4m3fn:
            if config.fp8_block is None:
                raise CheckpointError(
                    f"{key_file[key]}: {key} is float8_e4m3fn but config.json has no FP8 quantization_config "
                    "(weight_block_size): add it or use a checkpoint in bf16"
                )
            scale_key = _companion(key, fmt, companions, key_file)
            scale_shape = tuple(handles[key_file[scale_key]].get_slice(scale_key).get_shape())
            grid = (*want[:-2], -(-want[-2] // config.fp8_block[0]), -(-want[-1] // config.fp8_block[1]))
            if scale_shape != grid:
                raise CheckpointError(
                    f"{key_file[scale_key]}: {scale_key} has shape {list(scale_shape)} but weight "
                    f"{list(want)} with weight_block_size {list(config.fp8_block)} needs {list(grid)}"
                )
        elif param.dtype == torch.float8_e4m3fn and dtype not in FP8_HEADER_DTYPES:
            raise CheckpointError(
                f"{key_file[key]}: {key} is {dtype}, but the model keeps this weight in FP8 (keep_fp8=True): "
                "load it with keep_fp8=False or use DeepSeek's block-FP8 checkpoint"
            )

    finite: list[tuple[str, torch.Tensor]] = []  # (key, 0-d bool on the device): one sync at the end
    with torch.no_grad(), tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            for key in handles[path].keys():
                slot = expected.get(key)
                if slot is None:
                    continue
                dst = slot.view(params[slot.param])
                # Each tensor goes straight from the memory-mapped file into its parameter (the copy
                # converts the dtype); FP8 / MXFP4 weights that the model does not keep are first
                # moved to the model's device and dequantised there, not on the host.
                src = _read(handles, key_file, key, slot.source)
                if dst.dtype == torch.uint8:  # packed MXFP4 codes / UE8M0 scale bytes, kept as stored
                    if src.dtype == torch.float8_e8m0fnu:
                        finite.append((key, all_finite(src)))  # byte 255 (NaN)
                    src = src.view(torch.uint8)
                elif src.dtype == torch.float8_e4m3fn and dst.dtype != torch.float8_e4m3fn:
                    scale = _read(handles, key_file, companions[key], slot.source).to(dst.device)
                    finite.append((companions[key], all_finite(scale)))
                    src = dequantize_fp8_block(src.to(dst.device), e8m0_to_float(scale), config.fp8_block, dst.dtype)
                elif src.dtype in FP4_DTYPES and dst.is_floating_point():
                    scale = _read(handles, key_file, companions[key], slot.source).to(dst.device)
                    finite.append((companions[key], all_finite(scale)))
                    src = dequantize_mxfp4(src.to(dst.device), scale, dst.dtype)
                elif src.dtype == torch.float8_e8m0fnu and dst.dtype != torch.float8_e8m0fnu:
                    src = e8m0_to_float(src)  # a kept FP8 weight's scale, bit-exact
                dst.copy_(src)
                finite.append((key, all_finite(dst)))  # after the copy: an overflow of the dtype conversion counts
                bar.update()
    _check_finite(finite, key_file, handles, params, expected, companions)
    model.post_load()


def _companion(key: str, fmt, companions: dict[str, str], key_file: dict[str, Path]) -> str:
    if key not in companions:  # its scale is there (checked first) but the format did not pair it
        raise CheckpointError(
            f"{key_file[key]}: quantised weight {key} has no scale {' or '.join(fmt.scale_keys(key))} that goes "
            "with it: the checkpoint is incomplete or mixes namings; download it again"
        )
    return companions[key]


def _check_packed(key, shape, dtype, want, config, is_scale: bool, key_file) -> None:
    """Header checks of a tensor going into a packed MXFP4 parameter (uint8 ``want``): a packed
    FP4 weight of the same bytes, or (``is_scale``) its e8m0 / uint8 scales of the same shape."""
    path = key_file[key]
    if is_scale:
        if dtype not in ("F8_E8M0", "U8") or shape != want:
            raise CheckpointError(
                f"{path}: {key} is {dtype} {list(shape)}, but the model keeps MXFP4 experts packed and needs their "
                f"scales as e8m0 (or its uint8 bytes) {list(want)}: load with the platform's fp4_experts off "
                "(dequantised experts) or use DeepSeek's MXFP4 checkpoint"
            )
        return
    if dtype not in FP4_HEADER_DTYPES:
        raise CheckpointError(
            f"{path}: {key} is {dtype}, but the model keeps MXFP4 experts packed (keep_fp4=True): load it with "
            "keep_fp4=False (the platform's fp4_experts off) or use a checkpoint with MXFP4 experts"
        )
    _check_expert_dtype(key, dtype, config, path)
    stored = (*want[:-1], want[-1] * 2) if dtype == "F4" else want  # F4 headers count values, not bytes
    if shape != stored:
        raise CheckpointError(
            f"{path}: {key} has shape {list(shape)} but config.json implies {list(stored)} (packed FP4, two values "
            "a byte): the checkpoint and its config.json disagree"
        )


def _check_expert_dtype(key, dtype, config, path) -> None:
    expert_dtype = getattr(config, "expert_dtype", None)
    if expert_dtype != "fp4":
        raise CheckpointError(
            f"{path}: {key} is packed FP4 ({dtype}) but config.json's expert_dtype is {expert_dtype!r}, not 'fp4': "
            "set expert_dtype to 'fp4' in config.json (as DeepSeek-V4 ships it) or use a matching checkpoint"
        )


def _check_mxfp4(key, shape, dtype, want, config, companions, handles, key_file) -> None:
    """Header checks of a packed FP4 weight going into a parameter of shape ``want``."""
    path = key_file[key]
    _check_expert_dtype(key, dtype, config, path)
    packed = want if dtype == "F4" else (*want[:-1], want[-1] // 2)
    if shape != packed or want[-1] % 2:
        raise CheckpointError(
            f"{path}: {key} has shape {list(shape)} but config.json implies {list(packed)} (packed FP4 of a "
            f"{list(want)} weight, two values a byte): the checkpoint and its config.json disagree"
        )
    if key not in companions:
        raise CheckpointError(
            f"{path}: packed FP4 (MXFP4) weight {key} has no scale that goes with it: the checkpoint is "
            "incomplete or not DeepSeek's MXFP4; download it again"
        )
    scale_key = companions[key]
    scale_shape = tuple(handles[key_file[scale_key]].get_slice(scale_key).get_shape())
    grid = (*want[:-1], -(-want[-1] // MXFP4_GROUP))
    if scale_shape != grid:
        raise CheckpointError(
            f"{key_file[scale_key]}: {scale_key} has shape {list(scale_shape)} but packed FP4 weight {key} of "
            f"{list(want)} needs {list(grid)} (one e8m0 scale per {MXFP4_GROUP} inputs): the checkpoint and its "
            "config.json disagree"
        )


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on t's device: no NaN or inf in ``t``, read in chunks (bounded temporaries).
    float8_e4m3fn has no inf; its NaN is every bit of exponent and mantissa set; float8_e8m0fnu's
    NaN is byte 255; integer and packed FP4 tensors are always finite."""
    flat = t.reshape(-1)
    ok = torch.ones((), dtype=torch.bool, device=t.device)
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start : start + FINITE_CHUNK]
        if chunk.dtype == torch.float8_e4m3fn:
            ok &= ~((chunk.view(torch.uint8) & 0x7F) == 0x7F).any()
        elif chunk.dtype == torch.float8_e8m0fnu:  # NaN is byte 255 (torch.isfinite misses it)
            ok &= ~(chunk.view(torch.uint8) == 0xFF).any()
        elif chunk.dtype == torch.float4_e2m1fn_x2:  # every E2M1 code is finite
            continue
        elif chunk.is_floating_point():
            ok &= torch.isfinite(chunk).all()
    return ok


def _check_finite(finite, key_file: dict[str, Path], handles, params, expected: dict[str, Slot], scales: dict[str, str]) -> None:
    """CheckpointError naming every tensor that holds NaN or inf once loaded (``scales``: FP8
    weight key -> its scale's key, for the weights dequantised at load)."""
    if not finite:
        return
    flags = [True] * len(finite)
    by_device: dict[torch.device, list[int]] = {}  # packed MXFP4 scales are checked on the host, the rest where they load
    for i, (_, flag) in enumerate(finite):
        by_device.setdefault(flag.device, []).append(i)
    for rows in by_device.values():  # one sync a device
        for i, ok in zip(rows, torch.stack([finite[i][1] for i in rows]).tolist()):
            flags[i] = ok
    bad = [key for (key, _), ok in zip(finite, flags) if not ok]
    if not bad:
        return
    details = []
    for key in bad[:5]:
        if not bool(all_finite(_read(handles, key_file, key))):
            why = "holds NaN or inf"
        elif key in scales and scales[key] in bad:
            why = f"is dequantised with the non-finite scale {scales[key]}"
        else:  # finite as stored: the conversion to the compute dtype overflowed
            why = f"holds values beyond the range of {params[expected[key].param].dtype}, the dtype it is loaded in"
        details.append(f"{key} ({key_file[key].name}) {why}")
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise CheckpointError(
        f"{len(bad)} checkpoint tensor(s) are not finite: {'; '.join(details)}{more}. The model would produce NaN "
        f"logits: the checkpoint is corrupt (download it again) or needs a wider dtype (e.g. LLM(dtype='float32'))"
    )


def _read(handles: dict, key_file: dict[str, Path], key: str, rows: tuple[int, ...] | None = None) -> torch.Tensor:
    """Checkpoint tensor ``key`` (only its ``rows``, in that order, when given: the other rows
    are not read)."""
    path = key_file[key]
    try:
        if rows is not None:
            part = handles[path].get_slice(key)
            return torch.cat([part[r:r + 1] for r in rows])
        return handles[path].get_tensor(key)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read {key} ({e}); the file is truncated or corrupt: download it again") from e
