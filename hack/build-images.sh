#!/usr/bin/env bash
# Builds crab's test images without any registry and imports them into the
# private containerd (hack/containerd.sh).
#
#   hack/build-images.sh [busybox|agent|pause|all]         build the image tars (default all)
#   hack/build-images.sh import NAMESPACE [busybox|agent|pause|all]
#                                                          build if needed, then import into
#                                                          NAMESPACE of the private containerd
#                                                          (skipped when already imported)
#
# Images:
#   localhost/crab/busybox:latest  busybox-static with its applets, root/nobody, Cmd sh
#   localhost/crab/agent:latest    Debian trixie (mmdebstrap): bash coreutils python3
#                                  python3-pip git procps ca-certificates; WorkingDir /app, Cmd bash
#   localhost/crab/pause:3.10      the CRI pod sandbox image: hack/pause.c, built static with
#                                  cc; what the CRI plugin's pinned sandbox image names
#                                  (hack/containerd.sh), so pods need no registry
#
# Each image is an OCI layout tar built with umoci, cached as
# $CRAB_HOME/images/<image>-<key>.tar where <key> hashes this script, lib.sh
# and the image's inputs (the busybox binary, pause.c): a rerun takes seconds, a change rebuilds.
#
# Environment:
#   CRAB_HOME            state directory (default <repo>/.crab)
#   CRAB_DEBIAN_MIRROR   mirror for the agent image (default: the host's apt mirror)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CRAB_LOG_PREFIX=build-images

IMAGE_PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
AGENT_SUITE=trixie
AGENT_PACKAGES=bash,coreutils,python3,python3-pip,git,procps,ca-certificates

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
}

image_ref() {
  case $1 in
    busybox) echo "$CRAB_BUSYBOX_IMAGE" ;;
    agent) echo "$CRAB_AGENT_IMAGE" ;;
    pause) echo "$CRAB_PAUSE_IMAGE" ;;
  esac
}

cache_key() {
  {
    echo "$1"
    cat "${BASH_SOURCE[0]}" "$CRAB_REPO/hack/lib.sh"
    [[ $1 != busybox ]] || sha256sum </bin/busybox
    [[ $1 != pause ]] || cat "$CRAB_REPO/hack/pause.c"
  } | sha256sum | cut -c1-16
}

cached_tar() { echo "$CRAB_IMAGES_DIR/$1-$(cache_key "$1").tar"; }

# rootfs: a directory to fill; populated with busybox and the minimum a shell
# and user lookups need.
populate_busybox_rootfs() {
  local r=$1
  chmod 0755 "$r"
  mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,etc,root,proc,sys,dev,run,var}
  chmod 0700 "$r/root"
  install -d -m 1777 "$r/tmp" "$r/var/tmp"
  install -m 0755 /bin/busybox "$r/bin/busybox"
  chroot "$r" /bin/busybox --install -s
  cat >"$r/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
  cat >"$r/etc/group" <<'EOF'
root:x:0:
nobody:x:65534:
EOF
}

# Turns an OCI layout whose "latest" tag holds the image into the archive
# that `ctr images import` names REF without needing --base-name.
write_archive() {
  local layout=$1 ref=$2 out=$3
  umoci gc --layout "$layout"
  jq --arg ref "$ref" '
    .manifests |= map(.annotations = {
      "io.containerd.image.name": $ref,
      "org.opencontainers.image.ref.name": ($ref | sub("^.*:"; ""))
    })' "$layout/index.json" >"$layout/index.json.new"
  mv "$layout/index.json.new" "$layout/index.json"
  [[ $(jq '.manifests | length' "$layout/index.json") == 1 ]] ||
    die "expected one manifest in $layout/index.json"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
    -C "$layout" -cf "$out" oci-layout index.json blobs
  jq -r '.manifests[0].digest' "$layout/index.json" >"${out%.tar}.digest"
}

build_busybox() {
  local work=$1 out=$2
  local layout=$work/layout bundle=$work/bundle
  umoci init --layout "$layout"
  umoci new --image "$layout:latest"
  umoci unpack --image "$layout:latest" "$bundle" >/dev/null
  populate_busybox_rootfs "$bundle/rootfs"
  umoci repack --image "$layout:latest" "$bundle"
  umoci config --image "$layout:latest" --config.env "$IMAGE_PATH_ENV" \
    --config.cmd sh --config.workingdir /
  write_archive "$layout" "$CRAB_BUSYBOX_IMAGE" "$out"
}

