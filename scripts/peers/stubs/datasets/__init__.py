"""Stub of Hugging Face `datasets` for torchtitan on a host without it: torchtitan's text loader
imports these names, and the peer harness feeds random tokens instead (scripts/peers/titan_run.py)."""


class Dataset:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("datasets is stubbed (scripts/peers/stubs): the peer harness uses synthetic data")


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is stubbed (scripts/peers/stubs): the peer harness uses synthetic data")
