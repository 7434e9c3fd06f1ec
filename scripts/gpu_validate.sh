#!/usr/bin/env bash
# GPU validation in one go: the gpu-marked tests, the benchmarks and a scale-7 training run, each stage
# under its own time limit, in priority order. Logs and JSON go to $RESULTS (default bench_results/gpu),
# packed into $ARCHIVE_DIR/results.tgz when ARCHIVE_DIR is set (to carry them off a remote machine).
#   scripts/gpu_validate.sh [stage ...]     stages: tests norm normsweep train target minibatch
#   breakdown loss losssweep probe conv scaling strict scalingtarget spatial halo fsdp (these six: a
#   multi-GPU host. scaling, strict, scalingtarget and fsdp: RANKS=2,4 and SCALE=7 by default; strict,
#   after scaling in the same call: each size once more with determinism=strict, compared bit for bit
#   with its first default run; scalingtarget: each size once to the target; spatial: strong scaling,
#   SHARDS=2,4 ranks each splitting one volume, SPATIAL_SCALE=9 with SPATIAL_INSTANCES=6 instances a
#   class; halo: one SHARDS_PROFILE=2-rank sharded epoch under the profiler, then its communication
#   against its computation (scaffold.bench.trace)); routes (retunes scaffold/model/routes.py on device
#   time at ROUTE_SCALES, 7,8 by default, rewriting it after every site, and keeps a copy beside the
#   logs); target (the default scale-7 run to its target: the time to target); seeds (that run once
#   per seed in SEEDS, "42 1 2" by default, each its own process, then their summary over seeds: the
#   time to target as a median, since one run's epoch count moves with its bits); scale9 (retunes
#   scale 9's routes, then its step on them against the table before, ladder with recompute; needs an
#   H200's memory)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
RESULTS=${RESULTS:-bench_results/gpu}
mkdir -p "$RESULTS"
stages=${*:-tests norm train minibatch loss probe}
summary="$RESULTS/summary.txt"
run() {  # run NAME LIMIT_S CMD...: a stage with a limit, its log, one summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "stage $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$summary"
  tail -n 25 "$RESULTS/$name.log" | sed "s/^/  [$name] /" >>"$summary"
}
scaling() {  # scaling NAME LIMIT_S RANKS SCALE EPOCHS REPS [FLAG] [-- OVERRIDE ...]: bench.scaling as a stage
  local name=$1 limit=$2 ranks=$3 scale=$4 epochs=$5 reps=$6; shift 6
  run "$name" "$limit" python3 -m scaffold.bench.scaling --ranks "$ranks" --scale "$scale" --epochs "$epochs" \
    --reps "$reps" --workdir "$RESULTS/${name}_runs" --out "$RESULTS/$name.json" "$@"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; } | tee "$summary"
