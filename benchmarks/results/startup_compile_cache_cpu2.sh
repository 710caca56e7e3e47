#!/bin/bash
# cold (empty cache folder) and warm (the same folder again), alternated; tiny, 2 steps
cd /work/wt-edges-cli
export PYTHONPATH=$PWD
for pair in 1 2; do
  rm -rf /tmp/cc/cache$pair
  for kind in cold warm; do
    rm -rf /tmp/cc/run_${pair}_$kind
    echo "== pair $pair $kind: $(uptime)"
    /usr/bin/time -f "wall %e s" python -m xmoe_jax.cli --config configs/tiny.yaml --compile-cache /tmp/cc/cache$pair \
      --set train.steps=2 --set train.log_every=1 --set train.run_dir=/tmp/cc/run_${pair}_$kind 2>&1 | grep -v "^step" 
  done
done
echo "== end: $(uptime)"
