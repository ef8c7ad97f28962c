#!/usr/bin/env bash
# The whole suite: contract schema current, pytest (engine, actor, algorithm), type check, jest
# (unit, workflows on a real Temporal dev server, end to end with real engines and actor).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python gpu-services/contract.py --check
.venv/bin/python -m pytest test/py -q -p no:cacheprovider "$@"
npx tsc --noEmit -p .
npx jest --runInBand --forceExit
