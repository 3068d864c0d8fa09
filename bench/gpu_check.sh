#!/usr/bin/env bash
# The GPU check: everything dtr has to show on a CUDA device, as one script that ends
# within 8 minutes, for a machine that has a GPU for a short while.
#
#   bash bench/gpu_check.sh              # from the repository root
#   bash bench/gpu_check.sh --dry-run    # print the steps, run nothing
#   bash bench/gpu_check.sh --install    # first the README's install (not timed; see below)
#   bash bench/gpu_check.sh --build      # first build the C++ core in place, offline (see below)
#   bash bench/gpu_check.sh --out DIR    # results elsewhere (default bench/results/gpu)
#
# Before it, install as the README says, into a Python whose torch is the CUDA build:
#   pip install --no-build-isolation -e '.[test]'
# (--install runs exactly that, with the installed torch pinned by a constraints file so
# that pip can never fetch another torch.) On a machine with no package index (a rented
# GPU box with torch and pytest already there), --build instead compiles dtr._C in place
# (`setup.py build_ext --inplace`, MAX_JOBS = the cores) and runs from the checkout; if
# that build fails, the log says why and the steps run on dtr's pure-Python core.
# PYTHON=... picks the interpreter (default .venv/bin/python if there is one, else python3).
#
# Steps, each under `timeout`, all inside one deadline of 7m45s (a step that would pass
# it is cut short or skipped), each going on when the one before failed:
#   1. nvidia-smi -L, torch.cuda.get_device_name(), torch and CUDA versions, dtr's core
#   2. pytest tests/accelerator/test_cuda.py tests/accelerator/test_cuda_memory_history.py
#      (the CUDA-only tests; their numbers are printed)
#   3. pytest tests/engines/subclass/test_runtime.py tests/engines/test_models.py -k cuda
#      (the DEVICES-parametrized correctness suite, on cuda)
#   4. bench.compare_heuristics --device cuda --quick, 4 heuristics x 3 ratios (test-size
#      models)
#   5. bench.compare_heuristics --device cuda at bench scale, default heuristic
#   6. bench.max_batch: the largest batch eager and dtr train at in 2 GiB of GPU memory
#   7. bench.vs_static --device cuda: eager, torch.utils.checkpoint (sqrt(n), per block),
#      torch.compile (budget 1.0) and dtr at equal memory, Transformer and CNN (last: the
#      one most likely to be cut short, compiling)
# Logs, JUnit XML, CSVs (with the allocator's fragmentation columns) and plots go to
# bench/results/gpu/, plus summary.txt. Exit status: 0 if every step passed, 1 if any
# failed, timed out or was skipped for lack of time. On a machine without CUDA it says so
# and exits 0 having run nothing.

set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
INSTALL=0
BUILD=0
OUT=bench/results/gpu
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --install) INSTALL=1 ;;
    --build) BUILD=1 ;;
    --out)
      [ $# -ge 2 ] || { echo "gpu_check: --out needs a folder" >&2; exit 2; }
      OUT=$2
      shift
      ;;
    -h | --help)
      sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "gpu_check: unknown argument $1 (try --help)" >&2
      exit 2
      ;;
  esac
  shift
done

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi

export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} # deterministic cuBLAS
export MPLBACKEND=Agg PYTHONUNBUFFERED=1

GPU_CHECK_INFO=$(
  cat <<'EOF'
import os
import torch
from dtr.core import core_class
i = torch.cuda.current_device()
p = torch.cuda.get_device_properties(i)
print("torch.cuda.get_device_name():", torch.cuda.get_device_name(i))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()},"
      f" capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB,"
      f" {torch.cuda.device_count()} device(s)")
print("dtr core:", core_class(False)[1], "; CUBLAS_WORKSPACE_CONFIG =",
      os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
EOF
)
export GPU_CHECK_INFO

# The DEVICES-parametrized suite in 4 processes when pytest-xdist is there (they share
# the GPU; the CUDA-only tests run alone: one of them fills the device on purpose).
XDIST=""
if "$PY" -c 'import xdist' 2>/dev/null; then XDIST="-n 4"; fi

