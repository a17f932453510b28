#!/usr/bin/env bash
# Builds every image the Kubernetes CRI conformance suite (critest v1.30.0) uses,
# from Debian packages and hack/nonewprivs.c, with no registry, and pushes them
# under their upstream names to a registry (hack/critest.sh runs one on 127.0.0.1).
#
#   hack/critest-images.sh build          build the images (cached); print the OCI layout's path
#   hack/critest-images.sh refs           print "<layout tag> <upstream reference>" per image
#   hack/critest-images.sh push HOST:PORT build if needed, then push every image to the
#                                         plain-http registry at HOST:PORT, as
#                                         HOST:PORT/<upstream reference without its host>
#
# What critest needs of each image (read from cri-tools v1.30.0, pkg/validate and images/):
#   e2e-test-images/busybox:1.29-2     Debian's busybox, dynamically linked like upstream's
#                                      (no standalone shell: `sh -c ls` runs /bin/ls, which the
#                                      masked-paths test masks), its applets as hard links in
#                                      /bin, plus pgrep (procps) and ipcs (util-linux), which
#                                      Debian builds busybox without; upstream busybox's users
#                                      and groups (nobody, www-data)
#   e2e-test-images/nginx:1.14-2       Debian's nginx, master as PID 1 ("nginx: master
#                                      process"), /var/run/nginx.pid, serving on :80; busybox
#                                      applets for the tests' exec (sh, cat, grep, sleep)
#   e2e-test-images/httpd:2.4.39-4     Debian's Apache started as `httpd -D FOREGROUND`, which it
#                                      logs ("Command line: 'httpd -D FOREGROUND'") to stderr;
#                                      serving on :80
#   e2e-test-images/nonewprivs:1.3     hack/nonewprivs.c, setuid root, USER 1000
#   k8s-staging-cri-tools/hostnet-nginx-<arch>
#                                      the nginx image listening on 127.0.0.1:12003 only (it
#                                      runs in the host's network namespace)
#   k8s-staging-cri-tools/test-image-user-{uid,username,uid-group,username-group}
#                                      busybox with USER 1002, www-data, 1003:1004, www-data:1004
#   k8s-staging-cri-tools/test-image-predefined-group
#                                      busybox with default-user (1000) in group 50000, USER 1000
#   k8s-staging-cri-tools/test-image-{1,2,3,latest,digest}, test-image-tags:{1,2,3},
#   test-image-tag:{test,all}          busybox plus one marker file each, as upstream's
#                                      Dockerfile does (the three test-image-tags are one image)
# Upstream's test-image-digest is pulled by a manifest digest no local build can have:
# hack/critest.sh skips that one test.
#
# The images are one OCI layout (umoci; busybox and the web servers are shared base layers),
# cached as $CRAB_HOME/images/critest-<key>/ where <key> hashes this script, lib.sh and
# hack/nonewprivs.c: a rerun takes no time, a change rebuilds (about 40 s: three
# `mmdebstrap --variant=extract` runs of Debian $CRITEST_IMAGES_SUITE).
#
# Environment:
#   CRAB_HOME            state directory (default <repo>/.crab)
#   CRAB_DEBIAN_MIRROR   Debian mirror (default: the host's apt mirror)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CRAB_LOG_PREFIX=critest-images

CRITEST_IMAGES_SUITE=trixie
IMAGE_PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
K8S=registry.k8s.io/e2e-test-images
CRI_TOOLS=gcr.io/k8s-staging-cri-tools

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
}

arch() {
  local a
  a=$(dpkg --print-architecture 2>/dev/null) || a=$(uname -m)
  case $a in
    x86_64) echo amd64 ;;
    aarch64) echo arm64 ;;
    *) echo "$a" ;;
  esac
}

