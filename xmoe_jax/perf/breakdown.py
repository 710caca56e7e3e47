"""Where a train step's bytes go: state in bytes per parameter, activations in bytes per token per
layer by category, for `xmoe-plan --breakdown`.

State (from the plan's shardings, per device): parameters, optimizer moments, gradients (the
parameters' dtype) and, with micro-batches, the float32 gradient accumulators; divided by the
parameters a device holds.

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

import jax
import jax.numpy as jnp
import numpy as np

from xmoe_jax.config import Config

# category <- the first matching source file fragment of a residual (order matters)
_SOURCES = (
    ("loss.py", "loss / logits"),
    ("transformer.py", "loss / logits"),  # the head's cast, the final norm's input
    ("moe/router.py", "router"),
    ("moe/body.py", "router"),
    ("moe/capacity.py", "router"),
    ("moe/experts.py", "expert hidden"),
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
    ("layers.py", "attention"),
)
PER_LAYER = (
    "attention",
    "router",
    "permuted rows / exchange",
    "expert hidden",
    "combine",
    "norms / residual stream",
)


def _category(src: str, shape: tuple, rows_RD: int, model_dim: int) -> str:
    if "from the argument" in src:
        return "inputs"
    for fragment, name in _SOURCES:
        if fragment in src:
            if name == "expert hidden" and shape and shape[-1] == model_dim and math.prod(shape) >= rows_RD:
                return "combine"  # the experts' [R, D] outputs, kept for the combine's weight gradient
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
    top_k = model.moe.top_k if model.moe is not None else 1
    unrolled = dataclasses.replace(cfg, model=dataclasses.replace(model, unroll_layers=True))
    per = collections.Counter()
    total_unrolled = 0
    for aval, src in _residuals(unrolled):
        nbytes = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        cat = _category(src, tuple(aval.shape), tokens * top_k, model.hidden)
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


def state_bytes_per_param(cfg: Config, params: int, optimizer: int, gradients: int) -> dict[str, float]:
    """Bytes per parameter of what a device holds for its parameters (all figures per device)."""
    itemsize = np.dtype(cfg.model.param_dtype).itemsize
    count = params / itemsize
    accum = 4.0 if cfg.train.micro_batch_size else 0.0
    return {
        "parameters": params / count,
        "optimizer moments": optimizer / count,
        "gradients": gradients / count,
        "micro-batch accumulators": accum,
        "total": (params + optimizer + gradients) / count + accum,
    }
