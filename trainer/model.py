"""The model step of the recipe: load the softmax base, keep a frozen teacher, convert, choose what trains.

Base models load from local files: a diffusers folder (pipeline or transformer), a single-file SD3 /
SD3.5 checkpoint with a local config (the three shipped in `trainer/configs` or `--model.config`; fp8 ones
upcast, scaled-fp8 ones dequantized with `trainer.inputs.fp8`), the
built-in toy, or a Hub repo fetched into the Hugging Face cache (`trainer.inputs.sources` resolves which).
The conversion is `t5core.hosts.diffusers.linearize`, as a user would call it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from t5core.config import BaseArch
from t5core.deltas import Delta, fingerprint
from t5core.hosts.diffusers import T5Handle, arch_of, linearize
from t5core.sd3_keys import diffusers_module, diffusers_to_sd3
from t5core.weights import T5Weights
from trainer.config import ModelConfig, OptimConfig, TrainConfig
from trainer.from_file import carried_deltas, check_start, continue_factors, start_file
from trainer.inputs.fp8 import is_scaled_fp8, read_weights
from trainer.inputs.sources import local_base
from trainer.low_rank import ORIGINAL, add_low_rank, factor_names, low_rank_names
from trainer.presets import get_preset

__all__ = [
    "BaseFiles",
    "ParamSplit",
    "base_files",
    "base_checkpoint_dtype",
    "base_fingerprint",
    "base_weight_files",
    "build_model",
    "build_student",
    "load_base",
    "make_teacher",
    "shipped_config",
    "split_parameters",
    "transformer_folder",
]

logger = logging.getLogger(__name__)

CONFIGS_DIR = Path(__file__).resolve().parent / "configs" / "models"
"""Shipped diffusers transformer configs, one folder each, for offline single-file loading."""
SD3_CLASS = "SD3Transformer2DModel"
_SINGLE_FILE_PREFIX = "model.diffusion_model."


def _check_class(config_file: Path) -> None:
    name = json.loads(config_file.read_text(encoding="utf-8")).get("_class_name")
    if name != SD3_CLASS:
        raise ValueError(
            f"{config_file} describes a {name!r}, not an SD3 / SD3.5 transformer ({SD3_CLASS}). "
            "Give --model.base an SD3-family model."
        )


def transformer_folder(folder: Path) -> tuple[Path, str | None]:
    """The folder holding the transformer's config.json and the subfolder argument to load it."""
    if (folder / "transformer" / "config.json").is_file():
        return folder / "transformer", "transformer"
    if (folder / "config.json").is_file():
        return folder, None
    raise FileNotFoundError(
        f"{folder} is not a diffusers model folder: it has neither transformer/config.json nor config.json. "
        "Give a diffusers pipeline or transformer folder, or a single-file .safetensors checkpoint."
    )


def _single_file_layout(path: Path) -> tuple[int, bool, bool]:
    """(depth, has attn2, has q/k norm) read from the key names of an SD3 single-file checkpoint."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = [key.removeprefix(_SINGLE_FILE_PREFIX) for key in handle.keys()]
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}).") from error
    blocks = {int(key.split(".")[1]) for key in keys if key.startswith("joint_blocks.")}
    if not blocks or "x_embedder.proj.weight" not in keys:
        raise ValueError(
            f"{path} is not an SD3 / SD3.5 checkpoint: it has no joint_blocks.* / x_embedder weights "
            f"(first keys: {sorted(keys)[:3]}). Give an SD3-family model."
        )
    return max(blocks) + 1, any(".attn2." in key for key in keys), any(".ln_q." in key for key in keys)


def shipped_config(path: Path) -> Path:
    layout = _single_file_layout(path)
    for folder in sorted(CONFIGS_DIR.iterdir()):
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if (config["num_layers"], bool(config["dual_attention_layers"]), config["qk_norm"] is not None) == layout:
            logger.info("Model: %s matches the shipped %s config", path.name, folder.name)
            return folder
    depth, dual, qk_norm = layout
    raise ValueError(
        f"{path} has {depth} blocks (attn2: {dual}, q/k norm: {qk_norm}); no shipped config "
        f"({', '.join(p.name for p in sorted(CONFIGS_DIR.iterdir()))}) matches. Pass --model.config with a "
        "folder holding this model's diffusers config.json."
    )


def _single_file_weights(path: Path) -> str | dict[str, torch.Tensor]:
    """What `from_single_file` reads: the checkpoint, or for a scaled-fp8 one its transformer dequantized to
    float32 (diffusers would upcast the fp8 values without their scales)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        scaled = is_scaled_fp8(handle.keys())
    return read_weights(path, torch.float32, prefix=_SINGLE_FILE_PREFIX, what="transformer") if scaled else str(path)


