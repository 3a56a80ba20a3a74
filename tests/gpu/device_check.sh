#!/usr/bin/env bash
# The GPU check in one bounded run, for a machine whose python3 already holds a CUDA build of torch
# (the project's own dependencies beside it; crc32c as a wheel under .whl/ when missing):
#
#   OUT=/some/dir [CHECKS="churn tests recovery checkpoint"] tests/gpu/device_check.sh [SECONDS]
#
# (CHECKS may also name takeover, which is not run by default.)
#
# Runs `make test-gpu`, then the three GPU benchmarks, each with the time the budget still allows,
# and packs every log and JSON figure into $OUT/device_check.tgz. A step that runs out of time is cut and said.
set -u
budget=${1:-480}
start=$SECONDS
OUT=${OUT:?set OUT to a folder for the results}
out=$(mktemp -d /tmp/device-check.XXXX)  # everything, packed into $OUT/device_check.tgz at the end
py=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

left() { echo $((budget - (SECONDS - start))); }

step() {  # step NAME MAX_SECONDS COMMAND...: bounded by the budget left, logged to $out/NAME.log
    local name=$1 max=$2; shift 2
    local t; t=$(left); ((t > max)) && t=$max
    if ((t < 20)); then echo "== $name: skipped, ${t}s left" | tee -a "$out/summary.txt"; return; fi
    local t0=$SECONDS
    timeout -k 10 "$t" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0))s (limit ${t}s)" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

if ! $py -c 'import crc32c' 2>/dev/null && compgen -G '.whl/*.whl' >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__)'
    nproc
} 2>&1 | tee "$out/summary.txt"

want() { [[ " ${CHECKS:-churn tests recovery checkpoint} " == *" $1 "* ]]; }

# The NCCL build/abort churn the job's way (the reaper), with the NCCL warnings on.
want churn && step churn 90 env NCCL_DEBUG=WARN $py -m unbroken bench epochs --device cuda --epochs 50 \
    --json --out "$out/churn.json"
want tests && step gpu_tests 240 $py -m pytest -q -p no:cacheprovider -m gpu tests/gpu -s --durations=0 \
    -o junit_family=xunit2 --junitxml="$out/gpu_tests.xml"
if want recovery; then
    # --alternate-steps: unbroken against plain HSDP inside one job (blocks of 10 steps each in turn)
    step bench_recovery $((budget - 60 - (SECONDS - start))) $py -m unbroken bench recovery --model llama \
        --device cuda --rounds "${ROUNDS:-2}" --only steady --only crash --only hang \
        --alternate-steps "${ALTERNATE_STEPS:-410}" --json --work-dir /tmp/bench-recovery --out "$out/recovery.json"
    find /tmp/bench-recovery \( -name '*.log' -o -name '*.jsonl' \) -size -2M 2>/dev/null | tar czf "$out/recovery_logs.tgz" -T - 2>/dev/null
fi
# Opt-in (CHECKS=takeover): the 12,500-node takeover on 16 cores, the simulated agents spread over
# 8 processes, so that they no longer take the standby's core as on the 2-core machine.
want takeover && step takeover 200 $py -m unbroken bench coordinator --nodes 12500 --step-time 2.0 \
    --client-procs 8 --max-asks-per-s 1000 --json --out "$out/takeover.json"
want checkpoint && step bench_checkpoint 90 $py -m unbroken bench checkpoint --device cuda --rounds 2 \
    --every-step-rounds 1 --json --out "$out/checkpoint.json"
echo "total $((SECONDS - start))s" | tee -a "$out/summary.txt"
cp "$out/summary.txt" "$OUT/" && tar czf "$OUT/device_check.tgz" -C "$out" .
