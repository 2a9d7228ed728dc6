# shellcheck shell=bash
# Shared by the sbatch scripts in this folder (they `source` it); not a job script itself.
#
# One Slurm task per node runs torchrun, which starts NPROC_PER_NODE ranks there and meets the
# other nodes through a c10d rendezvous on the first node of the allocation. The ranks see
# RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from torchrun, which is how `flexfloor` joins an
# existing process group instead of spawning its own.
#
# Environment the user may set (sbatch passes the submitting shell's environment on):
#   FLEXFLOOR          command that runs flexfloor (default `flexfloor`; e.g. `python -m megatron_rl.cli`,
#                      or the path of an executable, taken whole even with spaces: see ff_command)
#   FLEXFLOOR_HOME     checkout holding examples/ (default: the folder sbatch was called from)
#   FF_RUN_DIR         run folder for reports, metrics and checkpoints (default runs/JOBNAME: the
#                      job name, not its id, so a requeue, a resubmit after a TIMEOUT or a failed
#                      node, or a manual `sbatch` again resumes the same run; one run per job name)
#   NPROC_PER_NODE     ranks per node (default: GPUs per node of the allocation, else 1)
#   FF_DEVICE          cuda or cpu, passed as `--device` (default cuda: one rank per GPU,
#                      cuda:LOCAL_RANK, over NCCL). An allocation without GPUs stops with one line
#                      unless FF_DEVICE=cpu asks for gloo ranks on CPU: never a silent CPU run.
#   FF_CONTAINER_IMAGE, FF_CONTAINER_RUNTIME, FF_CONTAINER_MOUNTS
#                      run each node's torchrun in a container (pyxis, apptainer or docker; container.sh)
#   FLEXFLOOR_DRY_RUN  1: print the launch command instead of running it
#   FF_TORCHRUN        command that runs torchrun (default `torchrun`; e.g. `python -m torch.distributed.run`
#                      when the Python environment is not activated on the compute nodes; read as FLEXFLOOR)
#   FF_SIGNAL_LEAD_S   seconds before the time limit that `#SBATCH --signal=B:USR1@N` signals (each
#                      sbatch file sets it next to that line). The trainer plans its last step to be
#                      saved before then (megatron_rl/rl/deadline.py), from SLURM_JOB_END_TIME.
#   FF_STOP_GRACE_S    seconds torchrun gives the ranks after SIGTERM to finish the step and save
#                      (default FF_SIGNAL_LEAD_S - 60, else 240); torchrun before 2.10 ignores it and
#                      allows 30, which is why the trainer's deadline stop comes first

# shellcheck source=examples/slurm/container.sh
source "$(dirname "${BASH_SOURCE[0]}")/container.sh"

ff_log() {
    echo "flexfloor-slurm: $*"
}

ff_die() {
    echo "flexfloor-slurm: $*" >&2
    exit 2
}