@dataclass(frozen=True, slots=True)
class BaseFiles:
    """Where `--model.base`'s transformer is read from, checked without loading a weight.

    Attributes:
        path: the diffusers folder or the single-file checkpoint.
        config: the folder holding the transformer's diffusers `config.json`.
    """

    path: Path
    config: Path

    @property
    def single_file(self) -> bool:
        return self.path.is_file()

    def read_config(self) -> dict:
        """The transformer's diffusers config."""
        return json.loads((self.config / "config.json").read_text(encoding="utf-8"))


def base_files(config: ModelConfig) -> BaseFiles:
    """`--model.base` resolved and checked as an SD3-family transformer, from its config and key names alone (a
    Hub repo id is downloaded once into the Hugging Face cache).

    Raises:
        FileNotFoundError: the base or its config does not exist (a Hub repo: not found, or not in the cache
            under HF_HUB_OFFLINE=1).
        PermissionError: a gated Hub repo without a token.
        ValueError: the base is not an SD3-family model, or a checkpoint format that would need pickle or a GGUF
            file.
    """
    path = local_base(config)
    if path.is_dir():
        folder, _ = transformer_folder(path)
    elif path.suffix == ".safetensors":
        if config.config:
            folder, _ = transformer_folder(Path(config.config).expanduser())
            _single_file_layout(path)
        else:
            folder = shipped_config(path)
    elif path.suffix == ".gguf":
        raise ValueError(
            f"{path}: a GGUF checkpoint is quantized for inference, and training cannot start from its weights. "
            "Give the fp16 / bf16 .safetensors checkpoint of the same model, or its diffusers folder, as "
            "--model.base."
        )
    else:
        raise ValueError(
            f"{path}: only .safetensors checkpoints are read (other formats need pickle). Convert it to "
            "safetensors, or give a diffusers folder."
        )
    _check_class(folder / "config.json")
    return BaseFiles(path, folder)


def load_base(config: ModelConfig) -> nn.Module:
    """Load the softmax base transformer (fp32, eval mode, on CPU) that `base_files` finds.

    Raises:
        As `base_files`, and ValueError for a scaled-fp8 checkpoint whose fp8 weight lacks its scale.
    """
    preset = get_preset(config.base)
    if preset is not None:
        return preset.load_base()
    from diffusers import SD3Transformer2DModel

    files = base_files(config)
    if files.single_file:
        model = SD3Transformer2DModel.from_single_file(
            _single_file_weights(files.path), config=str(files.config), local_files_only=True, torch_dtype=torch.float32
        )
    else:
        model = SD3Transformer2DModel.from_pretrained(
            str(files.config), local_files_only=True, torch_dtype=torch.float32
        )
    arch_of(model)
    return model.eval()


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_BLOCK_KEYS = ("joint_blocks.", "transformer_blocks.")
"""Transformer-block tensors in SD3 and diffusers naming (a single file may also bundle text encoders)."""


def base_weight_files(config: ModelConfig) -> dict[str, Path]:
    """File name -> path of the files holding the base model's weights, as `--model.base` resolves: a
    model preset's `weight_files`, a single-file checkpoint, or the transformer's `.safetensors` / `.bin`
    files of a diffusers folder or cached Hub repo (named relative to the folder, `transformer/...`).

    Raises:
        FileNotFoundError: as `load_base`, for a base that does not exist.
    """
    preset = get_preset(config.base)
    if preset is not None:
        return preset.weight_files()
    path = local_base(config)
    if path.is_file():
        return {path.name: path}
    folder, subfolder = transformer_folder(path)
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    return {"/".join(filter(None, (subfolder, p.name))): p for p in weights}


