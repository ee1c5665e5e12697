"""Loss scaling for fp16 training, hooked into autograd so user scripts need no change (see autograd_hook)."""
import torch

from automp.config import AutoMPConfig
from automp.scaling.autograd_hook import current, install, uninstall
from automp.scaling.loss_scale import LossScaleConfig, LossScaler

__all__ = ["LossScaleConfig", "LossScaler", "install", "install_for", "uninstall", "current"]


def install_for(config: AutoMPConfig) -> LossScaler | None:
    """The scaler an automp run needs: fp16 needs loss scaling to keep small gradients from flushing to zero, bf16
    does not, and a script may switch it off."""
    wants = config.wants_fp16 or (config.dtype == "auto" and torch.cuda.is_available()
                                  and not torch.cuda.is_bf16_supported())
    if not wants or config.loss_scale in ("off", None, 0):
        return None
    return install(LossScaler.from_spec(config.loss_scale))
