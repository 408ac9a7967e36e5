"""The trainer's typed config: nested sections of settings, each field documented.

Every field is one `--section.field` flag (generated in `trainer.cli`) and one key of a TOML file
(`[section]` tables). Precedence: the defaults here < the TOML file < flags. The defaults are the
built-in toy preset, so `python trainer/run.py` with no arguments trains the toy end to end.
Each section checks its own fields when it is built and raises `ValueError` naming the flag to change;
the checks against model presets and data sources are a separate step, `trainer.presets.check_config`,
which the CLI and `trainer.train.run` call. This module imports nothing of the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from t5core.config import T5_SETTINGS, T5Config
from t5core.contract import Variant
from t5core.hybrid import JointMode, Merge
from t5core.neighborhood import is_neighborhood

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainingConfig",
    "TransferConfig",
    "ValidationConfig",
]

COMFYUI_CHECKPOINTS = "models/checkpoints"
"""Where a ComfyUI install keeps checkpoints (relative to `--model.comfyui`)."""
COMFYUI_TEXT_ENCODERS = "models/text_encoders"
"""Where a ComfyUI install keeps text encoder files (relative to `--model.comfyui`)."""
TEXT_ENCODERS = ("clip_l", "clip_g", "t5xxl")
"""SD3's text encoders, named as ComfyUI names them (each is a `--model.<name>` file flag)."""
COMFYUI_DEFAULT_CHECKPOINT = "sd3.5_medium.safetensors"
"""The checkpoint the shipped workflows load; `--model.comfyui` uses it when `--model.base` is left at `toy`."""
DEFAULT_BASE = "toy"
"""`--model.base` when it is not given: the built-in toy preset."""


