#!/usr/bin/env bash
# The whole suite: contract schema current, pytest (engine, actor, algorithm), type check, jest
# (unit, workflows on a real Temporal dev server, end to end with real engines and actor).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/python gpu-services/contract.py --check
.venv/bin/python -m pytest test/py -q -p no:cacheprovider "$@"
npx tsc --noEmit -p .
# The slow real-part suites (kills and faults mid-run, signals to whole stacks, the persistent stack)
# run apart: `npm run test:slow` (infra/test-slow.sh), and the namespace cluster (root) with `npm run
# test:cluster` (infra/test-cluster.sh); CI runs all three.
npx jest --runInBand --forceExit --testPathIgnorePatterns "$(cat infra/slow-tests.txt | paste -sd'|')|/test/cluster/"
