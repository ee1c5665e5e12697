"""Loss scaling for fp16 training, hooked into autograd so user scripts need no change (see autograd_hook)."""
from automp.scaling.autograd_hook import current, install, uninstall
from automp.scaling.loss_scale import LossScaleConfig, LossScaler

__all__ = ["LossScaleConfig", "LossScaler", "install", "uninstall", "current"]
