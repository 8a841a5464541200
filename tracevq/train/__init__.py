"""Training and accuracy evaluation for the exchange methods (issue 6).

The pipeline (`python -m tracevq.train configs/accuracy-digits.yaml`, `make accuracy`):

1. `loops.train_base`: the single-device ViT from scratch on an offline task (`tracevq.data`).
2. `bundle.fit_bundle`: k-means codebooks per exchange point, then `loops.finetune`: model and
   codebooks trained together in `distributed.distributed_logits`, the differentiable
   P-device forward, with `quantizer.TrainableQuantizer` (straight-through estimator,
   commitment loss, EMA or gradient codebook updates, dead-code reset, optional d_q).
3. `tree.build_tree` with each distance; model (`model.pth`, timm names) and `Bundle` saved.
4. `evaluate`: every method through `tracevq.simulate`; `report`: CSV tables and figures.

`study.run_study` plans and runs it from the typed `settings`, in independent `jobs`.
"""
