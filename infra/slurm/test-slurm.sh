#!/usr/bin/env bash
# `npm run test:slurm`: the Slurm scripts on a real one-node cluster of this machine (Debian's
# slurm-wlm: munged + slurmctld + slurmd, a private config under .molt/slurm-test, nothing in /etc),
# with a Temporal dev server outside the jobs, as a cluster's Temporal service would be.
#   1. an sbatch of the embedded recipe (5 steps) completes: job COMPLETED, run COMPLETED, 5 metric lines;
#   2. a chain: the first job queues its successor (--dependency=afterany) and is cancelled mid-run,
#      as a time limit would end it; the successor continues the same run id to its last step, every
#      step recorded once.
# Needs root (it starts the daemons, and installs slurm-wlm and munge with apt-get if they are missing).
# Everything it started is stopped at the end, also on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
T0=$SECONDS
say() { echo "[test:slurm $(date -u +%T) +$(( SECONDS - T0 ))s] $*"; }
fail() { say "FAIL: $*"; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurm-wlm and munge (apt-get)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge curl >/dev/null) \
    || fail "apt-get install slurm-wlm munge failed (root and a Debian mirror are needed)"
fi

D=$REPO/.molt/slurm-test
rm -rf "$D"
mkdir -p "$D"/{munge,munge-key,spool,ctld,log}
chmod 755 "$D" "$D/munge" # munged wants a socket folder everyone may enter
chmod 700 "$D/munge-key"
free_ports() { .venv/bin/python -c "import socket
s=[socket.socket() for _ in range($1)]
[x.bind(('127.0.0.1',0)) for x in s]; print(' '.join(str(x.getsockname()[1]) for x in s))"; }
read -r CTLD_PORT SLURMD_PORT TEMPORAL_PORT ENGINE_PORT ACTOR_PORT RDZV_PORT < <(free_ports 6)

PIDFILES=()
cleanup() {
  trap - EXIT INT TERM
  say "stopping jobs and daemons"
  [ -f "$D/slurm.conf" ] && SLURM_CONF=$D/slurm.conf scancel --user=root 2>/dev/null && sleep 5 || true
  for f in "${PIDFILES[@]}"; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  for f in "${PIDFILES[@]}"; do
    for _ in $(seq 50); do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null || break; sleep 0.2; done
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# munge: its own key and socket, so the machine's munge (if any) is left alone.
head -c 1024 /dev/urandom > "$D/munge-key/munge.key"
chmod 400 "$D/munge-key/munge.key"
/usr/sbin/munged --force --key-file="$D/munge-key/munge.key" --socket="$D/munge/munge.socket" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/munge/seed"
PIDFILES+=("$D/munge/munged.pid")

# A one-node cluster with this machine's real name, CPUs and memory (slurmd -C).
NODE_LINE=$(slurmd -C | head -1)
NODE=$(sed 's/^NodeName=\([^ ]*\).*/\1/' <<< "$NODE_LINE")
cat > "$D/slurm.conf" <<EOF
ClusterName=molt-test
SlurmctldHost=$NODE
SlurmUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$D/ctld
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
DefMemPerCPU=1000
MpiDefault=none
ReturnToService=2
KillWait=20
$NODE_LINE State=UNKNOWN
PartitionName=main Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$D/slurm.conf
/usr/sbin/slurmctld -f "$SLURM_CONF"
PIDFILES+=("$D/slurmctld.pid")
/usr/sbin/slurmd -f "$SLURM_CONF"
PIDFILES+=("$D/slurmd.pid")
for _ in $(seq 60); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo -h -o %T | grep -q idle || fail "the node did not come up: $(sinfo 2>&1); logs in $D/log"
say "one-node cluster up: $(sinfo -h -N -o '%N %c CPUs %m MB %T')"

# Temporal outside the jobs (its state is what lets a later job continue the run).
.venv/bin/temporal server start-dev --headless --db-filename "$D/temporal.db" --port "$TEMPORAL_PORT" \
  --log-level warn --search-attribute MoltRecipe=Keyword --search-attribute MoltStep=Int \
  --search-attribute MoltVersion=Int --search-attribute MoltReward=Double > "$D/log/temporal.log" 2>&1 &
echo $! > "$D/temporal.pid"
PIDFILES+=("$D/temporal.pid")
for _ in $(seq 120); do (exec 3<>"/dev/tcp/127.0.0.1/$TEMPORAL_PORT") 2>/dev/null && break; sleep 0.5; done

export MOLT_TEMPORAL_ADDRESS=127.0.0.1:$TEMPORAL_PORT MOLT_STATE=$D/molt MOLT_NODES=1 MOLT_GPUS_PER_NODE=0
export MOLT_ENGINE_PORT=$ENGINE_PORT MOLT_ACTOR_PORT=$ACTOR_PORT MOLT_RDZV_PORT=$RDZV_PORT MOLT_POLL_SECONDS=5
mkdir -p "$MOLT_STATE/logs"

job_field() { scontrol show job "$1" | grep -o "\b$2=[^ ]*" | head -1 | cut -d= -f2; }
wait_job() { # until job $1 has ended; prints its state
  for _ in $(seq 720); do
    case "$(job_field "$1" JobState)" in PENDING|RUNNING|CONFIGURING|COMPLETING|'') sleep 5 ;; *) break ;; esac
  done
  job_field "$1" JobState
}
steps_of() { [ -f "$MOLT_STATE/runs/$1/metrics.jsonl" ] && grep -o '"step":[0-9]*' "$MOLT_STATE/runs/$1/metrics.jsonl" | cut -d: -f2 || true; }
molt_status() { node_modules/.bin/tsx client/cli.ts status "$1"; }

