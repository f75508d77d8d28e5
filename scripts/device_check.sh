#!/usr/bin/env bash
# The GPU checks of a session that is lent a device machine, in one call of about 9 minutes.
#
# Prepared here first (`bash scripts/prepare_device.sh`), then run there through the device
# tool: command `bash scripts/device_check.sh`, carry [".device-data"], timeout_s 590.
# That machine's python3 has its own torch (2.11 with CUDA when last listed), pytest and
# numpy, but not wandb or learn2learn: the Omniglot run is untracked and the baselines'
# columns are skipped. Each part has its own time limit, so one that hangs or fails leaves
# the others their time; every log lands in $OUT (the tool brings it back).
#
# Parts: (1) a CPU test subset, to catch an API the machine's torch lacks; (2) the meta-step
# benchmark on CUDA (loop / vmap / auto / whole, their float64 agreement and GPU memory);
# (3) the chunk grid on CUDA, which sets AUTO_CHUNK_EXAMPLES["cuda"] (a guess until then);
# (4) the HVP benchmark on CUDA; (5) the default Omniglot run (MAML 5-way 1-shot) on CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/device-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Scratch outside the repo and $OUT: $OUT brings back at most 8 files, so only the logs go there.
SCRATCH="${SCRATCH:-/tmp/metalearn-device}"
export WANDB_MODE=disabled METALEARN_CACHE="$SCRATCH/cache"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
# QUICK=1 DEVICE=cpu PYTHON=.venv/bin/python: a minute-long dry run of the plumbing, here.
if [ "${QUICK:-0}" = 1 ]; then
    MAML=(--quick --settings q1-first --methods loop,auto --no-float64-check)
    CHUNKS=(--settings q1-first --repeats 1 --max-examples 80)
    HVP=(--quick)
    OMNIGLOT=(--iterations 2 --val-every 2 --val-tasks 2 --test-tasks 2 --checkpoint-every 2)
else
    MAML=(--methods loop,vmap,auto,whole --repeats 10 --warmup 3)
    CHUNKS=(--repeats 5 --max-examples 2600)
    HVP=(--max-hessian-gb 40)
    OMNIGLOT=()
fi

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tr '\r' '\n' < "$OUT/$name.txt" | tail -n 25 | cut -c1-240  # progress bars end in \r
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}

"$PY" -c "import torch; print('torch', torch.__version__, '| cuda:', torch.cuda.is_available() \
    and torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
part tests 60 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_inner.py tests/test_outer.py \
    tests/test_chunking.py tests/test_second_order.py
part bench_maml 190 "$PY" scripts/bench_maml.py --device "$DEVICE" "${MAML[@]}"
part bench_chunks 90 "$PY" scripts/bench_chunks.py --device "$DEVICE" "${CHUNKS[@]}"
part bench_hvp 60 "$PY" scripts/bench_hvp.py --device "$DEVICE" "${HVP[@]}"
if [ -f .device-data/omniglot.tar.gz ]; then
    rm -rf "$SCRATCH/omniglot" && mkdir -p "$SCRATCH/omniglot"
    tar -xzf .device-data/omniglot.tar.gz -C "$SCRATCH/omniglot"
    part omniglot 170 "$PY" experiments/omniglot_maml.py --device "$DEVICE" --no-track \
        --data-root "$SCRATCH/omniglot" --out-dir "$SCRATCH/runs" --threads 0 "${OMNIGLOT[@]}"
else
    echo "== omniglot: skipped (no .device-data/omniglot.tar.gz: run scripts/prepare_device.sh)"
fi