# "<layout tag> <upstream reference>", one image per line.
refs() {
  cat <<EOF
busybox $K8S/busybox:1.29-2
nginx $K8S/nginx:1.14-2
httpd $K8S/httpd:2.4.39-4
nonewprivs $K8S/nonewprivs:1.3
hostnet-nginx $CRI_TOOLS/hostnet-nginx-$(arch):latest
test-image-user-uid $CRI_TOOLS/test-image-user-uid:latest
test-image-user-username $CRI_TOOLS/test-image-user-username:latest
test-image-user-uid-group $CRI_TOOLS/test-image-user-uid-group:latest
test-image-user-username-group $CRI_TOOLS/test-image-user-username-group:latest
test-image-predefined-group $CRI_TOOLS/test-image-predefined-group:latest
test-image-1 $CRI_TOOLS/test-image-1:latest
test-image-2 $CRI_TOOLS/test-image-2:latest
test-image-3 $CRI_TOOLS/test-image-3:latest
test-image-latest $CRI_TOOLS/test-image-latest:latest
test-image-digest $CRI_TOOLS/test-image-digest:latest
test-image-tags $CRI_TOOLS/test-image-tags:1
test-image-tags $CRI_TOOLS/test-image-tags:2
test-image-tags $CRI_TOOLS/test-image-tags:3
test-image-tag-test $CRI_TOOLS/test-image-tag:test
test-image-tag-all $CRI_TOOLS/test-image-tag:all
EOF
}

cache_key() {
  {
    cat "${BASH_SOURCE[0]}" "$CRAB_REPO/hack/lib.sh" "$CRAB_REPO/hack/nonewprivs.c"
    arch
  } | sha256sum | cut -c1-16
}

cached_layout() { echo "$CRAB_IMAGES_DIR/critest-$(cache_key)"; }

# debian_tar OUT PKG[,PKG...]: the packages and their dependencies, unpacked (no
# maintainer scripts run), as one tar.
debian_tar() {
  local out=$1 pkgs=$2 mirror
  mirror=$(crab_debian_mirror)
  log "mmdebstrap --variant=extract $pkgs ($CRITEST_IMAGES_SUITE from $mirror)"
  mmdebstrap --quiet --variant=extract --include="$pkgs" \
    "$CRITEST_IMAGES_SUITE" "$out" "deb $mirror $CRITEST_IMAGES_SUITE main" ||
    die "mmdebstrap could not fetch $pkgs from $mirror; set CRAB_DEBIAN_MIRROR to a reachable Debian mirror"
}

# usrmerge_links ROOT DIR...: ROOT/DIR -> usr/DIR, what base-files makes in a full
# Debian install (merged /usr); the dynamic loader is found through /lib64.
usrmerge_links() {
  local r=$1 d
  shift
  for d in "$@"; do
    mkdir -p "$r/usr/$d"
    ln -sfn "usr/$d" "$r/$d"
  done
}

# Upstream busybox's users and groups (www-data and nobody are asked for by name).
write_users() {
  local r=$1
  mkdir -p "$r/etc"
  cat >"$r/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
bin:x:2:2:bin:/bin:/bin/false
sys:x:3:3:sys:/dev:/bin/false
sync:x:4:100:sync:/bin:/bin/sync
mail:x:8:8:mail:/var/spool/mail:/bin/false
www-data:x:33:33:www-data:/var/www:/bin/false
operator:x:37:37:Operator:/var:/bin/false
nobody:x:65534:65534:nobody:/home:/bin/false
EOF
  cat >"$r/etc/group" <<'EOF'
root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
mail:x:8:
wheel:x:10:root
www-data:x:33:
operator:x:37:
users:x:100:
nogroup:x:65534:
EOF
}

common_dirs() {
  local r=$1
  chmod 0755 "$r"
  mkdir -p "$r"/{etc,home,proc,sys,dev,run,var}
  install -d -m 0700 "$r/root"
  install -d -m 1777 "$r/tmp" "$r/var/tmp"
  ln -sfn ../run "$r/var/run"
  rm -rf "$r/usr/share/doc" "$r/usr/share/man" "$r/usr/share/info" "$r/usr/share/locale"
}