# 1. One job runs the embedded recipe to its end.
say "case 1: one job, the embedded recipe with 5 steps"
J1=$(MOLT_RUN_ID=slurm-one MOLT_RECIPE_ARGS="--train.steps 5" infra/slurm/submit.sh --time=30)
S1=$SECONDS
[ "$(wait_job "$J1")" = COMPLETED ] || fail "job $J1 ended $(job_field "$J1" JobState); log $MOLT_STATE/logs/slurm-$J1.out:
$(tail -30 "$MOLT_STATE/logs/slurm-$J1.out")"
say "job $J1 COMPLETED, wall time $(job_field "$J1" RunTime) (submit to end $(( SECONDS - S1 )) s)"
molt_status slurm-one | tee "$D/status-one.txt"
grep -q 'finished after 5 steps' "$D/status-one.txt" || fail "run slurm-one did not finish its 5 steps"
[ "$(steps_of slurm-one | sort -un | paste -sd,)" = 1,2,3,4,5 ] || fail "metrics steps of slurm-one: $(steps_of slurm-one | paste -sd,)"

# 2. A chain of two jobs continues one run: the first is cancelled after step 3 (as a time limit
#    would end it), the second (queued by the first with --dependency=afterany) finishes the run.
say "case 2: a chain of two jobs on one run of 12 steps, the first cancelled mid-run"
J2=$(MOLT_RUN_ID=slurm-chain MOLT_CHAIN=1 MOLT_RECIPE_ARGS="--train.steps 12 --checkpoint.every 2" \
  infra/slurm/submit.sh --time=30)
S2=$SECONDS
for _ in $(seq 720); do
  (( $(steps_of slurm-chain | wc -l) >= 3 )) && break
  case "$(job_field "$J2" JobState)" in
    PENDING|CONFIGURING|RUNNING|'') ;;
    *) fail "job $J2 ended $(job_field "$J2" JobState) before step 3: $(tail -30 "$MOLT_STATE/logs/slurm-$J2.out")" ;;
  esac
  sleep 2
done
J3=$(squeue -h -o '%i %E' | awk -v j="$J2" '$2 ~ "afterany:"j {print $1}')
[ -n "$J3" ] || fail "job $J2 queued no successor with afterany:$J2 (squeue: $(squeue))"
say "run slurm-chain at step $(steps_of slurm-chain | tail -1) in job $J2 ($(( SECONDS - S2 )) s); successor $J3 queued; scancel $J2"
scancel "$J2"
wait_job "$J2" >/dev/null
S3=$SECONDS
[ "$(wait_job "$J3")" = COMPLETED ] || fail "job $J3 ended $(job_field "$J3" JobState): $(tail -30 "$MOLT_STATE/logs/slurm-$J3.out")"
say "job $J3 COMPLETED, wall time $(job_field "$J3" RunTime) (after $J2 ended: $(( SECONDS - S3 )) s)"
grep -q 'continuing run slurm-chain' "$MOLT_STATE/logs/slurm-$J3.out" || fail "job $J3 did not continue the run"
molt_status slurm-chain | tee "$D/status-chain.txt"
grep -q 'finished after 12 steps' "$D/status-chain.txt" || fail "run slurm-chain did not finish its 12 steps"
[ "$(steps_of slurm-chain | sort -n | paste -sd,)" = "$(seq -s, 12)" ] \
  || fail "metrics steps of slurm-chain, each once expected: $(steps_of slurm-chain | paste -sd,)"
say "PASS in $(( SECONDS - T0 )) s"
