#!/bin/sh
# Build the repository's Dockerfile with the first container builder that works here:
# docker (buildx when present), podman, nerdctl or buildah; CONTAINER_BUILDER picks one.
#
#   docker/build-image.sh TAG [--build-arg NAME=VALUE ...]   build TAG from the repository root
#   docker/build-image.sh --which                            name the builder, or say why none
set -eu

# The first builder whose engine answers; prints nothing when none does.
find_builder() {
    for tool in ${CONTAINER_BUILDER:-docker podman nerdctl buildah}; do
        command -v "$tool" >/dev/null 2>&1 || continue
        if "$tool" info >/dev/null 2>&1; then
            echo "$tool"
            return
        fi
    done
}

# One line: what is installed and why it cannot build.
no_builder_reason() {
    found=""
    for tool in ${CONTAINER_BUILDER:-docker podman nerdctl buildah}; do
        command -v "$tool" >/dev/null 2>&1 && found="$found $tool"
    done
    if [ -z "$found" ]; then
        echo "no container builder installed: install docker, podman, nerdctl or buildah"
    else
        echo "no working container builder:$found installed but \`info\` fails (is the engine running?)"
    fi
}

builder=$(find_builder)
if [ "${1:-}" = "--which" ]; then
    if [ -n "$builder" ]; then echo "$builder"; else no_builder_reason; exit 1; fi
    exit 0
fi
if [ $# -lt 1 ]; then
    echo "usage: $0 TAG [--build-arg NAME=VALUE ...] | --which" >&2
    exit 2
fi
if [ -z "$builder" ]; then
    echo "make image: $(no_builder_reason)" >&2
    exit 1
fi
tag=$1
shift
cd "$(dirname "$0")/.."
case $builder in
    docker)
        if docker buildx version >/dev/null 2>&1; then
            exec docker buildx build --load -t "$tag" "$@" .
        fi
        export DOCKER_BUILDKIT=1
        exec docker build -t "$tag" "$@" .
        ;;
    buildah) exec buildah build -t "$tag" "$@" . ;;
    *) exec "$builder" build -t "$tag" "$@" . ;;
esac
