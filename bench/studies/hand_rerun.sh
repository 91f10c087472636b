#!/usr/bin/env bash
# Issue 46's demonstration on a finished run: a stage re-run by hand is a no-op for DVC.
#
#   bash bench/studies/hand_rerun.sh FINISHED_RUN [ITER]     (ITER: the last iteration, 12 in a default run)
#
# On a copy of FINISHED_RUN (cp -a: hard links and mtimes kept), for each of rollout, probe, credit, update and
# eval: `tpgrpo stage S --iter ITER`, then `dvc status` (must print nothing to run) and `tpgrpo run` (must run
# no stage). Then, on a second copy sealed into blocks of 4 (`tpgrpo run` with train.block_size 4):
# `tpgrpo stage eval --iter 4`, `dvc status`, `dvc repro --dry` and `tpgrpo run`. Prints one verdict line per
# step; exits 1 if any step ran a stage or left `dvc status` dirty. Uses the checkout's tpgrpo (activate its venv).
set -uo pipefail
src=$(realpath "$1"); iter=${2:-12}
work=$(mktemp -d /tmp/hand_rerun.XXXX)
export DVC_NO_ANALYTICS=1 DVC_STUDIO_OFFLINE=true
failed=0

ran_stages() {  # the stages DVC ran (not restored, not skipped) in a `tpgrpo run` / `dvc repro` log
  grep -E "^Running stage '" "$1" | sed -E "s/Running stage '([^']+)'.*/\1/" | tr '\n' ' '
}

in_project() {  # run "${@:2}" in project $1 with its own code first on the path (as DVC's stage commands do)
  (cd "$1" && PYTHONPATH="$1" "${@:2}")
}

verdict() {  # $1 what was done, in $2 the project
  local status ran restored t0
  status=$(in_project "$2" dvc status 2>&1 | grep -v "Data and pipelines are up to date" | head -8)
  t0=$SECONDS
  in_project "$2" tpgrpo run > "$work/run.log" 2>&1
  ran=$(ran_stages "$work/run.log")
  restored=$(grep -c "is cached - skipping run" "$work/run.log")
  printf '%-38s dvc status: %-6s next tpgrpo run: %s; restored from the run cache: %s (%d s)\n' "$1" \
    "$([ -n "$status" ] && echo DIRTY || echo clean)" "${ran:-ran no stage}" "$restored" $((SECONDS - t0))
  if [ -n "$status" ] || [ -n "$ran" ] || [ "$restored" != 0 ]; then failed=1; echo "$status"; fi
}

open="$work/open"; cp -a "$src" "$open"
verdict "(no action)" "$open"
for stage in rollout probe credit update eval; do
  in_project "$open" tpgrpo stage "$stage" --iter "$iter" > "$work/stage.log" 2>&1 || { echo "stage $stage failed"; tail -3 "$work/stage.log"; exit 1; }
  verdict "tpgrpo stage $stage --iter $iter" "$open"
done

sealed="$work/sealed"; cp -a "$src" "$sealed"
(cd "$sealed" && python - <<'EOF'
import yaml
raw = yaml.safe_load(open("params.yaml"))
raw["train"]["block_size"] = 4
yaml.safe_dump(raw, open("params.yaml", "w"), sort_keys=False)
EOF
)
in_project "$sealed" tpgrpo run > "$work/seal.log" 2>&1 || { echo "sealing failed"; tail -3 "$work/seal.log"; exit 1; }
echo "sealed into blocks of 4: $(ls "$sealed"/data/seals 2>/dev/null | tr '\n' ' ')"
verdict "(sealed, no action)" "$sealed"
in_project "$sealed" tpgrpo stage eval --iter 4 > "$work/stage.log" 2>&1 || { echo "stage eval failed"; exit 1; }
dry=$(in_project "$sealed" dvc repro --dry 2>&1 | grep -E "^Running stage" | tr '\n' ' ')
echo "after tpgrpo stage eval --iter 4 (sealed): dvc repro --dry would run: ${dry:-nothing}"
[ -n "$dry" ] && failed=1
verdict "tpgrpo stage eval --iter 4 (sealed)" "$sealed"
rm -rf "$work"
exit $failed
