#!/usr/bin/env bash
# The namespace cluster (test/cluster): Temporal, workers, engines and a two-node actor on hosts of
# their own (Linux network namespaces on a bridge). Needs root; CI (.ci/run) runs it after test:slow.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
npx jest --runInBand --forceExit test/cluster