for s in $stages; do
  case $s in
    tests) run tests "${LIMIT_TESTS:-480}" python3 -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} tests ;;
    normsweep) run normsweep "${LIMIT_NORMSWEEP:-330}" python3 -m scaffold.bench.tune_norm --scales 7 \
                 --out "$RESULTS/norm_tiles.json" ;;
    breakdown) run breakdown "${LIMIT_BREAKDOWN:-200}" python3 -m scaffold.bench.minibatch --scale 7 \
                 --variants "${VARIANTS:-ladder,vendor}" --steps "${MB_STEPS:-5}" --reps "${MB_REPS:-3}" \
                 --breakdown --out "$RESULTS/breakdown.json" ;;
    norm) run norm "${LIMIT_NORM:-200}" python3 -m scaffold.bench.norm --scales 7 8 --out "$RESULTS/norm.json" ;;
    train) run train "${LIMIT_TRAIN:-200}" python3 -m scaffold.train scale=7 epochs=2 progress=false \
             hydra.run.dir="$RESULTS/train_run" ;;
    minibatch) run minibatch "${LIMIT_MINIBATCH:-240}" python3 -m scaffold.bench.minibatch --scale 7 \
                 --variants "${VARIANTS:-ladder,vendor,compiled}" --steps "${MB_STEPS:-10}" \
                 --reps "${MB_REPS:-5}" --out "$RESULTS/minibatch.json" ;;
    loss) run loss 90 python3 -m scaffold.bench.loss --out "$RESULTS/loss.json" ;;
    probe) run probe 120 python3 -m scaffold.bench.determinism --scale 7 --out "$RESULTS/determinism.json" ;;
    losssweep) run losssweep 90 python3 -m scaffold.bench.tune_loss --out "$RESULTS/loss_plans.json" ;;
    scaling) scaling scaling "${LIMIT_SCALING:-600}" "${RANKS:-2,4}" "${SCALE:-7}" 2 2 ;;
    strict) for n in $(echo "${RANKS:-2,4}" | tr , ' '); do
              run "strict_ranks$n" "${LIMIT_STRICT:-300}" python3 -m torch.distributed.run --standalone \
                --nproc-per-node="$n" -m scaffold.train scale="${SCALE:-7}" epochs=2 progress=false determinism=strict \
                hydra.run.dir="$RESULTS/strict_ranks$n"
              run "strict_ranks${n}_same" 120 python3 scripts/compare_runs.py \
                "$RESULTS/scaling_runs/ranks$n-rep0" "$RESULTS/strict_ranks$n"
            done ;;
    scalingtarget) scaling scalingtarget "${LIMIT_SCALINGTARGET:-600}" "${RANKS:-2,4}" "${SCALE:-7}" -1 1 ;;
    spatial) scaling spatial "${LIMIT_SPATIAL:-600}" "${SHARDS:-2,4}" "${SPATIAL_SCALE:-9}" 1 2 --spatial \
               -- "data.n_instances=${SPATIAL_INSTANCES:-6}" ;;
    halo) run halo_run "${LIMIT_HALO:-420}" python3 -m torch.distributed.run --standalone \
            --nproc-per-node="${SHARDS_PROFILE:-2}" -m scaffold.train scale="${SPATIAL_SCALE:-9}" \
            "data.n_instances=${SPATIAL_INSTANCES:-6}" "parallel.spatial_shards=${SHARDS_PROFILE:-2}" \
            debug=profile progress=false \
            hydra.run.dir="$RESULTS/halo_run"
          run halo 60 python3 -m scaffold.bench.trace "$RESULTS/halo_run/profile_trace.json" \
            --out "$RESULTS/halo.json" ;;
    fsdp) scaling fsdp "${LIMIT_FSDP:-600}" "${RANKS:-2,4}" "${SCALE:-7}" 2 2 -- parallel.fsdp=on ;;
    routes) run routes "${LIMIT_ROUTES:-600}" python3 -m scaffold.bench.tune_routes --scale "${ROUTE_SCALES:-7,8}" \
              --timer device --reps 3 --write --out "$RESULTS/routes.json"
            cp scaffold/model/routes.py "$RESULTS/routes.py" ;;
    target) run target "${LIMIT_TARGET:-570}" python3 -m scaffold.train scale=7 progress=false \
              hydra.run.dir="$RESULTS/target_run" ;;
    seeds) for seed in ${SEEDS:-42 1 2}; do
             run "target_seed$seed" "${LIMIT_TARGET:-570}" python3 -m scaffold.train scale=7 progress=false \
               "seed=$seed" hydra.run.dir="$RESULTS/seeds/$seed"
           done
           run seeds 60 python3 -m scaffold.report "$RESULTS/seeds" ;;
    scale9) cp scaffold/model/routes.py "$RESULTS/routes_before9.py"
            run routes9 "${LIMIT_ROUTES9:-420}" python3 -m scaffold.bench.tune_routes --scale 9 --timer device \
              --reps 2 --write --out "$RESULTS/routes9.json"
            cp scaffold/model/routes.py "$RESULTS/routes9.py"
            run step9 "${LIMIT_STEP9:-300}" python3 -m scaffold.bench.minibatch --scale 9 --steps 2 --reps 2 \
              --warmup 1 --variants ladder+recompute,ladder+recompute@alt --alt-routes "$RESULTS/routes_before9.py" \
              --out "$RESULTS/step9.json" ;;
    conv) run conv "${LIMIT_CONV:-300}" python3 -m scaffold.bench.conv --scale 7 --out "$RESULTS/conv.json" ;;
  esac
done
if [ -n "${ARCHIVE_DIR:-}" ]; then
  rm -rf "$RESULTS/train_run/checkpoints" "$RESULTS/target_run/checkpoints" "$RESULTS"/seeds/*/checkpoints \
    "$RESULTS"/{scaling,scalingtarget,spatial,fsdp}_runs/*/checkpoints \
    "$RESULTS"/strict_ranks*/checkpoints "$RESULTS/halo_run/checkpoints"
  tar czf "$ARCHIVE_DIR/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
  cp "$summary" "$ARCHIVE_DIR/summary.txt"
fi
