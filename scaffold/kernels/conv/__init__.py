"""Triton convolutions on NDHWC: the launchers of each direction (forward, backward-data,
backward-weight) of conv3d and of the transposed conv with kernel = stride, and whether a call is
supported. Which direction runs where, and the autograd wiring, belong to the model's rung policy
(scaffold.model.conv); this package runs kernels only."""
from .bias_grad import bias_grad
from .directions import (channels_last_weight, conv3d_backward_data, conv3d_backward_weight, conv3d_forward,
                         conv3d_supported, conv_transpose3d_backward_data, conv_transpose3d_backward_weight,
                         conv_transpose3d_forward, conv_transpose3d_supported)

__all__ = ["bias_grad", "channels_last_weight", "conv3d_backward_data", "conv3d_backward_weight",
           "conv3d_forward", "conv3d_supported", "conv_transpose3d_backward_data",
           "conv_transpose3d_backward_weight", "conv_transpose3d_forward", "conv_transpose3d_supported"]