# name | seconds at most | command
STEPS=(
  "info|45|nvidia-smi -L || echo 'gpu_check: nvidia-smi -L failed (not counted)'; $PY -c \"\$GPU_CHECK_INFO\""
  "test_cuda|120|$PY -m pytest tests/accelerator/test_cuda.py tests/accelerator/test_cuda_memory_history.py -q -s -rfEs -p no:cacheprovider --junitxml=$OUT/test_cuda.xml"
  "tests_on_cuda|160|$PY -m pytest tests/engines/subclass/test_runtime.py tests/engines/test_models.py -k cuda $XDIST -q -rfEs -p no:cacheprovider --junitxml=$OUT/tests_on_cuda.xml"
  "heuristics_quick|80|$PY -m bench.compare_heuristics --device cuda --quick --heuristics dtr dtr_eq msps lru --ratios 1.0 0.5 0.3 --out $OUT/heuristics_quick.csv"
  "heuristics_bench|55|$PY -m bench.compare_heuristics --device cuda --heuristics dtr --ratios 1.0 0.5 0.3 --steps 3 --warmup 1 --out $OUT/heuristics_bench.csv"
  "max_batch|150|$PY -m bench.max_batch --models transformer cnn --memory 2GiB --out $OUT/max_batch.csv"
  "vs_static|150|$PY -m bench.vs_static --device cuda --models transformer cnn --steps 3 --warmup 1 --compile-budgets 1.0 --ratios 0.6 0.4 0.3 0.2 --calibrate 1 --out $OUT/vs_static.csv"
)

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check --dry-run: with $PY, results in $OUT/, the steps would be:"
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name cap cmd <<<"$step"
    printf '  %-17s at most %3ss: %s\n' "$name" "$cap" "$cmd"
  done
  exit 0
fi

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch; install first (see the top of $0)" >&2
  exit 2
fi

if [ "$INSTALL" = 1 ]; then
  # The README's install line. The constraint pins the torch already installed (the CUDA
  # build), so pip can never replace it; build isolation is off so the extension is
  # compiled against it.
  constraints=$(mktemp)
  "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' >"$constraints"
  echo "gpu_check: pip install --no-build-isolation -e '.[test]' (constraint: $(cat "$constraints"))"
  if ! "$PY" -m pip install --no-build-isolation -c "$constraints" -e '.[test]'; then
    rm -f "$constraints"
    echo "gpu_check: the install failed" >&2
    exit 1
  fi
  rm -f "$constraints"
fi

if [ "$BUILD" = 1 ]; then
  mkdir -p "$OUT"
  echo "gpu_check: $PY setup.py build_ext --inplace (log: $OUT/build.log)"
  if ! MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout 300 "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"
    echo "gpu_check: building dtr._C failed (above); the steps run on the pure-Python core" >&2
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; then
  "$PY" -c 'import torch; print(f"gpu_check: no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}; torch.cuda.is_available() is False): nothing to check. On a CPU machine the suite is: python -m pytest tests -q")'
  exit 0
fi

mkdir -p "$OUT"
DEADLINE=$((SECONDS + 465)) # 7m45s, so that the last step's kill grace still ends by 8m
SUMMARY=()
FAILED=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name cap cmd <<<"$step"
  left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 20 ]; then
    echo "gpu_check: [$name] SKIPPED: ${left}s left before the 8-minute limit"
    SUMMARY+=("$(printf '%-17s SKIPPED (no time left)' "$name")")
    FAILED=1
    continue
  fi
  limit=$((cap < left ? cap : left))
  echo
  echo "=== gpu_check: [$name] (at most ${limit}s): $cmd"
  start=$SECONDS
  timeout -k 5 "$limit" bash -c "$cmd" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    status=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMED OUT after ${limit}s"
    FAILED=1
  else
    status="FAILED (exit $rc)"
    FAILED=1
  fi
  echo "=== gpu_check: [$name] $status in ${took}s"
  SUMMARY+=("$(printf '%-17s %-26s %4ss' "$name" "$status" "$took")")
done

{
  echo "gpu_check on $(date -u +%Y-%m-%dT%H:%M:%SZ), ${SECONDS}s in all:"
  printf '  %s\n' "${SUMMARY[@]}"
} | tee "$OUT/summary.txt"
ls -1 "$OUT"
exit "$FAILED"
