"""FP8 dispatch: the routed rows cross the exchange as e4m3 with 1x128 tile scales (about half the
bytes of bf16: D bytes plus 4 bytes per 128 columns) and are dequantized on arrival.

Legend: A rows of the send buffer, M rows of the receive buffer, D model, B = cdiv(D, 128).

    x_recv_MD = fp8_exchange(forward, x_send_AD, recipe)   # forward: the layout's row exchange

The backward pass is the exchange's own backward (the reverse exchange) of the cotangent in the
compute dtype, straight through the quantization, as the combine also stays in the compute dtype
(DeepEP and Megatron send FP8 one way only). Zero rows (padding) quantize to zeros with scale 1.
"""

from __future__ import annotations

import jax

from xmoe_jax.fp8.quantize import dequantize, quantize
from xmoe_jax.fp8.recipe import BLOCK, Recipe


def fp8_exchange(forward, x_send_AD: jax.Array, recipe: Recipe) -> jax.Array:
    """forward(x) with x sent in FP8 (rows in 1 x 128 tiles), returned in x's dtype."""
    block = (1, BLOCK)

    @jax.custom_vjp
    def send(x):
        q_AD, s_AB = quantize(x, block, recipe.act_dtype)
        return dequantize(forward(q_AD), forward(s_AB), block, x.dtype)

    def send_fwd(x):
        _, exchange_vjp = jax.vjp(forward, x)  # the reverse exchange (a pytree: a valid residual)
        return send(x), exchange_vjp

    def send_bwd(exchange_vjp, g_MD):
        return exchange_vjp(g_MD)

    send.defvjp(send_fwd, send_bwd)
    return send(x_send_AD)
