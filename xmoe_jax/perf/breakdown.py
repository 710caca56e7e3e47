"""Where a train step's activation bytes go, per token per layer by category, for
`xmoe-plan --breakdown` (the state's bytes per parameter: `plan.state_bytes_per_param`).

Activations: what the backward pass keeps, read off the traced program with JAX's
`saved_residuals` under the config's remat policy, with the layers unrolled so that every
residual names the code that made it, and again under the config's own scan to get what the
scan adds (its stacked residuals). Each residual is put in one category by its source file and
shape; bytes are divided by the batch's tokens and, inside the layers, by the number of layers.
This is the program as JAX hands it to XLA: XLA fuses and frees on top of it (the compiled peak,
`Plan.temporaries`, is the figure to plan with), and on a GPU host `--real-devices` gives that
exactly. docs/design.md writes down the minimum each policy needs, to read these against.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.config import Config

# category <- a residual's remat tag (xmoe_jax/remat.py), else its source file (first match wins)
_NAMES = {
    "attn_qkv": "attention",
    "attn_core": "attention",
    "attn_out": "attention",
    "mlp_hidden": "dense MLP",
    "mlp_out": "dense MLP",
    "moe_dispatched": "permuted rows / exchange",
    "exchange_in": "permuted rows / exchange",
    "exchange_out": "combine",
    "expert_hidden": "expert hidden",
    "expert_out": "combine",
    "moe_out": "combine",
}
_SOURCES = (
    ("loss.py", "loss / logits"),
    ("transformer.py", "loss / logits"),  # the head's cast, the final norm's input
    ("moe/router.py", "router"),
    ("moe/body.py", "router"),
    ("moe/capacity.py", "router"),
    ("dense_mlp", "dense MLP"),  # experts.py's plain MLP (dense layers, shared experts)
    ("moe/experts.py", "expert hidden"),
    ("moe/dense.py", "permuted rows / exchange"),
    ("moe/padded.py", "permuted rows / exchange"),
    ("moe/pft.py", "permuted rows / exchange"),
    ("moe/rbd.py", "permuted rows / exchange"),
    ("moe/layouts.py", "permuted rows / exchange"),
    ("moe/exchange.py", "permuted rows / exchange"),
    ("kernels/permute", "permuted rows / exchange"),
    ("kernels/gmm", "expert hidden"),
    ("norm.py", "norms / residual stream"),
    ("block.py", "norms / residual stream"),
    ("attention.py", "attention"),
    ("mla.py", "attention"),
    ("rope.py", "attention"),
    ("MLP.__call__", "dense MLP"),
    ("layers.py", "attention"),
    ("kernels/shapes.py", "attention"),  # the flash-attention stand-in's output and statistics
)
PER_LAYER = (
    "attention",
    "dense MLP",
    "router",
    "permuted rows / exchange",
    "expert hidden",
    "combine",
    "norms / residual stream",
)


def _category(src: str) -> str:
    # the unrolled trace slices each layer's weights out of the stack; under the scan those
    # slices are the scan's own inputs, forwarded to the backward pass rather than copied
    if "from the argument" in src or "_run_stack" in src:
        return "inputs"
    named = re.search(r"named '(\w+)'", src)
    if named and named.group(1) in _NAMES:
        return _NAMES[named.group(1)]
    for fragment, name in _SOURCES:
        if fragment in src:
            return name
    return "other"


@dataclasses.dataclass
class Breakdown:
    tokens: int
    layers: int
    per_category: dict[str, int]  # bytes in the unrolled program
    scan_extra: int  # bytes the scanned program keeps beyond the unrolled one

    def per_token_per_layer(self, name: str) -> float:
        div = self.tokens * (self.layers if name in PER_LAYER else 1)
        return self.per_category.get(name, 0) / div

    def table(self) -> list[str]:
        lines = ["  kept for the backward pass (traced program; per token, per layer inside the layers):"]
        for name in (*PER_LAYER, "loss / logits", "other"):
            if self.per_category.get(name):
                unit = "B/token/layer" if name in PER_LAYER else "B/token"
                lines.append(
                    f"    {name:<30} {self.per_token_per_layer(name):10.0f} {unit:<14}"
                    f"{self.per_category[name] / 2**30:8.2f} GiB"
                )
        lines.append(f"    {'the scan adds':<30} {self.scan_extra / self.tokens / self.layers:10.0f} B/token/layer"
                     f"{self.scan_extra / 2**30:8.2f} GiB")  # fmt: skip
        return lines


def _residuals(cfg: Config) -> list[tuple]:
    from jax._src.ad_checkpoint import saved_residuals  # the public name only prints

    from xmoe_jax.model import functional as fmodel

    spec = fmodel.model_spec(cfg.model, cfg.parallel)
    tokens_BS = jnp.zeros((cfg.train.micro_batch_size or cfg.train.batch_size, cfg.train.seq_len), jnp.int32)

    bias = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.bias_shape)

    def loss(params):
        return fmodel.loss_terms(spec, params, bias, tokens_BS, tokens_BS)[0]

    return saved_residuals(loss, spec.params_shape)


def activation_breakdown(cfg: Config) -> Breakdown:
    """Residual bytes by category (one device's view of the whole batch: a plan for one device)."""
    model = cfg.model
    batch = cfg.train.micro_batch_size or cfg.train.batch_size
    tokens = batch * cfg.train.seq_len
    unrolled = dataclasses.replace(cfg, model=dataclasses.replace(model, unroll_layers=True))
    per = collections.Counter()
    total_unrolled = 0
    for aval, src in _residuals(unrolled):
        nbytes = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        cat = _category(src)
        if cat == "inputs":
            continue
        per[cat] += nbytes
        total_unrolled += nbytes
    total_scan = sum(
        math.prod(a.shape) * np.dtype(a.dtype).itemsize
        for a, src in _residuals(cfg)
        if "from the argument" not in src
    )
    return Breakdown(tokens, model.num_layers, dict(per), max(total_scan - total_unrolled, 0))
