"""The built-in toy: a procedural shapes data set, a miniature SD3.5-Medium teacher and ToyEval.

`python -m trainer.toy.pretrain` makes the shipped teacher; `trainer/run.py` trains the toy as its
default model preset (preset.py registers it with `trainer.presets`). See data.py (data, text and
latent stand-ins), model.py (model, weights, sampler), eval.py (ToyEval, validation loss, teacher
distance) and report.py (teacher vs student table and PNG grid). Import from those modules: the
package re-exports nothing, so importing one part loads no other.
"""