build_pause() {
  local work=$1 out=$2
  local layout=$work/layout bundle=$work/bundle
  command -v cc >/dev/null || die "pause: no C compiler (cc); run 'make deps'"
  umoci init --layout "$layout"
  umoci new --image "$layout:latest"
  umoci unpack --image "$layout:latest" "$bundle" >/dev/null
  chmod 0755 "$bundle/rootfs"
  cc -static -Os -Wall -Wextra -Werror -o "$bundle/rootfs/pause" "$CRAB_REPO/hack/pause.c" ||
    die "pause: cannot build hack/pause.c statically (needs libc6-dev)"
  strip "$bundle/rootfs/pause"
  umoci repack --image "$layout:latest" "$bundle"
  # Kubernetes' pause runs as 65535; so does this one.
  umoci config --image "$layout:latest" --config.entrypoint /pause --config.user 65535:65535 \
    --config.workingdir /
  write_archive "$layout" "$CRAB_PAUSE_IMAGE" "$out"
}

build_agent() {
  local work=$1 out=$2 mirror
  local layout=$work/layout
  mirror=$(crab_debian_mirror)
  log "agent: mmdebstrap $AGENT_SUITE from $mirror (about a minute)"
  mmdebstrap --quiet --variant=apt --format=tar --include="$AGENT_PACKAGES" \
    --customize-hook='mkdir -p "$1/app"' \
    "$AGENT_SUITE" "$work/rootfs.tar" "deb $mirror $AGENT_SUITE main"
  umoci init --layout "$layout"
  umoci new --image "$layout:latest"
  umoci raw add-layer --image "$layout:latest" "$work/rootfs.tar"
  rm -f "$work/rootfs.tar"
  umoci config --image "$layout:latest" --config.env "$IMAGE_PATH_ENV" \
    --config.cmd bash --config.workingdir /app
  write_archive "$layout" "$CRAB_AGENT_IMAGE" "$out"
}

# Prints the tar's path; builds it unless the cache already has it.
ensure_built() {
  local name=$1 out work start
  out=$(cached_tar "$name")
  if [[ -f $out && -f ${out%.tar}.digest ]]; then
    log "$name: cached $out"
    echo "$out"
    return
  fi
  mkdir -p "$CRAB_IMAGES_DIR"
  work=$(mktemp -d "$CRAB_IMAGES_DIR/.build-$name.XXXXXX")
  # shellcheck disable=SC2064 # expand now: the trap must remove this build's dir
  trap "rm -rf '$work'" EXIT
  start=$SECONDS
  log "$name: building"
  "build_$name" "$work" "$work/image.tar" >&2
  # Publish tar and digest only when both are complete.
  mv "$work/image.digest" "${out%.tar}.digest.tmp"
  mv "$work/image.tar" "$out"
  mv "${out%.tar}.digest.tmp" "${out%.tar}.digest"
  rm -rf "$work"
  trap - EXIT
  # Older builds of the same image are dead weight once this one exists.
  find "$CRAB_IMAGES_DIR" -maxdepth 1 -name "$name-*" ! -name "$(basename "${out%.tar}").*" -delete
  log "$name: built $out ($(du -h "$out" | cut -f1), $((SECONDS - start))s)"
  echo "$out"
}

import_image() {
  local ns=$1 name=$2 tar ref want have
  tar=$(ensure_built "$name")
  ref=$(image_ref "$name")
  want=$(<"${tar%.tar}.digest")
  have=$(crab_ctr -n "$ns" images ls "name==$ref" 2>/dev/null | awk 'NR > 1 {print $3}')
  if [[ $have == "$want" ]]; then
    log "$name: $ref already in namespace $ns"
    return
  fi
  log "$name: importing $ref into namespace $ns"
  crab_ctr -n "$ns" images import "$tar" >/dev/null
  have=$(crab_ctr -n "$ns" images ls "name==$ref" | awk 'NR > 1 {print $3}')
  [[ $have == "$want" ]] ||
    die "import of $tar did not produce $ref@$want in namespace $ns (got '${have:-nothing}')"
}

selected() {
  case ${1:-all} in
    all) echo busybox agent pause ;;
    busybox | agent | pause) echo "$1" ;;
    *) usage ;;
  esac
}

[[ $EUID -eq 0 ]] || die "must run as root (chroot, mmdebstrap)"
case ${1:-all} in
  -h | --help) usage ;;
  import)
    [[ -n ${2:-} ]] || usage
    crab_containerd_answers || die "private containerd is not running; run 'hack/containerd.sh start'"
    for name in $(selected "${3:-all}"); do import_image "$2" "$name"; done
    ;;
  *)
    for name in $(selected "${1:-all}"); do ensure_built "$name" >/dev/null; done
    ;;
esac
