#!/usr/bin/env bash
# Check metalearn on a CUDA machine: tests, benchmarks and a short Omniglot run, one folder of logs.
#
# For any machine with a CUDA build of torch, this repository and its .venv set up (see the
# README's set-up command; on a GPU install the torch build you need). Each part runs with
# its own time limit and log, so one that hangs or fails leaves the others their time:
#
#   tests         the quick test subset (pytest -m "not slow"; --full-tests: every test).
#                 Tests run on the CPU; on a CUDA build of torch they catch an API the
#                 installed torch lacks before the benchmarks do.
#   bench_maml    scripts/bench_maml.py --device DEVICE: loop / vmap / auto / whole meta-steps,
#                 their float64 agreement, peak GPU memory (learn2learn and higher columns
#                 when the interpreter can import them, see docs/baselines.md).
#   bench_hvp     scripts/bench_hvp.py --device DEVICE: HVP against one gradient, dense
#                 Hessian against HVP.
#   bench_chunks  scripts/bench_chunks.py --device DEVICE: meta-step time by tasks per vmapped
#                 chunk, the grid behind metalearn.engine.accumulate's CUDA chunk limit.
#   compile       scripts/bench_maml.py --methods auto,compile --device DEVICE: the default
#                 Omniglot meta-step (16 tasks, 5 query per class, second order) eager against
#                 the experiments' --compile (metalearn.engine.compiled); the warm-up compiles.
#   omniglot      experiments/omniglot_maml.py --device DEVICE for --iterations meta-steps,
#                 tested on 600 tasks, tracked offline in W&B inside the output folder.
#
# Every log, the run and summary.md (each part's exit code, time and result line) land in
# --out (default gpu-check/<UTC timestamp>); an existing non-empty folder is never reused.
#
#     bash scripts/gpu_check.sh --data-root /data/omniglot
#     bash scripts/gpu_check.sh --quick --device cpu       # a few minutes' dry run of every part
set -uo pipefail

usage() {
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    cat <<'EOF'

Options:
  --out DIR          output folder (default gpu-check/<UTC timestamp>; must not hold files)
  --data-root DIR    Omniglot root (images_background/, images_evaluation/);
                     default $METALEARN_DATA, else Omniglot is downloaded
  --device DEV       torch device (default cuda; cuda:N for another GPU; cpu for a dry run)
  --python PY        interpreter (default .venv/bin/python, else python3)
  --iterations N     meta-steps of the Omniglot run (default 500)
  --quick            toy sizes everywhere: checks the plumbing, measures nothing
  --full-tests       the whole test suite instead of the quick subset
  --skip PART        leave out a part (tests, bench_maml, bench_hvp, bench_chunks, compile,
                     omniglot);
                     may be repeated
  -h, --help         this text
EOF
}

die() {  # one line on stderr naming what was wrong and the fix, exit 2
    echo "gpu_check.sh: $*" >&2
    exit 2
}

cd "$(dirname "$0")/.."
DEST="" DATA_ROOT="${METALEARN_DATA:-}" DEVICE=cuda ITERATIONS=500 QUICK=0 FULL_TESTS=0
PY=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
SKIP=" "
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --out) [ $# -ge 2 ] || die "--out needs a folder"; DEST=$2; shift 2 ;;
        --data-root) [ $# -ge 2 ] || die "--data-root needs a folder"; DATA_ROOT=$2; shift 2 ;;
        --device) [ $# -ge 2 ] || die "--device needs a value (cuda, cuda:N or cpu)"; DEVICE=$2; shift 2 ;;
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PY=$2; shift 2 ;;
        --iterations) [ $# -ge 2 ] || die "--iterations needs a number"; ITERATIONS=$2; shift 2 ;;
        --skip) [ $# -ge 2 ] || die "--skip needs a part name"; SKIP="$SKIP$2 "; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --full-tests) FULL_TESTS=1; shift ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

case "$ITERATIONS" in '' | *[!0-9]* | 0) die "--iterations must be a positive integer, got '$ITERATIONS'" ;; esac
for name in $SKIP; do
    case "$name" in tests | bench_maml | bench_hvp | bench_chunks | compile | omniglot) ;;
        *) die "--skip takes tests, bench_maml, bench_hvp, bench_chunks, compile or omniglot, got '$name'" ;;
    esac
done
if [ -n "$DATA_ROOT" ] && [ ! -d "$DATA_ROOT/images_background" ]; then
    die "no $DATA_ROOT/images_background: pass --data-root the folder holding Omniglot's images_background/"
fi
DEST=${DEST:-gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ]; then
    die "$DEST already holds files; pass --out a new or empty folder"
fi
command -v "$PY" > /dev/null 2>&1 || die "no interpreter '$PY'; set up .venv (README) or pass --python"
if ! "$PY" -c "import sys, torch; d = torch.device(sys.argv[1]); \
sys.exit(0 if d.type != 'cuda' or torch.cuda.is_available() else 1)" "$DEVICE" 2> /dev/null; then
    die "torch ($PY) sees no CUDA device for --device $DEVICE; install a CUDA build of torch, or pass --device cpu for a dry run"
