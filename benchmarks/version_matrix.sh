#!/usr/bin/env bash
# The torch and transformers versions trainmesh promises, each row in a fresh virtual environment:
# the fast test tier, and six layouts whose losses must equal (within 1e-6) those of the tested
# pins (constraints.txt, what .ci/run installs).
#
#   benchmarks/version_matrix.sh                          # floor, the tested pins, the newest
#   benchmarks/version_matrix.sh pinned 2.15.0:5.26.0     # rows: pinned | newest | TORCH[:TRANSFORMERS]
#
# Rows: `pinned` installs exactly constraints.txt; `newest` is the newest torch and the newest
# transformers the package index offers, asked at run time, so a new release is tested before
# the bound in pyproject.toml moves; TORCH:TRANSFORMERS installs that pair (the test extra's own
# transformers requirement left out, so a release past the bound can be tried); a bare TORCH
# gets transformers >= 5 within the bound. The pinned row runs first: the others are compared
# with its losses.
# Not part of the test suite. Each row gets a venv under $MATRIX_DIR (default
# /tmp/trainmesh-version-matrix), deleted once its row is printed, so one venv exists at a time.
# PyPI's Linux torch wheels of most versions are CUDA builds with their NVIDIA libraries (2-4 GB
# each; check `df -h` first). A machine that caps torch through a pip constraints file (e.g.
# PIP_CONSTRAINT or a `constraint` line in /etc/xdg/pip/pip.conf) is overridden here: pip runs
# with PIP_CONSTRAINT set to the row's own constraints, which replaces the configured one. Extra
# pip options (a wheel directory, say) go in $PIP_OPTIONS.
# Prints a Markdown table (docs/COMPATIBILITY.md); exits 1 when a row failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PINNED=pinned
FLOOR=$(sed -n 's/^TORCH_MIN = "\(.*\)"/\1/p' "$ROOT/src/trainmesh/core/versions.py")
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=("$FLOOR" "$PINNED" newest)
MATRIX_DIR=${MATRIX_DIR:-/tmp/trainmesh-version-matrix}
PYTHON=${PYTHON:-python3}
SMALL=(--layers 2 --d-model 32 --heads 4 --seq-len 16 --vocab-size 64 --global-batch 12
       --steps 10 --warmup-steps 2)
LAYOUTS=("--dp 2 --zero 3" "--tp 2 --sequence-parallel" "--pp 2 --microbatches 2" "--cp 2"
         "--dp 2 --ep 2 --experts 4" "--dp 3 --fault-tolerant")
mkdir -p "$MATRIX_DIR/losses"
# the tested pins first: the others are compared with their losses
ORDERED=()
[[ " ${VERSIONS[*]} " == *" $PINNED "* ]] && ORDERED=("$PINNED")
for v in "${VERSIONS[@]}"; do [ "$v" != "$PINNED" ] && ORDERED+=("$v"); done
[ "${ORDERED[0]}" = "$PINNED" ] || [ -d "$MATRIX_DIR/losses/$PINNED" ] || {
  echo "the tested pins ($PINNED) are the reference: include them (or keep their losses in $MATRIX_DIR)" >&2; exit 2; }

newest() {   # newest NAME: the newest release the package index offers
  PIP_CONSTRAINT=/dev/null "$PYTHON" -m pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\(.*\))$/\1/p"
}

test_extras() {   # the test extra's requirements, transformers left out
  sed -n '/^test = \[/,/\]/p' "$ROOT/pyproject.toml" | grep -o '"[^"]*"' | tr -d '"' | grep -v '^transformers'
}