# The busybox image: busybox and its applets in /bin as hard links (like upstream's
# image), pgrep in /usr/bin with its libraries, ipcs in /usr/bin.
populate_busybox() {
  local r=$1 work=$2 keep
  tar -xpf "$work/busybox.tar" -C "$r" --numeric-owner
  common_dirs "$r"
  usrmerge_links "$r" lib lib64
  mkdir -p "$r/bin" "$r/sbin"
  mv "$r/usr/bin/busybox" "$r/bin/busybox"
  # procps came for pgrep only: its top (first in PATH) would shadow busybox's, which the
  # tests run without a terminal.
  for keep in "$r"/usr/bin/* "$r"/usr/sbin/*; do
    [[ $keep == "$r/usr/bin/pgrep" ]] || rm -f "$keep"
  done
  tar -xpf "$work/util-linux.tar" -C "$r" --numeric-owner ./usr/bin/ipcs
  chroot "$r" /bin/busybox --install /bin
  write_users "$r"
  [[ -x $r/usr/bin/pgrep && -x $r/usr/bin/ipcs && -f $r/bin/ls && ! -L $r/bin/ls ]] ||
    die "busybox image: pgrep, ipcs or /bin/ls missing"
  chroot "$r" /usr/bin/ipcs -m >/dev/null || die "busybox image: ipcs does not run"
  chroot "$r" /bin/sh -c 'id -u www-data && pgrep --version' >/dev/null ||
    die "busybox image: sh, id or pgrep does not run"
}

# Debian's nginx and Apache (apache2-bin: the server without Debian's scripts) with
# busybox's applets in /usr/local/bin for the tests' exec commands.
populate_web() {
  local r=$1 work=$2
  tar -xpf "$work/web.tar" -C "$r" --numeric-owner
  common_dirs "$r"
  usrmerge_links "$r" bin sbin lib lib64
  mkdir -p "$r/usr/local/bin" "$r/usr/local/sbin"
  chroot "$r" /usr/bin/busybox --install /usr/local/bin
  # busybox's own httpd must not shadow Apache's (below).
  rm -f "$r/usr/local/bin/httpd"
  ln -sfn /usr/sbin/apache2 "$r/usr/local/sbin/httpd"
  install -d -m 0755 "$r/var/lib/nginx" "$r/var/log/nginx" "$r/run/apache2" \
    "$r/usr/share/nginx/html" "$r/var/www/html"
  rm -rf "$r/etc/nginx"/* "$r/etc/apache2"
  mkdir -p "$r/etc/apache2"
  cat >"$r/usr/share/nginx/html/index.html" <<'EOF'
<!DOCTYPE html>
<html><head><title>Welcome to nginx!</title></head>
<body><h1>Welcome to nginx!</h1></body></html>
EOF
  cat >"$r/var/www/html/index.html" <<'EOF'
<html><body><h1>It works!</h1></body></html>
EOF
  cat >"$r/etc/apache2/apache2.conf" <<'EOF'
# critest's httpd image (hack/critest-images.sh): Debian's Apache, logging to stderr.
ServerRoot /etc/apache2
ServerName localhost
DefaultRuntimeDir /run/apache2
PidFile /run/apache2/httpd.pid
Listen 80
LoadModule mpm_event_module /usr/lib/apache2/modules/mod_mpm_event.so
LoadModule authz_core_module /usr/lib/apache2/modules/mod_authz_core.so
LoadModule dir_module /usr/lib/apache2/modules/mod_dir.so
User www-data
Group www-data
ErrorLog /proc/self/fd/2
LogLevel warn
DocumentRoot /var/www/html
DirectoryIndex index.html
<Directory /var/www/html>
    Require all granted
</Directory>
EOF
  for bin in nginx apache2; do
    chroot "$r" "/usr/sbin/$bin" -v >/dev/null 2>&1 || die "web image: $bin does not run"
  done
  write_users "$r"
}

# nginx.conf for a listen address (the nginx images differ in it only).
nginx_conf() {
  cat <<EOF
# critest's nginx images (hack/critest-images.sh): Debian's nginx, logging to stdout/stderr.
user www-data;
worker_processes 1;
pid /var/run/nginx.pid;
error_log /dev/stderr;
events { worker_connections 64; }
http {
    access_log /dev/stdout;
    server {
        listen $1;
        location / {
            root /usr/share/nginx/html;
            index index.html;
        }
    }
}
EOF
}

# layer_of OUT DIR: an uncompressed layer tar of DIR's contents, owned by root.
layer_of() {
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$2" -cf "$1" .
}

# add_layer LAYOUT BASE TAG WORK SETUP-FN: TAG is BASE plus one layer made by SETUP-FN DIR.
add_layer() {
  local layout=$1 base=$2 tag=$3 work=$4 setup=$5
  local dir=$work/layer-$tag
  rm -rf "$dir"
  mkdir -p "$dir"
  "$setup" "$dir"
  layer_of "$dir.tar" "$dir"
  umoci raw add-layer --image "$layout:$base" --tag "$tag" "$dir.tar"
  rm -rf "$dir" "$dir.tar"
}

marker_layer() { : >"$1/$MARKER"; }
predefined_group_layer() {
  mkdir -p "$1/etc" "$1/home/default-user"
  chown 1000:1000 "$1/home/default-user"
  cp "$BUSYBOX_ROOTFS/etc/passwd" "$BUSYBOX_ROOTFS/etc/group" "$1/etc/"
  # What upstream's `adduser -u 1000 -D default-user && addgroup -g 50000
  # group-defined-in-image && addgroup default-user group-defined-in-image` leaves.
  echo 'default-user:x:1000:1000:Linux User,,,:/home/default-user:/bin/sh' >>"$1/etc/passwd"
  printf '%s\n' 'default-user:x:1000:' 'group-defined-in-image:x:50000:default-user' >>"$1/etc/group"
}
nonewprivs_layer() {
  mkdir -p "$1/usr/local/bin"
  cc -static -Os -Wall -Wextra -Werror -o "$1/usr/local/bin/nnp" "$CRAB_REPO/hack/nonewprivs.c" ||
    die "nonewprivs: cannot build hack/nonewprivs.c statically (needs libc6-dev)"
  strip "$1/usr/local/bin/nnp"
  chmod 4755 "$1/usr/local/bin/nnp"
}
nginx_layer() {
  mkdir -p "$1/etc/nginx"
  nginx_conf "$NGINX_LISTEN" >"$1/etc/nginx/nginx.conf"
}

build_layout() {
  local work=$1 layout=$1/layout tag
  command -v cc >/dev/null || die "no C compiler (cc); run 'make deps'"
  debian_tar "$work/busybox.tar" busybox,procps
  debian_tar "$work/util-linux.tar" util-linux
  debian_tar "$work/web.tar" busybox,nginx,apache2-bin

  umoci init --layout "$layout"
  umoci new --image "$layout:busybox"
  umoci unpack --image "$layout:busybox" "$work/busybox" >/dev/null
  populate_busybox "$work/busybox/rootfs" "$work"
  umoci repack --image "$layout:busybox" "$work/busybox"
  umoci config --image "$layout:busybox" --config.env "$IMAGE_PATH_ENV" --config.cmd sh \
    --config.workingdir /
  BUSYBOX_ROOTFS=$work/busybox/rootfs

  umoci new --image "$layout:web"
  umoci unpack --image "$layout:web" "$work/web" >/dev/null
  populate_web "$work/web/rootfs" "$work"
  umoci repack --image "$layout:web" "$work/web"
  umoci config --image "$layout:web" --config.env "$IMAGE_PATH_ENV" --config.workingdir /
  rm -rf "$work/web" "$work/web.tar" "$work/util-linux.tar" "$work/busybox.tar"

  NGINX_LISTEN=80 add_layer "$layout" web nginx "$work" nginx_layer
  NGINX_LISTEN=127.0.0.1:12003 add_layer "$layout" web hostnet-nginx "$work" nginx_layer
  umoci config --image "$layout:nginx" --config.cmd nginx --config.cmd -g \
    --config.cmd 'daemon off;' --config.exposedports 80/tcp
  umoci config --image "$layout:hostnet-nginx" --config.cmd nginx --config.cmd -g \
    --config.cmd 'daemon off;' --config.exposedports 12003/tcp
  umoci config --image "$layout:web" --tag httpd --config.cmd httpd --config.cmd -D \
    --config.cmd FOREGROUND --config.exposedports 80/tcp
  umoci rm --image "$layout:web"

  add_layer "$layout" busybox nonewprivs "$work" nonewprivs_layer
  umoci config --image "$layout:nonewprivs" --config.user 1000 \
    --config.entrypoint /usr/local/bin/nnp --clear config.cmd

  add_layer "$layout" busybox test-image-predefined-group "$work" predefined_group_layer
  umoci config --image "$layout:test-image-predefined-group" --config.user 1000

  local user
  for user in uid:1002 username:www-data uid-group:1003:1004 username-group:www-data:1004; do
    umoci config --image "$layout:busybox" --tag "test-image-user-${user%%:*}" \
      --config.user "${user#*:}"
  done

  for tag in test-image-1 test-image-2 test-image-3 test-image-latest test-image-digest; do
    MARKER=$tag add_layer "$layout" busybox "$tag" "$work" marker_layer
  done
  MARKER=same-image add_layer "$layout" busybox test-image-tags "$work" marker_layer
  MARKER=test add_layer "$layout" busybox test-image-tag-test "$work" marker_layer
  MARKER=all add_layer "$layout" busybox test-image-tag-all "$work" marker_layer
  umoci gc --layout "$layout"

  local missing
  missing=$(refs | while read -r tag _; do
    umoci stat --image "$layout:$tag" >/dev/null 2>&1 || echo "$tag"
  done)
  [[ -z $missing ]] || die "layout lacks: $missing"
}

# Prints the layout's path; builds it unless the cache already has it.
ensure_built() {
  local out work start
  out=$(cached_layout)
  if [[ -f $out/index.json ]]; then
    log "cached $out"
    echo "$out"
    return
  fi
  mkdir -p "$CRAB_IMAGES_DIR"
  work=$(mktemp -d "$CRAB_IMAGES_DIR/.build-critest.XXXXXX")
  # shellcheck disable=SC2064 # expand now: the trap must remove this build's dir
  trap "rm -rf '$work'" EXIT
  start=$SECONDS
  log "building critest's images"
  build_layout "$work" >&2
  rm -rf "$out"
  mv "$work/layout" "$out"
  rm -rf "$work"
  trap - EXIT
  find "$CRAB_IMAGES_DIR" -maxdepth 1 -name 'critest-*' ! -name "$(basename "$out")" \
    -exec rm -rf {} +
  log "built $out ($(du -sh "$out" | cut -f1), $((SECONDS - start))s)"
  echo "$out"
}

push() {
  local addr=$1 layout tag ref n=0
  [[ $addr =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]] || die "push: expected HOST:PORT, got '$addr'"
  layout=$(ensure_built)
  while read -r tag ref; do
    skopeo copy --quiet --dest-tls-verify=false "oci:$layout:$tag" "docker://$addr/${ref#*/}" >&2 ||
      die "push of $ref to $addr failed"
    n=$((n + 1))
  done < <(refs)
  log "pushed $n images to $addr"
}

[[ $EUID -eq 0 ]] || die "must run as root (chroot, image ownership)"
case ${1:-} in
  build) ensure_built ;;
  refs) refs ;;
  push)
    [[ -n ${2:-} ]] || usage
    push "$2"
    ;;
  *) usage ;;
esac