def _require(condition: bool, flag: str, message: str) -> None:
    if not condition:
        raise ValueError(f"--{flag}: {message}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The base model and how it is converted."""

    base: str = DEFAULT_BASE
    """`toy` (the built-in toy SD3.5 model), a diffusers folder (a pipeline folder with `transformer/`,
    or a transformer folder with `config.json`), a single-file SD3 / SD3.5 `.safetensors` checkpoint (with or
    without bundled text encoders, as ComfyUI loads them), or a Hugging Face Hub repo id such as
    `stabilityai/stable-diffusion-3.5-medium` (downloaded once into the Hugging Face cache: HF_HOME, HF_TOKEN
    for gated repos, HF_HUB_OFFLINE=1 to use only the cache). With `--model.comfyui`, a bare file name is a
    checkpoint in its `models/checkpoints/`."""
    config: str = ""
    """For a single-file base only: a local folder with the transformer's `config.json`, or a diffusers
    pipeline folder (its `transformer/`, `vae/`, `text_encoder*/`, `scheduler/` configs and `tokenizer*/`
    are used). Empty picks the shipped SD3 Medium / SD3.5 Medium / SD3.5 Large config that matches the
    checkpoint, and the shipped VAE and text encoder configs."""
    comfyui: str = ""
    """A ComfyUI folder (the one holding `models/` and `comfy/`) to take a single-file base from: the
    checkpoint from `models/checkpoints/` (`--model.base` left at `toy` means `sd3.5_medium.safetensors`,
    the shipped workflows' name), text encoders the checkpoint does not bundle from `models/text_encoders/`
    by the workflows' names (`clip_l`, `clip_g`, `t5xxl_fp16`, else `t5xxl_fp8_e4m3fn`, else
    `t5xxl_fp8_e4m3fn_scaled`), and the CLIP and T5 tokenizers from `comfy/`."""
    clip_l: str = ""
    """CLIP-L text encoder file for a single-file base (empty = bundled in the checkpoint, or found through
    `--model.comfyui`); with `--model.comfyui`, a bare name is a file in its `models/text_encoders/`."""
    clip_g: str = ""
    """CLIP-G text encoder file, as `--model.clip_l`."""
    t5xxl: str = ""
    """T5-XXL text encoder file, as `--model.clip_l`; fp8 files (`t5xxl_fp8_e4m3fn`) are upcast and scaled-fp8
    ones (`t5xxl_fp8_e4m3fn_scaled`) dequantized with their scales."""
    revision: str = ""
    """For a Hub repo id: the branch, tag or commit to use (empty = `main`)."""
    layers: str = "all"
    """Layer spec: `all` (every attention module: full linear time), `paper` (the paper's choice: every
    `attn2` and the last 5/24 of the joint blocks), `joint:18-23,attn2:0-12` or module names like
    `blocks.3.attn`."""
    variant: Variant = "swiglu"
    """Inner model of the TTT layer."""
    key_norm_eps: float | None = 1.0
    """Key instance-norm eps; `none` disables the key norm (an ablation)."""
    locality: bool = True
    """Residual depthwise 3x3 convs on image queries and keys."""
    joint_mode: JointMode = "hybrid"
    """How converted joint attention modules attend: `hybrid` = exact softmax wherever text takes part, T5
    between image tokens (docs/method.md); `ttt` = T5 over all tokens (the paper)."""
    merge: Merge = "cumulant"
    """With `--model.joint_mode hybrid`: how text is weighed against images, by the cumulant estimate of
    the image softmax sum (`cumulant`) or by it plus a learned per-head correction (`learned`)."""
    neighborhood: int = 0
    """0, or the odd window side k: every converted module's image rows become 0.5 T5 + 0.5 exact softmax
    over each image query's k x k neighbourhood (the paper's DiT code uses 5; docs/method.md)."""
    backend: Literal["auto", "torch", "triton"] = "auto"
    """T5 attention backend (`T5_BACKEND` overrides `auto`)."""
    trainable: Literal["t5", "attention", "all"] = "all"
    """What trains: `t5` = only the new T5 parameters (inherited weights frozen); `attention` = also
    the inherited projections and q/k norms of the converted modules; `all` = the whole transformer
    (the toy preset: the rest of the network adapts to the new attention)."""
    rank: int = 0
    """0 = the inherited weights that train (`--model.trainable`) train in full; r > 0 = each such weight
    matrix keeps its base value and learns a rank-r delta beside it (LoRA), while vectors (biases, norm
    scales) and the new T5 parameters train in full. The weights file stores the deltas either way."""
    alpha: float = 0.0
    """With `--model.rank r`: the low-rank delta is scaled by alpha / r; 0 = r (scale 1)."""
    start_from: str = ""
    """A T5 weights file (format 4) to start from instead of fresh T5 modules, to adapt it to this base (a
    fine-tune of the base it was trained on, say): the base is converted with it (its T5 modules, its deltas
    added); its T5 settings, layers, `trainable` and `rank` are the run's unless given, and must agree; the
    exported file holds its changes and the run's as deltas against this base."""

    def t5_config(self) -> T5Config:
        """The T5 settings of this section (its fields named in `t5core.config.T5_SETTINGS`) as a `T5Config`;
        its layers stay empty: `layers` is a spec, resolved against the base when it is converted."""
        return T5Config(**{name: getattr(self, name) for name in T5_SETTINGS})

    def __post_init__(self) -> None:
        _require(bool(self.base), "model.base", "give `toy`, a diffusers folder or a .safetensors checkpoint.")
        if self.comfyui:
            self._resolve_comfyui_names()
        _require(
            self.key_norm_eps is None or self.key_norm_eps > 0,
            "model.key_norm_eps",
            f"must be positive or `none`; got {self.key_norm_eps}.",
        )
        _require(
            self.merge == "cumulant" or self.joint_mode == "hybrid",
            "model.merge",
            f"`{self.merge}` weighs text against images in hybrid joint attention; add --model.joint_mode hybrid.",
        )
        _require(self.rank >= 0, "model.rank", f"must be 0 (full) or a positive rank; got {self.rank}.")
        _require(self.alpha >= 0, "model.alpha", f"must not be negative (0 = the rank); got {self.alpha}.")
        _require(
            self.rank == 0 or self.trainable != "t5",
            "model.rank",
            "low-rank deltas train inherited weights, but --model.trainable t5 freezes them; use "
            "--model.trainable attention or all, or --model.rank 0.",
        )
        _require(
            is_neighborhood(self.neighborhood),
            "model.neighborhood",
            f"must be 0 (off) or an odd window side such as 5; got {self.neighborhood}.",
        )

    def _resolve_comfyui_names(self) -> None:
        """Bare file names become paths in the ComfyUI folder (a string rule: files are checked when loading)."""
        root = self.comfyui.rstrip("/")
        base = COMFYUI_DEFAULT_CHECKPOINT if self.base == DEFAULT_BASE else self.base
        if "/" not in base:
            self.base = f"{root}/{COMFYUI_CHECKPOINTS}/{base}"
        for name in TEXT_ENCODERS:
            value = getattr(self, name)
            if value and "/" not in value:
                setattr(self, name, f"{root}/{COMFYUI_TEXT_ENCODERS}/{value}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training samples come from and how they are cached."""

    source: Literal["toy", "cache", "images", "prompts"] = "toy"
    """`toy` = the toy's procedural captioned shapes, made on the fly; `images` = a folder of images with
    `.txt` captions, encoded once with the base pipeline's VAE and text encoders; `prompts` = prompts
    (a text file, one a line, or else the shipped default set) from which the frozen softmax model
    generates latents; `cache` = a folder written earlier by `images` or `prompts`."""
    path: str = ""
    """The image folder, prompts file or cache folder (not used by `toy`); empty with `prompts` = the shipped
    default prompt set (`trainer.inputs.prompt_set`, 3000 prompts)."""
    cache_dir: str = ""
    """Where `images` / `prompts` write their cache; empty means `<output.dir>/data-cache`."""
    resolution: int = 0
    """Pixel side of the square bucket (the other buckets keep about the same area); 0 = the source's
    default: 48 for `toy`, 1024 for `images` and `prompts`."""
    buckets: str = "1:1,4:3,3:4,16:9,9:16"
    """Aspect-ratio buckets (`w:h`, comma-separated); each image goes to the nearest one."""
    pipeline: str = ""
    """`images` / `prompts`: a diffusers pipeline folder whose VAE and text encoders encode the data;
    empty = `--model.base` when that is a pipeline folder."""
    caption_dropout: float = 0.1
    """Probability of training a sample on the empty caption's conditioning. Sampling with classifier-free
    guidance runs the model on the empty caption too, so without it the unconditional branch of the
    converted model is never trained and guided samples degrade (the toy teacher was trained with 0.1)."""
    shard_size: int = 64
    """Samples per cache shard (a safetensors file; preparation resumes shard by shard)."""
    toy_samples: int = 100_000
    """Number of distinct samples of the `toy` source (the default is more than a default run draws, so
    every batch is fresh, as in the teacher's pretraining; a few hundred make a run cycle and overfit)."""
    prompt_limit: int = 0
    """`prompts` source: use only the first this many prompts (0 = all), for a quicker, smaller cache."""
    generate_steps: int = 28
    """`prompts` source: sampling steps of the frozen softmax model."""
    guidance_scale: float = 4.5
    """`prompts` source: classifier-free guidance scale."""
    max_sequence_length: int = 256
    """`images` / `prompts`: T5 text tokens (SD3 uses 77 CLIP + this many T5 tokens)."""

    def __post_init__(self) -> None:
        _require(
            self.resolution >= 0 and self.resolution % 16 == 0, "data.resolution", "must be a multiple of 16 (or 0)."
        )
        _require(0 <= self.caption_dropout < 1, "data.caption_dropout", "must be in [0, 1).")
        _require(self.shard_size >= 1, "data.shard_size", "must be at least 1.")
        _require(self.toy_samples >= 1, "data.toy_samples", "must be at least 1.")
        _require(self.prompt_limit >= 0, "data.prompt_limit", "must not be negative (0 = every prompt).")
        _require(self.generate_steps >= 1, "data.generate_steps", "must be at least 1.")
        _require(self.max_sequence_length >= 1, "data.max_sequence_length", "must be at least 1.")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """Flow matching plus optional distillation from the frozen softmax teacher."""

    flow_weight: float = 1.0
    """Weight of the SD3 flow-matching loss (velocity target noise - x0)."""
    distill_weight: float = 0.0
    """Weight of the output MSE to the frozen softmax teacher (0 = no teacher)."""
    feature_weight: float = 0.0
    """Weight of the per-layer attention-output MSE to the teacher, averaged over converted modules."""
    logit_mean: float = 0.0
    """Mean of the logit-normal timestep density."""
    logit_std: float = 1.0
    """Std of the logit-normal timestep density."""
    shift: float = 1.0
    """Timestep shift: sigma = shift*s / (1 + (shift-1)*s); SD3.5 uses 3.0 (at 1024 px), the 48 px toy 1.0
    (its teacher was pretrained and is sampled without a shift)."""
    weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    """Per-sample loss weighting of the flow-matching loss (diffusers' SD3 schemes)."""

    def __post_init__(self) -> None:
        for name in ("flow_weight", "distill_weight", "feature_weight"):
            _require(getattr(self, name) >= 0, f"loss.{name}", "must not be negative.")
        _require(
            self.flow_weight + self.distill_weight + self.feature_weight > 0,
            "loss.flow_weight",
            "all loss weights are 0; give at least one a positive weight.",
        )
        _require(self.logit_std > 0, "loss.logit_std", "must be positive.")
        _require(self.shift > 0, "loss.shift", "must be positive.")

    @property
    def needs_teacher(self) -> bool:
        return self.distill_weight > 0 or self.feature_weight > 0


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with separate learning rates for the new and the inherited parameters."""

    lr: float = 1e-4
    """Base learning rate."""
    new_lr_mult: float = 20.0
    """Multiplier of `lr` for the new T5 parameters (the paper's code defaults to 20; its help text says 10)."""
    inherited_lr_mult: float = 1.0
    """Multiplier of `lr` for trained inherited weights (DiT5 uses 0.1; the short toy preset 1.0); 0 freezes them."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW eps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    schedule: Literal["constant", "cosine"] = "cosine"
    """Learning-rate schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """`cosine`: the learning rate decays to this fraction of its peak at the last step."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", "must be positive.")
        _require(self.new_lr_mult > 0, "optim.new_lr_mult", "must be positive.")
        _require(self.inherited_lr_mult >= 0, "optim.inherited_lr_mult", "must not be negative (0 freezes).")
        _require(self.weight_decay >= 0, "optim.weight_decay", "must not be negative.")
        _require(0 <= self.beta1 < 1, "optim.beta1", "must be in [0, 1).")
        _require(0 <= self.beta2 < 1, "optim.beta2", "must be in [0, 1).")
        _require(self.grad_clip >= 0, "optim.grad_clip", "must not be negative.")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "must not be negative.")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1].")


@dataclass(kw_only=True, slots=True)
class TransferConfig:
    """Attention transfer, a stage before the fine-tune: each converted module's new T5 parameters learn to
    reproduce its softmax output on the softmax model's own activations (docs/training.md)."""

    steps: int = 0
    """Transfer steps (0 = no transfer); each runs the softmax model once, without gradients, over a
    `--training.batch_size` batch, and trains every converted module on its own inputs and output."""
    lr: float = 1e-3
    """Learning rate of the T5 parameters during the transfer (AdamW, linear warm-up, cosine decay to 0)."""
    warmup_steps: int = 5
    """Linear warm-up steps of the transfer's learning rate."""
    timesteps: Literal["uniform", "logit_normal"] = "uniform"
    """How each sample's noise level is drawn: `uniform` across the whole schedule (then through
    `--loss.shift`), or the fine-tune's logit-normal density (`--loss.logit_mean`, `--loss.logit_std`)."""

    def __post_init__(self) -> None:
        _require(self.steps >= 0, "transfer.steps", "must not be negative (0 = no transfer).")
        _require(self.lr > 0, "transfer.lr", "must be positive.")
        _require(self.warmup_steps >= 0, "transfer.warmup_steps", "must not be negative.")


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """Batch, length, precision and seeding of the run."""

    batch_size: int = 16
    """Global batch size: the samples of one optimizer step, split evenly across processes."""
    accumulate: int = 1
    """Micro-batches per optimizer step: each process runs `batch_size / (processes * accumulate)` samples at a
    time and adds up their gradients before one optimizer step. Lower memory for more time per step; the
    numbers are those of the whole batch at once."""
    steps: int = 150
    """Optimizer steps (the toy's full-linear recipe: 1.25x the paper recipe's 120, docs/toy.md)."""
    max_minutes: float = 0.0
    """Training-time budget in minutes (0 = none), counted over resumes; the run stops, checkpoints and exports
    when it is spent, and a run that spent it is finished (raise it to train longer)."""
    seed: int = 0
    """Seed of data order, noise and timesteps (rank-independent, so N processes see the same global batch)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """`bf16` = bf16 autocast with fp32 trained weights (frozen weights stored in bf16); `fp32` = full precision."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block in the backward pass (less memory, about 30% more compute)."""
    threads: int = 2
    """CPU threads per process for torch ops during the run (0 = torch's default). A few threads avoid
    the oversubscription that makes a shared or multi-process CPU run many times slower; use 1 per
    process when several processes share a small CPU."""

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "training.batch_size", "must be at least 1.")
        _require(self.accumulate >= 1, "training.accumulate", f"must be at least 1 (1 = none); got {self.accumulate}.")
        _require(self.steps >= 0, "training.steps", "must not be negative (0 = no fine-tune, with --transfer.steps).")
        _require(self.max_minutes >= 0, "training.max_minutes", "must not be negative.")
        _require(self.threads >= 0, "training.threads", "must not be negative.")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of `precision`: bfloat16 (autocast, FSDP2 parameters, frozen copies) or float32."""
        return self.autocast_dtype or torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bfloat16 under bf16 precision (autocast, FSDP2 compute parameters, frozen weights), else None."""
        return torch.bfloat16 if self.precision == "bf16" else None


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How processes share the work (torchrun sets the world)."""

    mode: Literal["ddp", "fsdp2"] = "ddp"
    """`ddp` replicates the model; `fsdp2` shards each transformer block (bf16 params, fp32 reduce under bf16)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; `auto` = nccl on CUDA, gloo on CPU."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Device; `auto` = CUDA when available."""
    gpu_memory_gib: float = 0.0
    """Memory per GPU to plan for (0 = the device's own); the run refuses when the plan does not fit."""

    def __post_init__(self) -> None:
        _require(self.gpu_memory_gib >= 0, "parallel.gpu_memory_gib", "must not be negative.")


@dataclass(kw_only=True, slots=True)
class OutputConfig:
    """Where results go and what is reported."""

    dir: str = "runs/toy"
    """Output folder: resolved config, metrics, checkpoints, the T5 weights file and the report."""
    name: str = "t5.safetensors"
    """File name of the exported T5 weights file."""
    comfyui: str = ""
    """A ComfyUI folder (the one holding `models/` or `main.py`): the run also writes the weights file
    into its `models/t5_linearize/`, where the T5 Linearize node lists it, with its model card beside it
    (`<name stem>.md`). A different file of the same name there is refused before training. Empty = only
    `--output.dir`."""
    push_to_hub: str = ""
    """A Hugging Face Hub model repo (`namespace/name`; a bare name goes under the token's user): after the
    run, the weights file and its model card (as `README.md`) are uploaded there in one commit, creating the
    repo when missing. Needs a write token (`hf auth login` or HF_TOKEN), checked before training;
    HF_ENDPOINT picks another Hub. Empty = no upload."""
    hub_private: bool = False
    """With `--output.push_to_hub`: create the repo private (an existing repo keeps its visibility)."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    progress: bool = True
    """Show the rank-0 progress bar."""
    toy_eval_samples: int = 64
    """Toy runs only: ToyEval the teacher and the trained student on this many captions (same noise)
    and write `toy_eval.md` and `grid.png`; 0 skips it. 64 is one sampling batch, which keeps the
    evaluation under a third of the default run (the teacher's samples are shipped); 180 samples every
    caption once and narrows the paired interval from about +-0.11 to +-0.07."""
    base_dtype: Literal["base", "fp32"] = "base"
    """Precision of the deltas of trained inherited weights in the exported file: `base` = the base
    checkpoint's own (float16 or bfloat16 for the released SD3.5 files, float16 for the toy: half the
    size of fp32); `fp32` = the trained changes unrounded. The new T5 parameters are always fp32."""

    def __post_init__(self) -> None:
        _require(bool(self.dir), "output.dir", "must not be empty.")
        _require(self.name.endswith(".safetensors"), "output.name", f"must end in .safetensors; got {self.name!r}.")
        _require(
            "/" not in self.name and "\\" not in self.name,
            "output.name",
            f"is a file name, not a path (the folder is --output.dir); got {self.name!r}.",
        )
        _require(self.log_every >= 1, "output.log_every", "must be at least 1.")
        _require(self.toy_eval_samples >= 0, "output.toy_eval_samples", "must not be negative.")
        _require(
            bool(self.push_to_hub) or not self.hub_private, "output.hub_private", "needs --output.push_to_hub REPO."
        )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Periodic checkpoints and resuming."""

    every: int = 50
    """Checkpoint every this many steps (0 = only at the end)."""
    keep: int = 2
    """Keep this many newest checkpoints."""
    resume: str = "auto"
    """`auto` = continue an unfinished run from the newest complete checkpoint in
    `<output.dir>/checkpoints` (a finished run is left untouched, and a checkpoint past
    `--training.steps` is refused); `never` = refuse to run over an earlier run's checkpoints;
    `force` = train again from the start, replacing them; or a checkpoint folder path."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint.every", "must not be negative.")
        _require(self.keep >= 1, "checkpoint.keep", "must be at least 1.")
        _require(bool(self.resume), "checkpoint.resume", "give `auto`, `never`, `force` or a checkpoint folder.")


@dataclass(kw_only=True, slots=True)
class ValidationConfig:
    """Sample grids and a held-out flow-matching loss during an SD3-family run (a model preset, such as the toy,
    has its own evaluation after training instead)."""

    enabled: bool = False
    """Validate the run: at the start (the softmax teacher and T5 as initialised), every `--validation.every`
    steps and at the end, write a sample grid to `<output.dir>/validation/` and log the held-out loss
    (`val/loss`) in `metrics.jsonl`. Needs the base's text encoders and VAE, as `--data.source images` does."""
    every: int = 250
    """Optimizer steps between validations (0 = only at the start and the end)."""
    prompts: str = ""
    """A text file of sample prompts, one a line (# starts a comment); empty = the first 4 prompts of the shipped
    default set. They are encoded once, into `<output.dir>/validation/prompts.safetensors`."""
    samples_steps: int = 20
    """Sampling steps of each sample (flow-matching Euler, the base scheduler's shift)."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale of the samples (1 = none)."""
    seed: int = 0
    """Seed of the samples' noise, the held-out samples and their noise and timesteps."""
    holdout: int = 16
    """Cached samples kept out of training, on which the held-out loss is measured (0 = no held-out loss)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "validation.every", "must not be negative (0 = only at the start and the end).")
        _require(self.samples_steps >= 1, "validation.samples_steps", "must be at least 1.")
        _require(self.guidance_scale >= 1, "validation.guidance_scale", "must be at least 1 (1 = no guidance).")
        _require(self.holdout >= 0, "validation.holdout", "must not be negative (0 = no held-out loss).")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The whole run: one section per part of the trainer."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def __post_init__(self) -> None:
        _require(
            self.training.steps > 0 or self.transfer.steps > 0,
            "training.steps",
            "is 0 and so is --transfer.steps: nothing would train. Give either a positive number of steps.",
        )
        _require(
            not (self.transfer.steps > 0 and self.model.start_from),
            "transfer.steps",
            "trains each module's T5 parameters against its softmax attention on the base's weights, which a run "
            "that starts from a file (--model.start_from) does not have: its inherited weights start with the "
            "file's deltas, and its T5 parameters are the file's. Give --transfer.steps 0 (a recipe's [transfer] "
            "section included).",
        )

    @staticmethod
    def sections() -> tuple[str, ...]:
        return tuple(item.name for item in fields(TrainConfig))
