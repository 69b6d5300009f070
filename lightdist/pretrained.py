"""Pretrained weights read into a split model, by their public path (``lightdist.pretrained.PretrainedWeights``,
``parameters_on_meta``); the reading itself is ``lightdist.checkpoint.pretrained``."""

from lightdist.checkpoint.pretrained import PretrainedWeights, parameters_on_meta

__all__ = ["PretrainedWeights", "parameters_on_meta"]
