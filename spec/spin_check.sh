#!/usr/bin/env bash
# spin's verdicts on spec/transfer.pml, the Promela statement of spec/model.py's protocol,
# as an independent check of spec/check.py: for each configuration (two, three), each
# variant (buggy, fixed) and each property, one exhaustive spin search of that property
# alone, so a counterexample is about it.
#
#   spec/spin_check.sh          one line per run
#   spec/spin_check.sh --json   one JSON object per run
#   SPIN_CONFIGS=two SPIN_CC_OPT=-O0 spec/spin_check.sh   the small configuration only, quickly
#
# Exits non-zero when
#   (a) BUGGY does not violate each of transfer_size_mismatch and unwritten_read (on the
#       over-long request c: the 0.5.19 admission path), late_write, double_free;
#   (b) FIXED violates any safety property (all but orphan_transfer, a warning);
#   (c) spin, gcc or pan fails, a violation is not an assertion, a trail does not end at
#       the action that checks its property, or pan's search depth was too small.
#
# A verdict comes from a depth-first exhaustive search (gcc -DSAFETY, ./pan -m$DEPTH);
# a violated property's trail is then taken from a breadth-first pan (-DBFS), so it is the
# shortest, like spec/check.py's.  Everything is built in a temporary directory.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
model="$here/transfer.pml"
DEPTH=100000

json=0
case "${1:-}" in
  --json) json=1 ;;
  "") ;;
  *) echo "usage: $0 [--json]" >&2; exit 2 ;;
esac

