#!/usr/bin/env bash
# A real, one-node Slurm on this machine, for testing the generated batch scripts (as root).
#
#   scripts/slurm_local.sh start    install Debian's slurmd, slurmctld, munge and slurm-client
#                                   when missing, write a one-node slurm.conf for this host,
#                                   start munged (unless one answers), slurmctld and slurmd,
#                                   and wait until the node takes jobs
#   scripts/slurm_local.sh stop     stop the daemons that `start` started (by their pid files)
#   scripts/slurm_local.sh env      print `export SLURM_CONF=...` for sbatch / srun / squeue
#
# Everything lives in $MSCALE_SLURM_DIR (default /tmp/mscale-slurm): slurm.conf, state, spool,
# pid and log files; /etc/slurm is not touched (the clients find the config via SLURM_CONF).
# The node offers $MSCALE_SLURM_SLOTS task slots (default 4) on this host's cores, with
# ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups needed). Ports:
# $MSCALE_SLURM_PORT (slurmctld, default 6817) and the next one (slurmd).
set -euo pipefail

DIR=${MSCALE_SLURM_DIR:-/tmp/mscale-slurm}
SLOTS=${MSCALE_SLURM_SLOTS:-4}
PORT=${MSCALE_SLURM_PORT:-6817}
HOST=$(hostname -s)
export SLURM_CONF=$DIR/slurm.conf

say() { echo "[slurm_local] $*" >&2; }

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v munged >/dev/null || missing+=(munge)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  [ ${#missing[@]} -eq 0 ] && return
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

write_config() {
  mkdir -p "$DIR/state" "$DIR/spool"
  cat > "$SLURM_CONF" <<EOF
# One-node Slurm for tests (scripts/slurm_local.sh); not for production.
ClusterName=mscale-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$SLOTS State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

munge_answers() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start() {
  [ "$(id -u)" -eq 0 ] || { say "needs root (installs packages, runs slurmd)"; exit 1; }
  install_packages
  if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    say "already running ($DIR)"
    return
  fi
  write_config
  if ! munge_answers; then
    mkdir -p /run/munge && chown munge:munge /run/munge   # munged runs as user munge
    runuser -u munge -- munged
    touch "$DIR/munged.ours"
  fi
  for _ in $(seq 50); do munge_answers && break; sleep 0.1; done
  munge_answers || { say "munged does not answer (see /var/log/munge/munged.log)"; exit 1; }
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 120); do
    if sinfo -h -N -o "%t" 2>/dev/null | grep -qE "^(idle|mix|alloc)"; then
      say "up: node $HOST, $SLOTS task slots; export SLURM_CONF=$SLURM_CONF"
      return
    fi
    sleep 0.5
  done
  say "the node did not come up; sinfo: $(sinfo -N 2>&1 | tail -1)"
  tail -5 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
  exit 1
}

stop_pidfile() {
  local file=$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$file"
}

stop() {
  if [ -f "$SLURM_CONF" ] && command -v scancel >/dev/null; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true   # no job outlives its Slurm
  fi
  stop_pidfile "$DIR/slurmd.pid"
  stop_pidfile "$DIR/slurmctld.pid"
  if [ -f "$DIR/munged.ours" ]; then
    stop_pidfile /run/munge/munged.pid
    rm -f "$DIR/munged.ours"
  fi
  say "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
