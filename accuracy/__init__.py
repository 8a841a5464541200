"""The accuracy study: training and accuracy evaluation of the exchange methods (issue 6).

It stands on the method library (`tracevq`: models, methods, codebooks, the simulation and
the differentiable P-device forward) and nothing stands on it: neither `tracevq`, `devices`
nor the testbed imports it (tests/unit/test_package_layers.py), and the worker image does not
carry it. What the testbed reads of its results (the table of accuracy per level) it reads
from the files the study writes.

The pipeline (`python -m accuracy configs/accuracy-digits.yaml`, `make accuracy`):

1. `loops.train_base`: the single-device ViT from scratch on an offline task (`data`, with
   `glyphs` for the generated glyph pairs).
2. `tracevq.bundle.fit_bundle`: k-means codebooks per exchange point, then `loops.finetune`:
   model and codebooks trained together in `tracevq.distributed.distributed_logits`, the
   differentiable P-device forward, with `quantizer.TrainingCodec` (straight-through
   estimator, commitment loss, EMA or gradient codebook updates, dead-code reset, optional d_q).
3. `tracevq.tree.build_tree` with each distance; model (`model.pth`, timm names) and `Bundle`
   saved.
4. `evaluate`: every method through `tracevq.simulate`; `report`: CSV tables and figures.

`study.run_study` plans and runs it from the typed `settings`, in independent `jobs`.
"""
