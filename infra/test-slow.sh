#!/usr/bin/env bash
# The slow real-part suites listed in infra/slow-tests.txt: processes killed and stalled mid-run
# (test/faults), signals to whole stacks, the persistent local stack. CI runs them after `npm test`.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
npx jest --runInBand --forceExit --testPathPatterns "$(cat infra/slow-tests.txt | paste -sd'|')"
