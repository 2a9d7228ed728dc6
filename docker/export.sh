#!/usr/bin/env bash
# Turn an image built by docker/build.sh into the file a Slurm container runtime reads:
#   docker/export.sh sqsh flexfloor:h100 /shared/flexfloor-h100.sqsh   # enroot, for pyxis
#   docker/export.sh sif  flexfloor:h100 /shared/flexfloor-h100.sif    # apptainer
# Run it where the Docker daemon holding the image runs, and write to storage the compute nodes
# see; then FF_CONTAINER_IMAGE=/shared/flexfloor-h100.sqsh (FF_CONTAINER_RUNTIME=apptainer for the
# .sif). A pushed image needs no file: FF_CONTAINER_IMAGE=registry.example.org#me/flexfloor:h100
# (pyxis) or docker://registry.example.org/me/flexfloor:h100 (apptainer).
set -euo pipefail
usage="usage: docker/export.sh sqsh|sif DOCKER_TAG OUT_FILE"
kind=${1:?$usage}
tag=${2:?$usage}
out=${3:?$usage}
case $kind in
sqsh)
    [[ $out == *.sqsh ]] || { echo "docker/export.sh: $out: an enroot image file ends in .sqsh" >&2; exit 2; }
    exec enroot import --output "$out" "dockerd://$tag"
    ;;
sif)
    [[ $out == *.sif ]] || { echo "docker/export.sh: $out: an apptainer image file ends in .sif" >&2; exit 2; }
    exec apptainer build "$out" "docker-daemon://$tag"
    ;;
*)
    echo "docker/export.sh: unknown kind '$kind' (kinds: sqsh, sif)" >&2
    exit 2
    ;;
esac