for tool in spin gcc; do
  command -v "$tool" >/dev/null || { echo "spin_check: $tool not on PATH (apt-get install -y spin gcc)" >&2; exit 1; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/spin_check.XXXXXX")
trap 'rm -rf "$work"' EXIT

# SPIN_CONFIGS narrows the configurations (tests/tools/test_spec.py runs "two"); SPIN_CC_OPT is
# pan's optimisation level (-O0 compiles in a third of the time, for the small configs)
read -r -a CONFIGS <<<"${SPIN_CONFIGS:-two three}"
CC_OPT=${SPIN_CC_OPT:--O2}
VARIANTS=(buggy fixed)
PROPS=(unwritten_read foreign_read use_after_free late_write double_free transfer_size_mismatch orphan_transfer)
REQUIRED_BUGGY=" transfer_size_mismatch unwritten_read late_write double_free "
WARNINGS=" orphan_transfer "

# the actions at which each property's assert sits: a trail must end with one of them
declare -A CHECKED_AT=(
  [unwritten_read]="d_read"
  [foreign_read]="d_read"
  [use_after_free]="d_read p_send"
  [late_write]="p_send"
  [double_free]="d_fail d_timeout d_release d_free_again d_end"
  [transfer_size_mismatch]="d_done"
  [orphan_transfer]="p_fail d_admit"
)

failures=()
fail() { failures+=("$*"); echo "spin_check: FAIL: $*" >&2; }

for cfg in "${CONFIGS[@]}"; do
  for variant in "${VARIANTS[@]}"; do
    for prop in "${PROPS[@]}"; do
      run="$cfg $variant $prop"
      dir="$work/$cfg-$variant-$prop"
      mkdir "$dir"
      cp "$model" "$dir/transfer.pml"
      flags=("-DCONFIG_${cfg^^}" "-DPROP_${prop^^}")
      [[ $variant == fixed ]] && flags+=(-DFIXED)

      # ---- verdict: exhaustive depth-first search
      if ! (cd "$dir" && spin -a "${flags[@]}" transfer.pml >spin.log 2>&1); then
        fail "$run: spin -a failed: $(tail -3 "$dir/spin.log")"; continue
      fi
      if ! (cd "$dir" && gcc "$CC_OPT" -DSAFETY -o pan pan.c >gcc.log 2>&1); then
        fail "$run: gcc failed: $(tail -3 "$dir/gcc.log")"; continue
      fi
      (cd "$dir" && ./pan -m$DEPTH >pan.out 2>&1) || true  # pan's status is not its verdict; parsed below
      out="$dir/pan.out"
      if grep -q "max search depth too small" "$out"; then
        fail "$run: max search depth too small (-m$DEPTH)"; continue
      fi
      errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | head -1)
      states=$(sed -n 's/^ *\([0-9]*\) states, stored.*/\1/p' "$out" | head -1)
      if [[ -z $errors || -z $states ]]; then
        fail "$run: pan gave no verdict: $(tail -3 "$out")"; continue
      fi

      if [[ $errors == 0 ]]; then
        result=verified steps=0 actions=""
      else
        result=violated
        if ! grep -q "assertion violated" "$out"; then
          fail "$run: pan found an error that is not the property's assertion: $(grep -m1 -E 'pan:1|error' "$out")"; continue
        fi
        # ---- trail: breadth-first, hence shortest
        rm -f "$dir/transfer.pml.trail"
        if ! (cd "$dir" && gcc "$CC_OPT" -DSAFETY -DBFS -o pan_bfs pan.c >gcc_bfs.log 2>&1); then
          fail "$run: gcc -DBFS failed: $(tail -3 "$dir/gcc_bfs.log")"; continue
        fi
        (cd "$dir" && ./pan_bfs >bfs.out 2>&1) || true
        if ! grep -q "assertion violated" "$dir/bfs.out" || [[ ! -f $dir/transfer.pml.trail ]]; then
          fail "$run: the breadth-first search did not reproduce the violation"; continue
        fi
        (cd "$dir" && spin -t "${flags[@]}" transfer.pml >replay.out 2>&1) || true
        steps=$(sed -n 's/.*trail ends after \([0-9]*\) steps.*/\1/p' "$dir/replay.out" | head -1)
        actions=$(sed -n 's/^ *ACT \(.*\)$/\1/p' "$dir/replay.out" | tr '\n' ' ' | sed 's/ $//')
        nact=$(wc -w <<<"$actions")
        if [[ -z $steps || $steps != "$nact" ]]; then
          fail "$run: trail replay: ${steps:-no} steps, $nact actions"; continue
        fi
        last=${actions##* }
        if [[ " ${CHECKED_AT[$prop]} " != *" ${last%%(*} "* ]]; then
          fail "$run: the trail ends with $last, not at an action that checks $prop"
        fi
      fi

      # ---- what the protocol must show
      if [[ $variant == buggy && $REQUIRED_BUGGY == *" $prop "* ]]; then
        if [[ $result != violated ]]; then
          fail "$run: BUGGY must violate $prop"
        elif [[ $prop == transfer_size_mismatch || $prop == unwritten_read ]] \
             && [[ " $actions " != *" p_send(c) "* || $last != *"(c)" ]]; then
          fail "$run: expected the 0.5.19 path on the over-long request c, got: $actions"
        fi
      fi
      if [[ $variant == fixed && $WARNINGS != *" $prop "* && $result == violated ]]; then
        fail "$run: FIXED violates the safety property $prop"
      fi

      if [[ $json == 1 ]]; then
        trail_json=$(sed 's/[^ ][^ ]*/"&"/g; s/ /, /g' <<<"$actions")
        # states: the full state space of a verified run (null where the search stopped at a violation)
        [[ $result == verified ]] || states=null
        printf '{"config": "%s", "variant": "%s", "property": "%s", "result": "%s", "states": %s, "trail_steps": %s, "trail": [%s]}\n' \
          "$cfg" "$variant" "$prop" "$result" "$states" "$steps" "$trail_json"
      elif [[ $result == verified ]]; then
        echo "spin $cfg $variant $prop: verified ($states states)"
      else
        note=""; [[ $WARNINGS == *" $prop "* ]] && note=" [warning]"
        echo "spin $cfg $variant $prop: violated (trail: $steps steps)$note: $actions"
      fi
    done
  done
done

if ((${#failures[@]})); then
  echo "spin_check: ${#failures[@]} failure(s)" >&2
  exit 1
fi