install() {   # install ROW VENV: the row's packages into VENV
  local row=$1 venv=$2 torch_v=${1%%:*} tf_v=""
  [[ "$row" == *:* ]] && tf_v=${row#*:}
  if [ "$row" = "$PINNED" ]; then
    PIP_CONSTRAINT="$ROOT/constraints.txt" "$venv/bin/pip" install -q ${PIP_OPTIONS:-} -e "$ROOT[test]"
    return
  fi
  if [ "$row" = newest ]; then torch_v=$(newest torch); tf_v=$(newest transformers); fi
  [ -n "$torch_v" ] || { echo "the package index named no torch release"; return 1; }
  if [ -n "$tf_v" ]; then
    printf 'torch==%s\ntransformers==%s\n' "$torch_v" "$tf_v" > "$MATRIX_DIR/constraints.txt"
    # shellcheck disable=SC2046
    PIP_CONSTRAINT="$MATRIX_DIR/constraints.txt" "$venv/bin/pip" install -q ${PIP_OPTIONS:-} \
        "torch==$torch_v" "transformers==$tf_v" -e "$ROOT" $(test_extras)
  else
    printf 'torch==%s\ntransformers>=5\n' "$torch_v" > "$MATRIX_DIR/constraints.txt"
    PIP_CONSTRAINT="$MATRIX_DIR/constraints.txt" "$venv/bin/pip" install -q ${PIP_OPTIONS:-} \
        "torch==$torch_v" -e "$ROOT[test]"
  fi
}

compare() {   # compare REF.jsonl RUN.jsonl -> "ok" or what differs
  "$PYTHON" - "$1" "$2" <<'EOF'
import json, sys
def losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r.get("event") == "step"]
try:
    a, b = losses(sys.argv[1]), losses(sys.argv[2])
except OSError as exc:
    print(f"missing ({exc.filename})"); sys.exit()
worst = max((abs(x - y) for x, y in zip(a, b)), default=float("inf"))
if len(a) == len(b) and a and worst <= 1e-6:
    print("ok (identical)" if worst == 0 else f"ok ({worst:.1e})")
else:
    print(f"differs (max {worst:.2e}, {len(b)}/{len(a)} steps)")
EOF
}

echo "| torch | transformers | fast tier | $(printf '%s | ' "${LAYOUTS[@]}")"
echo "|---|---|---|$(printf -- '---|%.0s' "${LAYOUTS[@]}")"
failed=0
for v in "${ORDERED[@]}"; do
  venv="$MATRIX_DIR/venv-$v"
  log="$MATRIX_DIR/$v.log"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  if ! install "$v" "$venv" >"$log" 2>&1; then
    echo "| $v | | install failed ($log) |"; failed=1; rm -rf "$venv"; continue
  fi
  tfv=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)
  tv=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  (cd "$ROOT" && timeout 1200 "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider \
      >>"$log" 2>&1)
  rc=$?
  # pytest's last line ("454 passed, 2 skipped in 51.2s"), without its duration
  fast=$(grep -E "^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected)" "$log" | tail -1 | tr -d '=' \
         | sed 's/ in [0-9].*//' | xargs)
  if [ "$rc" -ne 0 ]; then failed=1; [ -n "$fast" ] || fast="pytest exit $rc ($log)"; fi
  row="| $tv | ${tfv:-none} | $fast |"
  mkdir -p "$MATRIX_DIR/losses/$v"
  for i in "${!LAYOUTS[@]}"; do
    out="$MATRIX_DIR/losses/$v/$i.jsonl"
    rm -f "$out"
    # shellcheck disable=SC2086
    (cd "$MATRIX_DIR" && OMP_NUM_THREADS=1 timeout 600 "$venv/bin/python" -m trainmesh train \
        "${SMALL[@]}" ${LAYOUTS[$i]} --metrics-out "$out" >>"$log" 2>&1)
    if [ "$v" = "$PINNED" ]; then
      res=$([ -s "$out" ] && echo "reference" || echo "failed")
    else
      res=$(compare "$MATRIX_DIR/losses/$PINNED/$i.jsonl" "$out")
    fi
    [[ "$res" == "ok ("* || "$res" == reference ]] || failed=1
    row="$row $res |"
  done
  echo "$row"
  rm -rf "$venv"
done
exit $failed
