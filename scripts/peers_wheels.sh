#!/usr/bin/env bash
# Download the wheels scripts/bench_peers.sh needs on a GPU machine without internet (Python 3.12,
# x86-64; that machine already has jax 0.11.2, flax 0.12.10, optax, orbax, torch 2.11, triton 3.6,
# transformers, tensorboard, tokenizers, pillow, ...: scripts/peers/gpu_image_packages.txt). Run here,
# from the repo root; .whl/ is git-ignored. About 26 MiB in all (the device tool carries 64 MiB with
# the tree). It ends with scripts/peers/wheel_check.py: every requirement of xmoe_jax (pyproject.toml)
# and of every wheel must be in the image, among the wheels or stubbed, else it names the gap, exit 1.
#
#   bash scripts/peers_wheels.sh            # fills .whl/ and .whl/peers/
#
# .whl/        grain, tensorboardX and jax-triton with their needs, for xmoe_jax (scripts/gpu_env.sh
#              installs them; without tensorboardX every GPU script stopped at its import)
# .whl/peers/  MaxText 0.2.5 and torchtitan 0.2.2 with what their training paths import that the
#              machine lacks, found by tracing the modules a CPU smoke run of each imports (a venv of
#              Python 3.12, jax 0.11.2, torch 2.11). Installed apart (/tmp/site_peers) by bench_peers.sh.
#              MaxText's wheel declares no dependencies; its train path imports pydantic, omegaconf,
#              aqtp, drjax, ml_collections, qwix, tokamax (-> einshape, immutabledict), grain and a
#              newer flax. pathwaysutils, xprof (tokamax) and datasets (torchtitan) are stubbed in
#              scripts/peers/stubs instead. torchtitan 0.3.0 needs torch >= 2.14: 0.2.2. tomli: declared
#              by torchtitan (unmarked), used only before Python 3.11.
set -euo pipefail
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() {  # folder requirement...
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dir" "$@"
}
get .whl grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 jax-triton==0.3.1 tensorboardX==2.6.5
get .whl/peers \
  maxtext==0.2.5 flax==0.12.12 tokamax==0.0.17 qwix==0.1.8 aqtp==0.9.0 drjax==0.2.1 einshape==1.0 \
  immutabledict==4.3.1 ml-collections==1.1.0 omegaconf==2.4.0 pydantic==2.14.3 pydantic-core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 \
  torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.0 tomli==2.3.0
du -sh .whl .whl/peers
python3 scripts/peers/wheel_check.py .whl .whl/peers
