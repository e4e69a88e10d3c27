#!/usr/bin/env bash
# slurm-dev-cluster.sh — a real Slurm 22.05 cluster on this one machine, for the tests and for trying yatt-hpc.
#
#   sudo tools/slurm-dev-cluster.sh start    # install what is missing, start the daemons, wait for idle nodes
#   tools/slurm-dev-cluster.sh status        # what runs, sinfo
#   sudo tools/slurm-dev-cluster.sh stop     # cancel jobs, stop every daemon by its pid file
#
# Shape: munged, MariaDB + slurmdbd (so sacct and submitit see job states), slurmctld, and
# YATT_DEV_NODES (default 4) slurmd virtual nodes n1..nN on 127.0.0.1, each with its own port,
# spool and TmpFS (PMIx temp dirs collide otherwise). Heterogeneous jobs need >1 node: each
# het component lands on its own node. Open MPI + PMIx from Debian so `srun --mpi=pmix` works.
# Idempotent: installs only missing packages and starts only daemons that are not running.
# A controller that died with its jobs (machine reset, CI killed) is started clean: with no slurmd
# or slurmstepd alive no saved job can still be running, and recovering them would hold the nodes
# "allocated" forever. Job ids go on past the last one handed out (the accounting database's and
# the controller's saved state's), so sacct never mixes two jobs of one id.
# Partitions: `debug` (default, preemptible with REQUEUE, GraceTime 10 s) and `high` (preempts debug).
set -euo pipefail

NODES=${YATT_DEV_NODES:-4}
CPUS=${YATT_DEV_CPUS_PER_NODE:-4}      # advertised; oversubscribes the real cores on purpose
MEM=${YATT_DEV_MEM_PER_NODE:-8000}
READY_TIMEOUT=${YATT_DEV_TIMEOUT:-90}
CLUSTER=yattdev
HOST=$(hostname -s)
LOG=/var/log/slurm
T0=$(date +%s)

say() { echo "[slurm-dev-cluster $(( $(date +%s) - T0 ))s] $*"; }
die() { echo "slurm-dev-cluster: $*" >&2; exit 1; }
# running PIDFILE: the daemon that wrote it is alive (a pid file that survived a reset can name a
# reused pid: the process must also be a Slurm/munge/MariaDB daemon)
running() {
  local pid; [ -f "$1" ] && pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  case "$(cat "/proc/$pid/comm" 2>/dev/null)" in slurm*|munged|mariadbd|mysqld) return 0 ;; *) return 1 ;; esac
}
wait_until() { # wait_until SECONDS CMD... — poll CMD every 0.2 s
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}
need_root() { [ "$(id -u)" = 0 ] || die "'$1' needs root (it installs packages and starts daemons); run it with sudo"; }

install_packages() {
  # libpmix2 must be present before slurmd starts, or `srun --mpi=pmix` stalls 20 s and fails.
  local want=(munge slurmctld slurmd slurm-client openmpi-bin libopenmpi-dev libpmix2 slurmdbd mariadb-server)
  local missing=() p
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing packages (${missing[*]}) and no apt-get to install them"
  say "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

write_slurm_conf() {
  mkdir -p /etc/slurm /var/spool/slurmctld "$LOG"
  chown slurm:slurm /var/spool/slurmctld "$LOG"
  running /run/slurmctld.pid && return 0   # never rewrite the config under a live controller
  cat > /etc/slurm/slurm.conf <<CONF
# written by yatt-hpc tools/slurm-dev-cluster.sh: $NODES virtual nodes x $CPUS CPUs on one machine
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
TmpFS=/var/spool/slurmd/%n/tmp
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
FirstJobId=1
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2,bf_hetjob_immediate
MpiDefault=none
ReturnToService=2
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
KillWait=5
MinJobAge=600
InactiveLimit=0
Waittime=0
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODES))] CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=10
PartitionName=high  Nodes=n[1-$NODES] Default=NO  MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
  chmod 644 /etc/slurm/slurm.conf
}

tune_openmpi() {
  # Busy-polling ranks starve each other on 2 cores (a 4-rank test: 2.5 min -> 2 s with yield);
  # all traffic stays on loopback.
  local mca=/etc/openmpi/openmpi-mca-params.conf
  [ -f $mca ] || return 0
  grep -q 'yatt-hpc' $mca && return 0
  [ -n "$(tail -c1 $mca)" ] && echo >> $mca
  printf '%s\n' '# yatt-hpc dev cluster' 'mpi_yield_when_idle = 1' 'btl_tcp_if_include = lo' 'oob_tcp_if_include = lo' >> $mca
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  if ! running /run/munge/munged.pid; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    say "munged up"
  fi
  wait_until 15 bash -c 'munge -n | unmunge' || die "munge does not answer (see /var/log/munge/munged.log)"
}

