"""Stub of Hugging Face `datasets` for torchtitan on a host without it: torchtitan's text loader
imports these names, and the peer harness feeds random tokens instead. Named `hf_datasets`, not
`datasets`, so nothing resolves the real package (xmoe_jax's data sources import it) to this folder;
scripts/peers/titan_run.py registers it as `datasets` only where the real one is missing."""


class Dataset:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("datasets is stubbed (scripts/peers/stubs): the peer harness uses synthetic data")


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is stubbed (scripts/peers/stubs): the peer harness uses synthetic data")