# ff_command ARRAY VALUE: the command VALUE names, as the words of array ARRAY. The path of an
# executable file is one word, spaces and all (FLEXFLOOR="/opt/my tools/flexfloor"); anything else
# is split into words (FLEXFLOOR="python -m megatron_rl.cli").
# shellcheck disable=SC2034  # ff_words is a nameref: what it sets is the caller's array
ff_command() {
    local -n ff_words=$1
    if [[ $2 == */* && -f $2 && -x $2 ]]; then
        ff_words=("$2")
    else
        read -r -a ff_words <<< "$2"
    fi
}

# Sets FF_CMD, FF_RUN_DIR, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE, FF_DEVICE.
ff_init() {
    : "${SLURM_JOB_ID:?submit this script with sbatch (SLURM_JOB_ID is not set)}"
    ff_command FF_CMD "${FLEXFLOOR:-flexfloor}"
    # The job name, not its id: a resubmitted job (new id) finds its run folder, and resumes, again.
    FF_RUN_DIR=${FF_RUN_DIR:-runs/${SLURM_JOB_NAME:-flexfloor}}
    mkdir -p "$FF_RUN_DIR"
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    # Derived from the job id so that two jobs sharing a first node do not collide.
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    # `--gpus-per-node=h100:8` sets SLURM_GPUS_PER_NODE (type prefix stripped below); some sites
    # and `--gres=gpu:8` set only SLURM_GPUS_ON_NODE.
    local gpus=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    gpus=${gpus##*:}
    if [[ -z ${FF_DEVICE:-} ]]; then
        if [[ ${gpus:-0} -le 0 ]]; then
            ff_die "job $SLURM_JOB_ID has no GPUs: submit with --gpus-per-node=N (sbatch" \
                "--gpus-per-node=8 ...), or set FF_DEVICE=cpu for gloo ranks on CPU"
        fi
        FF_DEVICE=cuda
    fi
    NPROC_PER_NODE=${NPROC_PER_NODE:-${gpus:-1}}
    local backend=gloo
    if [[ $FF_DEVICE == cuda ]]; then
        backend=NCCL
    fi
    export MASTER_ADDR MASTER_PORT FF_RUN_DIR FF_DEVICE
    ff_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES} node(s)" \
        "x $NPROC_PER_NODE rank(s) per node, device $FF_DEVICE ($backend), rendezvous" \
        "$MASTER_ADDR:$MASTER_PORT, run folder $FF_RUN_DIR"
}

# ff_launch COMMAND ARGS...: run `flexfloor COMMAND --device $FF_DEVICE ARGS...` on every rank of the
# allocation (ARGS may override the device); returns its status.
ff_launch() {
    local srun_opts=(--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1
                     --kill-on-bad-exit=1)
    # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05); torchrun's ranks need them.
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
        srun_opts+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    fi
    # torchrun SIGKILLs its ranks this long after forwarding a SIGTERM: the signal lead less a minute
    # for the requeue. Exported before the container's environment list is built, so it reaches it.
    local lead=${FF_SIGNAL_LEAD_S:-0}
    FF_STOP_GRACE_S=${FF_STOP_GRACE_S:-$((lead > 120 ? lead - 60 : 240))}
    export FF_STOP_GRACE_S TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$FF_STOP_GRACE_S
    ff_log "stop grace ${FF_STOP_GRACE_S} s after SIGTERM (signal lead ${lead} s)"
    ff_container_wrap "${FLEXFLOOR_HOME:-$PWD}"
    # Every rank's stdout and stderr in its own file, FF_RUN_DIR/logs/JOBID_*/attempt_0/LOCAL_RANK/,
    # and on the job's output too, each line prefixed with its rank (torchrun's --log-dir and --tee).
    local torchrun
    ff_command torchrun "${FF_TORCHRUN:-torchrun}"
    local cmd=(srun "${srun_opts[@]}" "${FF_SRUN_CONTAINER[@]}" "${FF_IN_CONTAINER[@]}"
               "${torchrun[@]}" --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC_PER_NODE"
               --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"
               --max-restarts=0 --log-dir="$FF_RUN_DIR/logs" --tee=3 --no-python "${FF_CMD[@]}" "$1" --device "$FF_DEVICE" "${@:2}")
    ff_log "${cmd[*]}"
    if [[ ${FLEXFLOOR_DRY_RUN:-0} == 1 ]]; then
        return 0
    fi
    # In the background so that a trapped signal interrupts `wait` at once.
    "${cmd[@]}" &
    FF_STEP_PID=$!
    wait "$FF_STEP_PID"
}

# Called on the USR1 that `#SBATCH --signal=B:USR1@SECONDS` sends before the time limit: send
# SIGTERM to every rank of the running step and wait for it to end (time for a trainer to write a
# last checkpoint), then requeue the job; it restarts with the same job id and run folder and
# resumes from the latest checkpoint there. The signal goes through scancel, not to srun: srun answers a
# SIGTERM of its own by killing the step outright. Pre-emption needs no trap: with `--requeue`
# Slurm requeues the job itself.
ff_requeue() {
    ff_log "got USR1 at $(date -u +%FT%TZ), stopping the ranks and requeueing job $SLURM_JOB_ID"
    scancel --signal=TERM "$SLURM_JOB_ID" || true
    if [[ -n ${FF_STEP_PID:-} ]]; then
        wait "$FF_STEP_PID" || true
    fi
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}

# ff_train CONFIG [ARGS...]: `flexfloor train` into FF_RUN_DIR. After a requeue the same command
# runs again: `flexfloor train` resumes by itself from the latest checkpoint in its --out folder.
ff_train() {
    local config=$1
    shift
    if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
        ff_log "restart ${SLURM_RESTART_COUNT}: flexfloor train resumes from the latest checkpoint in $FF_RUN_DIR"
    fi
    trap ff_requeue USR1
    rm -f "$FF_RUN_DIR/requeue"
    ff_launch train --config "$config" --out "$FF_RUN_DIR" "$@"
    # The trainer saved and stopped because the next step would not fit before the job's end
    # (megatron_rl/rl/deadline.py): run again, before Slurm ends the job as TIMEOUT (never requeued).
    if [[ -f $FF_RUN_DIR/requeue ]]; then
        ff_log "stopped before the time limit ($(cat "$FF_RUN_DIR/requeue")), requeueing job $SLURM_JOB_ID"
        rm -f "$FF_RUN_DIR/requeue"
        if [[ ${FLEXFLOOR_DRY_RUN:-0} != 1 ]]; then
            scontrol requeue "$SLURM_JOB_ID"
        fi
    fi
}