def base_checkpoint_dtype(config: ModelConfig) -> torch.dtype:
    """The precision the base checkpoint stores its transformer blocks in, read from the safetensors
    headers (no tensor is loaded): the dtype holding most of the blocks' parameters.

    A T5 weights file holds float32, float16 and bfloat16 tensors: a plain fp8 base gives bfloat16 (which
    holds every fp8 value exactly); a scaled-fp8 base gives float32 (an fp8 value times a float32 scale
    needs it, or unchanged weights would export rounding as deltas), and so does a base whose blocks are
    in neither (fp64, or no safetensors file), with a log line.

    Raises:
        FileNotFoundError: as `load_base`, for a base that does not exist.
    """
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for file in (path for path in base_weight_files(config).values() if path.suffix == ".safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            if is_scaled_fp8(handle.keys()):
                counts["scaled fp8"] = math.inf
            for key in handle.keys():
                if any(block in key for block in _BLOCK_KEYS):
                    part = handle.get_slice(key)
                    counts[part.get_dtype()] = counts.get(part.get_dtype(), 0) + math.prod(part.get_shape())
    stored = max(counts, key=counts.__getitem__) if counts else "none"
    if stored in _SAFETENSORS_DTYPES:
        return _SAFETENSORS_DTYPES[stored]
    if stored.startswith("F8"):
        return torch.bfloat16
    logger.info("Model: the base stores its blocks as %s; exported base.* tensors stay float32", stored)
    return torch.float32


def make_teacher(base: nn.Module, *, dtype: torch.dtype) -> nn.Module:
    """A frozen copy of the softmax base, in `dtype`, for distillation and alignment."""
    teacher = copy.deepcopy(base).to(dtype).eval().requires_grad_(False)
    logger.info("Model: frozen softmax teacher in %s", str(dtype).removeprefix("torch."))
    return teacher


def build_student(base: nn.Module, config: ModelConfig, *, start: T5Weights | None = None) -> T5Handle:
    """Convert the base in place with `linearize`, with fresh T5 modules or from the file `start`
    (`--model.start_from`, `trainer.from_file`); the handle holds the new modules and the undo."""
    if start is None:
        return linearize(base, config=config.t5_config(), layers=config.layers, backend=config.backend)
    check_start(start, config, arch_of(base))
    return linearize(base, weights=start, backend=config.backend)


@dataclass(frozen=True, slots=True)
class ParamSplit:
    """Parameter names (unwrapped model) by role: the new T5 ones, trained inherited ones (the factors of
    low-rank deltas among them), frozen; and the weights that learn a low-rank delta (`--model.rank`),
    named as the base names them (`...to_q.weight`). In a run from a file (`--model.start_from`),
    `carried` holds the file's deltas of SD3 tensors none of whose parameters trains: the export writes
    them as they are (`trainer.from_file.carried_deltas`)."""

    new: tuple[str, ...]
    inherited: tuple[str, ...]
    frozen: tuple[str, ...]
    low_rank: tuple[str, ...] = ()
    carried: Mapping[str, Delta] = field(default_factory=dict, compare=False)

    @classmethod
    def everything(cls, model: nn.Module, *, new: Iterable[nn.Parameter] = ()) -> ParamSplit:
        """Every parameter of `model` trains: those in `new` as new ones, the others as inherited."""
        new_ids = {id(p) for p in new}
        named = [(name, id(param) in new_ids) for name, param in model.named_parameters()]
        return cls(
            new=tuple(name for name, is_new in named if is_new),
            inherited=tuple(name for name, is_new in named if not is_new),
            frozen=(),
        )


def _dead_parameters(handle: T5Handle) -> set[str]:
    """The last block's text-query path: its text outputs are discarded, so these get zero gradient."""
    last = diffusers_module(f"blocks.{handle.arch.depth - 1}.attn") + "."
    return {last + name for name in ("add_q_proj.weight", "add_q_proj.bias", "norm_added_q.weight")}


def split_parameters(
    handle: T5Handle,
    model: ModelConfig,
    optim: OptimConfig,
    *,
    adapted: Iterable[nn.Parameter] = (),
    unused: Iterable[nn.Parameter] = (),
) -> ParamSplit:
    """Decide what trains, and set `requires_grad` accordingly on the converted model.

    The new parameters are T5's and those in `adapted` (a preset's re-initialised weights); those in `unused` (a
    preset's baseline leaves them out of the computation) are frozen. `--model.trainable t5`
    trains the new parameters only; `attention` adds the inherited projections and q/k norms of the converted
    modules; `all` the whole transformer. `--optim.inherited_lr_mult 0` freezes every inherited weight. The last
    block's dead text-query path is always frozen, so DDP needs no unused-parameter search.
    """
    new_ids = {id(p) for p in (*handle.t5_parameters(), *adapted)}
    unused_ids = {id(p) for p in unused}
    converted = tuple(diffusers_module(name) + "." for name in handle.modules)
    dead = _dead_parameters(handle) | {name for name, p in handle.model.named_parameters() if id(p) in unused_ids}
    new, inherited, frozen = [], [], []
    for name, param in handle.model.named_parameters():
        if name in dead:
            role = frozen
        elif id(param) in new_ids:
            role = new
        elif optim.inherited_lr_mult == 0 or model.trainable == "t5":
            role = frozen
        elif model.trainable == "all" or name.startswith(converted):
            role = inherited
        else:
            role = frozen
        role.append(name)
        param.requires_grad_(role is not frozen)
    split = ParamSplit(tuple(new), tuple(inherited), tuple(frozen))
    params = dict(handle.model.named_parameters())
    millions = (sum(params[n].numel() for n in names) / 1e6 for names in (split.new, split.inherited, split.frozen))
    logger.info("Model: training %.2fM new T5 + %.2fM inherited parameters; %.2fM frozen", *millions)
    return split


def _with_low_rank(handle: T5Handle, split: ParamSplit, model: ModelConfig) -> ParamSplit:
    """Give each trained inherited weight matrix a rank `--model.rank` delta (`trainer.low_rank`): its base
    value joins the frozen parameters, its factors the trained inherited ones."""
    weights = low_rank_names(handle.model, split.inherited)
    add_low_rank(handle.model, weights, rank=model.rank, alpha=model.alpha or model.rank)
    names = dict.fromkeys(name for name, _ in handle.model.named_parameters())
    originals = {weight.removesuffix(".weight") + ORIGINAL for weight in weights}
    factors = {name for weight in weights for name in factor_names(weight)}
    untouched = set(split.inherited) - set(weights)
    return ParamSplit(
        new=split.new,
        inherited=tuple(name for name in names if name in untouched or name in factors),
        frozen=tuple(name for name in names if name in set(split.frozen) or name in originals),
        low_rank=weights,
    )


def base_fingerprint(model: nn.Module, arch: BaseArch) -> str:
    """`t5core.deltas.fingerprint` of a diffusers transformer as loaded (before training changes it)."""
    wanted = tuple(f"attn.{projection}.weight" for projection in ("to_q", "to_k", "to_v"))
    image_qkv = {name: p.detach() for name, p in model.named_parameters() if name.endswith(wanted)}
    return fingerprint(diffusers_to_sd3(image_qkv, arch), arch)


def build_model(base: nn.Module, config: TrainConfig) -> tuple[T5Handle, ParamSplit]:
    """Convert the base as `--model` says (from `--model.start_from`'s file when given), let a model preset adapt
    the student (`ModelPreset.adapt_student`) and decide what trains (with low-rank deltas under `--model.rank`,
    continuing the file's); refuses a run where nothing would."""
    start = start_file(config.model.start_from) if config.model.start_from else None
    handle = build_student(base, config.model, start=start)
    if config.loss.feature_weight > 0 and not handle.modules:
        raise ValueError("--loss.feature_weight aligns converted modules, but --model.layers converts none.")
    preset = get_preset(config.model.base)
    adapted, unused = preset.adapt_student(handle, config) if preset is not None and preset.adapt_student else ([], [])
    split = split_parameters(handle, config.model, config.optim, adapted=adapted, unused=unused)
    if config.model.rank and split.inherited:
        split = _with_low_rank(handle, split, config.model)
        if start is not None:
            continue_factors(handle, start.deltas, split.low_rank)
    if start is not None:
        split = replace(split, carried=carried_deltas(start.deltas, split.inherited, handle.arch))
    if not split.new and not split.inherited:
        raise ValueError(
            f"nothing would train: --model.layers {config.model.layers!r} converts no module and --model.trainable "
            f"{config.model.trainable!r} trains only converted ones. Convert layers or use --model.trainable all."
        )
    return handle, split
