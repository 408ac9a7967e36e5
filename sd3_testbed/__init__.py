"""The SD3 testbed, the project's built-in toy: a procedural shapes data set, a miniature SD3.5-Medium teacher,
ToyEval and its measures, for experiments that need a whole model at CPU cost.

It builds on the trainer, never the other way: `python -m sd3_testbed.pretrain` makes the shipped teacher;
`trainer/run.py` trains the toy as its default model preset, which the trainer finds by name (preset.py, the
adapter, registers it with `trainer.presets`). See data.py (data, text and latent stand-ins), model.py
(model, weights, caption conditioning), eval.py (ToyEval, validation loss, teacher
distance) and report.py (teacher vs student table and PNG grid). Import from those modules: the
package re-exports nothing, so importing one part loads no other.
"""
