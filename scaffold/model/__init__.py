"""The 3D U-Net, the ladder its layers run on, and the policy that picks each call's rung."""
from scaffold.model.ladder import (FastConcat, FastConv3d, FastConvTranspose3d, FastGroupNorm,
                                   FastMaxPool2, census, format_census, set_ladder)
from scaffold.model.policy import register_rung, select_rung
from scaffold.model.pool import max_pool2
from scaffold.model.unet import UNet3d

__all__ = ["UNet3d", "FastConv3d", "FastConvTranspose3d", "FastGroupNorm", "FastConcat", "FastMaxPool2",
           "census", "format_census", "register_rung", "select_rung", "set_ladder", "max_pool2"]