fi
mkdir -p "$DEST" || die "cannot create $DEST; pass --out a writable folder"

# metalearn from this checkout, also for an interpreter where it is not pip-installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
[ -n "$DATA_ROOT" ] && export METALEARN_DATA="$DATA_ROOT"

TRACK=(--wandb-mode offline)
if ! "$PY" -c "import wandb" 2> /dev/null; then
    TRACK=(--no-track)  # the run still trains and tests; only its W&B record is missing
    echo "wandb is not importable by $PY: the Omniglot run is untracked"
fi
if [ "$QUICK" = 1 ]; then
    TESTS=(-m "not slow" tests/docs/test_readme.py tests/scripts/test_bench_tools.py
        tests/scripts/test_gpu_check.py)
    MAML=(--quick --settings q1-first --methods loop,auto --no-float64-check)
    HVP=(--quick)
    CHUNKS=(--settings q1-first --repeats 1 --max-examples 80)
    COMPILE=(--quick --settings q1-first --tasks 4 --no-float64-check)
    OMNIGLOT=(--iterations 2 --val-every 2 --val-tasks 2 --test-tasks 2 --checkpoint-every 2)
    LIMITS=(tests=300 bench_maml=300 bench_hvp=120 bench_chunks=300 compile=600 omniglot=600)
else
    TESTS=(-m "not slow")
    [ "$FULL_TESTS" = 1 ] && TESTS=()
    MAML=(--repeats 10 --warmup 3)
    HVP=(--max-hessian-gb 40)
    CHUNKS=(--repeats 5 --max-examples 2600)
    COMPILE=(--settings q5-second --tasks 16 --repeats 10 --warmup 2 --no-memory)
    OMNIGLOT=(--iterations "$ITERATIONS")
    LIMITS=(tests=1800 bench_maml=1800 bench_hvp=600 bench_chunks=1800 compile=1200 omniglot=3600)
fi

limit_of() {  # limit_of PART: its time limit in seconds
    local entry
    for entry in "${LIMITS[@]}"; do [ "${entry%%=*}" = "$1" ] && echo "${entry#*=}"; done
}

SUMMARY="$DEST/summary.md"
{
    echo "# metalearn GPU check"
    echo
    echo "- date (UTC): $(date -u '+%Y-%m-%d %H:%M')"
    echo "- commit: $(git rev-parse --short HEAD 2> /dev/null || echo unknown)"
    echo "- device: $DEVICE; $("$PY" -c "import torch; print('torch', torch.__version__, '|', \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')")"
    echo "- mode: $([ "$QUICK" = 1 ] && echo 'quick (plumbing only, no measurement)' || echo full)"
    echo "- Omniglot run: ${TRACK[*]}"
    echo
    echo "| part | exit | seconds | result |"
    echo "|---|---|---|---|"
} > "$SUMMARY"

part() {  # part NAME RESULT_PATTERN COMMAND...: run under the part's time limit, log to $DEST/NAME.log
    local name=$1 pattern=$2 limit
    shift 2
    if [[ "$SKIP" == *" $name "* ]]; then
        echo "| $name | skipped | | |" >> "$SUMMARY"
        return
    fi
    limit=$(limit_of "$name")
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS rc result
    timeout "$limit" "$@" > "$DEST/$name.log" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "(stopped at the ${limit}s limit)" >> "$DEST/$name.log"
    # progress bars end lines in \r: split them so the result line is found and shown
    result=$(tr '\r' '\n' < "$DEST/$name.log" | grep -E "$pattern" | tail -n 1 | cut -c1-200)
    # no result line: show the log's last line instead (an error, or the time-limit note)
    [ -n "$result" ] || result=$(tr '\r' '\n' < "$DEST/$name.log" | grep -v '^\s*$' | tail -n 1 | cut -c1-200)
    echo "== $name: exit $rc after $((SECONDS - start)) s${result:+: $result}"
    echo "| $name | $rc | $((SECONDS - start)) | ${result//|//} |" >> "$SUMMARY"
}

part tests '(passed|failed|error)' "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
part bench_maml '^speedup_vs_learn2learn' "$PY" scripts/bench_maml.py --device "$DEVICE" "${MAML[@]}"
part bench_hvp '^hvp_over_grad' "$PY" scripts/bench_hvp.py --device "$DEVICE" "${HVP[@]}"
part bench_chunks '^\|' "$PY" scripts/bench_chunks.py --device "$DEVICE" "${CHUNKS[@]}"
part compile '^timed ' "$PY" scripts/bench_maml.py --device "$DEVICE" --methods auto,compile \
    "${COMPILE[@]}"
part omniglot 'test/acc' "$PY" experiments/omniglot_maml.py --device "$DEVICE" --threads 0 \
    --run-name gpu-check --out-dir "$DEST/omniglot" "${TRACK[@]}" "${OMNIGLOT[@]}"

echo
echo "summary: $SUMMARY"
cat "$SUMMARY"
! grep -qE '^\| [a-z_]+ \| [1-9]' "$SUMMARY"
