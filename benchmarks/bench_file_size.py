"""How big is a T5 weights file? Per model and `--model.trainable`, with the `base.*` tensors in the
base checkpoint's precision (`--output.base_dtype base`, the default) and in fp32.

    python -m benchmarks.bench_file_size [--json]
    python -m benchmarks.bench_file_size --toy-weights runs/toy/t5.safetensors [--samples 180] [--json]

Builds each model on the meta device (no weights: the toy from its config, SD3.5 Medium and Large
from the shipped configs), converts it with the `paper` layer spec and splits the parameters as the
trainer does (`trainer.model.split_parameters`). The file holds the new T5 parameters in fp32 and, as
`base.*`, every SD3 tensor holding a trained inherited weight (`t5core.convert.base_sources`, what the
export writes: all of a fused qkv when its q trains). Sizes are tensor bytes; the safetensors header
adds a few KiB. The base precision is the toy file's (float16, read by
`trainer.model.base_checkpoint_dtype`) and 16-bit for the released SD3.5 checkpoints (float16 or
bfloat16: two bytes either way). Before counting, the SD3.5 parameter totals are checked against the
released models; a mismatch prints FAIL instead of sizes.

`--toy-weights` also measures what the smaller file costs on the toy: a toy T5 file exported with fp32
`base.*` (`python trainer/run.py --output.base_dtype fp32`) is re-saved with its `base.*` rounded to the
toy's float16, and both files are loaded into the toy base and scored the same way (ToyEval on
`--samples` captions from the same noise, and the validation loss on its fixed batches), with the RMS
pixel difference between the two sets of samples.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_trainer_memory import PUBLISHED_PARAMS, meta_model
from benchmarks.timing import header_line, write_json
from t5core.convert import base_sources
from t5core.hosts.diffusers import linearize
from trainer.config import ModelConfig, OptimConfig
from trainer.model import base_checkpoint_dtype, split_parameters

TRAINABLE = ("t5", "attention", "all")
SD35_BASE_DTYPE = "16-bit"
"""The released SD3.5 checkpoints store their weights in two bytes each (float16 or bfloat16)."""


def _toy_model():
    from diffusers import SD3Transformer2DModel

    from trainer.toy.model import TOY_CONFIG

    with torch.device("meta"):
        return SD3Transformer2DModel(**TOY_CONFIG)


def file_sizes(model, *, base_bytes: int) -> list[dict]:
    """One row per `--model.trainable` choice: parameter counts and tensor bytes of the exported file."""
    rows = []
    for trainable in TRAINABLE:
        handle = linearize(model, layers="paper")
        split = split_parameters(handle, ModelConfig(trainable=trainable), OptimConfig())
        params = dict(handle.model.named_parameters())
        new = sum(params[name].numel() for name in split.new)
        base = sum(params[name].numel() for name in base_sources(handle.arch, params=split.inherited))
        handle.remove()
        rows.append(
            {
                "trainable": trainable,
                "t5_params": new,
                "base_params": base,
                "bytes_fp32": 4 * (new + base),
                "bytes_base": 4 * new + base_bytes * base,
            }
        )
    return rows


def toy_cost(path: Path, *, samples: int) -> tuple[list[dict], float]:
    """ToyEval and validation loss of a toy T5 file as written (fp32 `base.*`) and with its `base.*`
    rounded to the toy's precision.

    Returns:
        One row per precision, and the RMS pixel difference between their samples.

    Raises:
        ValueError: the file has no `base.*`, or not in fp32.
    """
    from t5core import weights as t5w
    from t5core.hosts.diffusers import linearize as linearize_diffusers
    from trainer.toy.eval import teacher_distance, toy_eval, validation_loss
    from trainer.toy.model import load_toy_base

    loaded = t5w.load(path)
    if not loaded.base or any(t.dtype != torch.float32 for t in loaded.base.values()):
        raise ValueError(
            f"{path}: --toy-weights needs a toy file with fp32 base.* tensors; train one with "
            "`python trainer/run.py --output.base_dtype fp32`."
        )
    dtype = base_checkpoint_dtype(ModelConfig())
    rows, images = [], []
    with tempfile.TemporaryDirectory(prefix="t5-file-size-") as temp:
        rounded = t5w.save(
            Path(temp) / path.name,
            t5w.build_modules(loaded, loaded.config.layers),
            arch=loaded.arch,
            config=loaded.config,
            base={key: tensor.to(dtype) for key, tensor in loaded.base.items()},
            provenance=loaded.provenance,
        )
        for name, file in (("float32", path), (str(dtype).removeprefix("torch."), rounded)):
            student = linearize_diffusers(load_toy_base(), weights=file).model.eval()
            score, sampled = toy_eval(student, count=samples)
            images.append(sampled)
            row = {"base_dtype": name, "file_bytes": file.stat().st_size, **score.as_dict()}
            rows.append(row | {"val_loss": validation_loss(student)})
    return rows, teacher_distance(images[1], images[0])


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/file_size.json")
    parser.add_argument("--toy-weights", type=Path, help="a toy T5 file with fp32 base.*: measure the cost")
    parser.add_argument("--samples", type=int, default=180, help="ToyEval captions for --toy-weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    print(header_line())
    print("T5 weights file, paper layers: T5 parameters in fp32, base.* in the base's precision or fp32")
    print(f"{'model':13} {'trainable':10} {'T5 params':>10} {'base params':>12} {'fp32 base':>11} {'base dtype':>18}")
    toy_dtype = str(base_checkpoint_dtype(ModelConfig())).removeprefix("torch.")
    models = {"toy": (_toy_model, toy_dtype, torch.finfo(getattr(torch, toy_dtype)).bits // 8)}
    models.update({name: (lambda name=name: meta_model(name), SD35_BASE_DTYPE, 2) for name in PUBLISHED_PARAMS})
    rows = []
    for name, (build, dtype, base_bytes) in models.items():
        model = build()
        total = sum(p.numel() for p in model.parameters())
        if name in PUBLISHED_PARAMS and total != PUBLISHED_PARAMS[name]:
            print(f"{name:13} FAIL: {total:,} parameters, the released model has {PUBLISHED_PARAMS[name]:,}")
            continue
        for row in file_sizes(model, base_bytes=base_bytes):
            row = {"model": name, "base_dtype": dtype, **row}
            rows.append(row)
            print(
                f"{name:13} {row['trainable']:10} {row['t5_params'] / 1e6:9.2f}M {row['base_params'] / 1e6:11.1f}M "
                f"{_size(row['bytes_fp32']):>11} {_size(row['bytes_base']) + ' (' + dtype + ')':>18}"
            )
    meta: dict = {"layers": "paper", "sd35_base_dtype": SD35_BASE_DTYPE}
    if args.toy_weights is not None:
        cost, distance = toy_cost(args.toy_weights, samples=args.samples)
        print(f"\ntoy cost of the smaller file: {args.toy_weights}, ToyEval on {args.samples} captions, same noise")
        columns = ("overall", "color", "shape", "position", "size")
        print(f"{'base.*':8} {'file':>9} " + " ".join(f"{name:>8}" for name in columns) + f" {'val loss':>9}")
        for row in cost:
            scores = " ".join(f"{row[name]:8.3f}" for name in columns)
            print(f"{row['base_dtype']:8} {_size(row['file_bytes']):>9} {scores} {row['val_loss']:9.6f}")
        print(f"RMS pixel difference between the two files' samples: {distance:.4f}")
        meta.update(toy_weights=str(args.toy_weights), toy_cost=cost, toy_sample_rms_difference=distance)
    if args.json:
        print(f"wrote {write_json('file_size', rows, meta)}")


if __name__ == "__main__":
    main()
