"""The built-in toy: a procedural shapes data set, a miniature SD3.5-Medium teacher and ToyEval.

`python -m trainer.toy.pretrain` makes the shipped teacher; `trainer/run.py` trains the toy as its
default model preset (preset.py registers it with `trainer.presets`). See data.py (data, text and
latent stand-ins), model.py (model, weights, sampler), eval.py (ToyEval, validation loss, teacher
distance) and report.py (teacher vs student table and PNG grid).
"""

from trainer.toy.data import Caption, ToyBatch, decode_latents, embed_captions, encode_images, make_batch, tokenize
from trainer.toy.eval import ToyEvalScore, score_images, teacher_distance, toy_eval, validation_loss
from trainer.toy.model import ToyCond, build_toy_model, load_toy_base, sample, toy_arch
from trainer.toy.report import Comparison, compare, write_grid

__all__ = [
    "Caption",
    "Comparison",
    "ToyBatch",
    "ToyCond",
    "ToyEvalScore",
    "build_toy_model",
    "compare",
    "decode_latents",
    "embed_captions",
    "encode_images",
    "load_toy_base",
    "make_batch",
    "sample",
    "score_images",
    "teacher_distance",
    "tokenize",
    "toy_arch",
    "toy_eval",
    "validation_loss",
    "write_grid",
]
