#!/usr/bin/env bash
# Build a FlexFloor image with the versions pinned in docker/versions.env:
#   docker/build.sh h100 [TAG]     # default tag flexfloor:h100
#   docker/build.sh cpu [TAG]      # default tag flexfloor:cpu
# Extra `docker build` options may follow the tag (e.g. --push with buildx, --progress=plain).
set -euo pipefail
kind=${1:?usage: docker/build.sh h100|cpu [TAG] [DOCKER BUILD OPTIONS...]}
tag=${2:-flexfloor:$kind}
shift $(($# < 2 ? $# : 2))
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dockerfile=$repo/docker/Dockerfile.$kind
[[ -f $dockerfile ]] || { echo "docker/build.sh: no $dockerfile (kinds: h100, cpu)" >&2; exit 2; }

build_args=()
while IFS= read -r line || [[ -n $line ]]; do
    [[ -z $line || $line == \#* ]] && continue
    build_args+=(--build-arg "$line")
done < "$repo/docker/versions.env"

# The build context is the repository root: the image installs this checkout.
exec docker build "${build_args[@]}" -f "$dockerfile" -t "$tag" "$@" "$repo"
