"""The expert activation's backward with the routing weight, in one pass: `act_grad`."""

from xmoe_jax.kernels.act_grad.api import act_grad

__all__ = ["act_grad"]