start_accounting() {
  if ! running /run/mysqld/mysqld.pid; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >/dev/null
    setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --pid-file=/run/mysqld/mysqld.pid \
      </dev/null >>"$LOG/mariadb.log" 2>&1 &
    wait_until 30 mysqladmin ping || die "MariaDB did not start (see $LOG/mariadb.log)"
    say "mariadb up"
  fi
  mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'yatt-dev';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  cat > /etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
LogFile=$LOG/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=yatt-dev
StorageLoc=slurm_acct_db
CONF
  chown slurm:slurm /etc/slurm/slurmdbd.conf && chmod 600 /etc/slurm/slurmdbd.conf
  if ! running /run/slurmdbd.pid; then
    /usr/sbin/slurmdbd
    wait_until 30 bash -c 'exec 3<>/dev/tcp/127.0.0.1/6819' || die "slurmdbd not listening (see $LOG/slurmdbd.log)"
    say "slurmdbd up"
  fi
  sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
}

# The next job id the controller saved (accounting can lag it: a job submitted just before the
# controller died may not be recorded yet). Its job_state file opens with a u32 length and
# "PROTOCOL_VERSION\0", a u16 protocol version, a u64 time, then the u32 next job id, big-endian.
saved_next_job_id() {
  local f=/var/spool/slurmctld/job_state
  [ "$(head -c 21 "$f" 2>/dev/null | tail -c 17 | tr -d '\0')" = PROTOCOL_VERSION ] || return 0
  od -An -tu4 --endian=big -j31 -N4 "$f" | tr -d ' '
}

# Start the controller; clean (-c) when it saved jobs that nothing on this machine still runs.
start_controller() {
  running /run/slurmctld.pid && return 0
  local clean=()
  if [ -e /var/spool/slurmctld/job_state ] && ! pgrep -x slurmstepd >/dev/null && ! pgrep -x slurmd >/dev/null; then
    clean=(-c); say "no slurmd or slurmstepd runs here: starting slurmctld clean (a job it saved is gone)"
  fi
  # ids go on after the last one handed out (also after a clean start), or sacct mixes two jobs
  local last saved
  last=$(sacct -a -X -n -P -D -o JobIDRaw -S 2000-01-01 -E now 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -n 1 || true)
  saved=$(saved_next_job_id || true)
  last=$(( ${last:-0} + 1 )); [ "${saved:-0}" -gt "$last" ] && last=$saved
  sed -i "s/^FirstJobId=.*/FirstJobId=$last/" /etc/slurm/slurm.conf
  /usr/sbin/slurmctld "${clean[@]}"
  say "slurmctld up"
}

all_idle() { [ "$(scontrol -o show nodes 2>/dev/null | grep -c 'State=IDLE')" -ge "$NODES" ]; }

start() {
  need_root start
  install_packages
  write_slurm_conf
  tune_openmpi
  local i
  for i in $(seq 1 "$NODES"); do mkdir -p "/var/spool/slurmd/n$i/tmp"; chmod 1777 "/var/spool/slurmd/n$i/tmp"; done
  start_munge
  start_accounting
  start_controller
  for i in $(seq 1 "$NODES"); do running "/run/slurmd-n$i.pid" || /usr/sbin/slurmd -N "n$i"; done
  if ! wait_until "$READY_TIMEOUT" all_idle; then
    sinfo -N >&2 || true; squeue >&2 || true; tail -n 20 "$LOG/slurmctld.log" >&2 || true
    die "nodes not idle after ${READY_TIMEOUT}s"
  fi
  say "ready: $(sinfo -h -p debug -o '%D nodes %T')"
}

stop_pidfile() { # SIGTERM, 10 s grace, then SIGKILL
  local pf=$1 pid
  running "$pf" || { rm -f "$pf"; return 0; }
  pid=$(cat "$pf"); kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  rm -f "$pf"
}

stop() {
  need_root stop
  if running /run/slurmctld.pid; then
    # job processes outlive slurmd: cancel first
    local jobs; jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// }" ]; then
      say "cancelling $jobs"; scancel $jobs 2>/dev/null || true
      wait_until 20 bash -c '[ -z "$(squeue -h -o %A)" ]' || true
    fi
  fi
  shopt -s nullglob
  local pf
  for pf in /run/slurmd-*.pid; do stop_pidfile "$pf"; done
  stop_pidfile /run/slurmctld.pid
  stop_pidfile /run/slurmdbd.pid
  stop_pidfile /run/mysqld/mysqld.pid
  stop_pidfile /run/munge/munged.pid
  say "stopped"
}

status() {
  local d pf
  for d in munge/munged mysqld/mysqld slurmdbd slurmctld; do
    pf=/run/$d.pid; running "$pf" && echo "up    ${d##*/}" || echo "down  ${d##*/}"
  done
  for pf in /run/slurmd-*.pid; do [ -e "$pf" ] || continue; running "$pf" && echo "up    $(basename "$pf" .pid)" || echo "down  $(basename "$pf" .pid)"; done
  if running /run/slurmctld.pid && all_idle; then sinfo; return 0; fi
  running /run/slurmctld.pid && sinfo 2>/dev/null
  return 3
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
