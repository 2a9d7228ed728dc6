# shellcheck shell=bash
# shellcheck disable=SC2034  # FF_SRUN_CONTAINER, FF_IN_CONTAINER and FF_MOUNTS are read by launch.sh
# Container runtimes for the sbatch scripts (sourced by launch.sh; not a job script itself).
#
#   FF_CONTAINER_IMAGE    the image each node's torchrun runs in (none: run on the host)
#   FF_CONTAINER_RUNTIME  pyxis (default): srun --container-image, an enroot .sqsh file or a
#                                          registry reference `registry#repo:tag`
#                         apptainer:       apptainer exec --nv, a .sif file or docker://registry/repo:tag
#                         docker:          docker run --gpus all on every node (the image loaded there)
#   FF_CONTAINER_MOUNTS   more bind mounts, comma-separated SRC:DST[,SRC:DST...] (models, data,
#                         checkpoints), e.g. /lustre/models:/models,/lustre/data:/data
#
# The checkout (FLEXFLOOR_HOME) and the submit folder are mounted at their own paths, and the
# command runs with PYTHONPATH=FLEXFLOOR_HOME, so the ranks run this checkout's code, not the copy
# the image was built with (an editable install's finder comes after PYTHONPATH on sys.path).

FF_CONTAINER_RUNTIMES="pyxis apptainer docker"

ff_container_die() {
    echo "flexfloor-slurm: $*" >&2
    exit 2
}

# Sets FF_MOUNTS: the checkout, the submit folder and FF_CONTAINER_MOUNTS, without repeats.
ff_container_mounts() {
    local home=$1 mount
    local -a extra=()
    FF_MOUNTS=("$home:$home")
    [[ $PWD == "$home" ]] || FF_MOUNTS+=("$PWD:$PWD")
    if [[ -n ${FF_CONTAINER_MOUNTS:-} ]]; then
        IFS=, read -r -a extra <<< "$FF_CONTAINER_MOUNTS"
    fi
    for mount in "${extra[@]}"; do
        [[ $mount == /*:/* ]] || ff_container_die "FF_CONTAINER_MOUNTS: expected SRC:DST with absolute paths, got '$mount'"
        FF_MOUNTS+=("$mount")
    done
}

# pyxis pulls what is not a file from a registry: a local Docker tag (flexfloor:h100) is not
# there. Refuse it before the job's nodes try.
ff_container_check_pyxis_image() {
    local image=$1
    if [[ $image == *.sqsh ]]; then
        [[ -f $image ]] || ff_container_die "FF_CONTAINER_IMAGE: no such enroot image $image"
    elif [[ $image != *"#"* && $image != */* ]]; then
        ff_container_die "FF_CONTAINER_IMAGE=$image looks like a local Docker tag, which pyxis/enroot cannot" \
            "pull; import it (enroot import -o flexfloor-h100.sqsh dockerd://$image, see docker/export.sh)" \
            "or push it and give registry#repo:tag"
    fi
}

# ff_container_wrap HOME: sets FF_SRUN_CONTAINER (srun options) and FF_IN_CONTAINER (the words
# before torchrun) for the configured runtime; both empty without FF_CONTAINER_IMAGE.
ff_container_wrap() {
    local home=$1 mount var
    FF_SRUN_CONTAINER=()
    FF_IN_CONTAINER=()
    [[ -n ${FF_CONTAINER_IMAGE:-} ]] || return 0
    local runtime=${FF_CONTAINER_RUNTIME:-pyxis} image=$FF_CONTAINER_IMAGE
    ff_container_mounts "$home"
    local run_checkout=(env "PYTHONPATH=$home${PYTHONPATH:+:$PYTHONPATH}")
    case $runtime in
    pyxis)
        ff_container_check_pyxis_image "$image"
        local joined
        joined=$(IFS=,; echo "${FF_MOUNTS[*]}")
        FF_SRUN_CONTAINER=(--container-image="$image" --container-mounts="$joined" --container-workdir="$PWD")
        FF_IN_CONTAINER=("${run_checkout[@]}")
        ;;
    apptainer)
        local binds
        binds=$(IFS=,; echo "${FF_MOUNTS[*]}")
        # --nv: the host's NVIDIA driver libraries and devices inside the container.
        FF_IN_CONTAINER=(apptainer exec --nv --bind "$binds" --pwd "$PWD" "$image" "${run_checkout[@]}")
        ;;
    docker)
        FF_IN_CONTAINER=(docker run --rm --gpus all --ipc=host --network=host --ulimit memlock=-1
                         --workdir "$PWD")
        for mount in "${FF_MOUNTS[@]}"; do
            FF_IN_CONTAINER+=(--volume "$mount")
        done
        # Docker passes no environment on: the rendezvous, NCCL, W&B and Slurm settings by name.
        while IFS= read -r var; do
            FF_IN_CONTAINER+=(--env "$var")
        done < <(compgen -e | grep -E '^(MASTER_|NCCL_|TORCH_|CUDA_|OMP_|WANDB_|HF_|SLURM_|FF_|FLEXFLOOR)' | sort)
        FF_IN_CONTAINER+=("$image" "${run_checkout[@]}")
        ;;
    *)
        ff_container_die "FF_CONTAINER_RUNTIME=$runtime: expected one of $FF_CONTAINER_RUNTIMES"
        ;;
    esac
}
