#!/usr/bin/env bash
# The torch versions trainmesh promises, each in a fresh virtual environment: the fast test tier,
# and six layouts whose losses must equal (within 1e-6) those of the pinned torch.
#
#   benchmarks/version_matrix.sh                      # the floor, the pinned 2.13.0, the newest
#   benchmarks/version_matrix.sh 2.5.1 2.13.0 2.15.0  # these versions (the pinned one is run first)
#
# Not part of the test suite. Each version gets a venv under $MATRIX_DIR (default
# /tmp/trainmesh-version-matrix), deleted once its row is printed, so one venv exists at a time.
# torch comes from the package index: PyPI's Linux wheels of most versions are CUDA builds with
# their NVIDIA libraries (2-4 GB each; check `df -h` first). transformers: >= 5 where torch >= 2.6
# (it needs that), the newest 4.x below. A machine that caps torch through a pip constraints file
# (e.g. PIP_CONSTRAINT or a `constraint` line in /etc/xdg/pip/pip.conf) is overridden here: pip
# runs with PIP_CONSTRAINT set to this script's own constraints file (torch==VERSION), which
# replaces the configured one. Extra pip options (a wheel directory, say) go in $PIP_OPTIONS.
# Prints a Markdown table (docs/COMPATIBILITY.md); exits 1 when a row failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PINNED=2.13.0
FLOOR=$(sed -n 's/^TORCH_MIN = "\(.*\)"/\1/p' "$ROOT/src/trainmesh/core/versions.py")
NEWEST=${NEWEST:-2.15.0}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=("$FLOOR" "$PINNED" "$NEWEST")
MATRIX_DIR=${MATRIX_DIR:-/tmp/trainmesh-version-matrix}
PYTHON=${PYTHON:-python3}
SMALL=(--layers 2 --d-model 32 --heads 4 --seq-len 16 --vocab-size 64 --global-batch 12
       --steps 10 --warmup-steps 2)
LAYOUTS=("--dp 2 --zero 3" "--tp 2 --sequence-parallel" "--pp 2 --microbatches 2" "--cp 2"
         "--dp 2 --ep 2 --experts 4" "--dp 3 --fault-tolerant")
mkdir -p "$MATRIX_DIR/losses"
# the pinned version first: the others are compared with its losses
ORDERED=()
[[ " ${VERSIONS[*]} " == *" $PINNED "* ]] && ORDERED=("$PINNED")
for v in "${VERSIONS[@]}"; do [ "$v" != "$PINNED" ] && ORDERED+=("$v"); done
[ "${ORDERED[0]}" = "$PINNED" ] || [ -d "$MATRIX_DIR/losses/$PINNED" ] || {
  echo "the pinned torch $PINNED is the reference: include it (or keep its losses in $MATRIX_DIR)" >&2; exit 2; }

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
  major_minor=$(echo "$v" | cut -d. -f1,2)
  if [ "$(printf '%s\n' "$major_minor" 2.6 | sort -V | head -1)" = 2.6 ]; then tf=">=5"; else tf="<5"; fi
  printf 'torch==%s\ntransformers%s\n' "$v" "$tf" > "$MATRIX_DIR/constraints.txt"
  if ! PIP_CONSTRAINT="$MATRIX_DIR/constraints.txt" "$venv/bin/pip" install -q ${PIP_OPTIONS:-} \
        "torch==$v" -e "$ROOT[test]" >"$log" 2>&1; then
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
