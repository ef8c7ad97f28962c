#!/usr/bin/env bash
# Submits infra/slurm/molt.sbatch for one job of a Molt run, with nodes and GPUs from the environment;
# further arguments go to sbatch as they are (--time, --partition, --account, --dependency, ...).
# Prints the job id. The job passes the same arguments (MOLT_SBATCH_ARGS) and environment on to the
# next job of a chain (MOLT_CHAIN). Variables: docs/cluster.md.
#   MOLT_TEMPORAL_ADDRESS=temporal.internal:7233 MOLT_RUN_ID=qwen3-8b-a MOLT_RECIPE=recipes/mine \
#     MOLT_CHAIN=6 infra/slurm/submit.sh --time=24:00:00 --partition=gpu
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${MOLT_TEMPORAL_ADDRESS:?MOLT_TEMPORAL_ADDRESS: the Temporal server (host:port) that holds the run}"
: "${MOLT_RUN_ID:?MOLT_RUN_ID: the run to start or continue (letters, digits, . _ -)}"
GPUS=${MOLT_GPUS_PER_NODE:-8}
NODES=${MOLT_NODES:-2}
# Inside a job (a chained resubmission), the job's own SLURM_* variables must not leak into the next.
for v in $(compgen -e | grep '^SLURM_' || true); do [ "$v" = SLURM_CONF ] || unset "$v"; done
# The arguments the next jobs of a chain get too; not a dependency, which each job sets afresh.
keep=()
for a in "$@"; do [[ $a == --dependency=* ]] || keep+=("$a"); done
export MOLT_SBATCH_ARGS="${keep[*]}"
mkdir -p "${MOLT_STATE:-.molt/slurm}/logs" # sbatch does not create the folder of --output
gpu_args=()
(( GPUS > 0 )) && gpu_args=(--gpus-per-node="$GPUS")
exec sbatch --parsable --nodes="$NODES" --exclusive "${gpu_args[@]}" \
  --output="${MOLT_STATE:-.molt/slurm}/logs/slurm-%j.out" "$@" infra/slurm/molt.sbatch
