#!/usr/bin/env bash
# make install: puts crab on a node without the development set-up.
#
#   PREFIX   where the binaries go, under bin/ (default /usr/local)
#   CONFDIR  where crab's config goes (default /etc/crab: the shim and crabctl read
#            CONFDIR/config.toml only when CONFDIR is /etc/crab, else name it in
#            $CRAB_CONFIG or the runtime options)
#   DESTDIR  a staging root prepended to both (packaging, tests); default none
#
# Installs containerd-shim-crab-v1 and crabctl (built by `make build`) into PREFIX/bin and
# the annotated default config (runtime-config/examples/crab.toml, which changes nothing)
# as CONFDIR/config.toml unless one is there (an existing config is never touched: the
# example goes next to it as config.toml.example). Then prints what to add to containerd's
# and Docker's configs. Changes nothing else: no service is restarted, no config of
# containerd or Docker is edited.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${PREFIX:-/usr/local}
CONFDIR=${CONFDIR:-/etc/crab}
DESTDIR=${DESTDIR:-}
TARGET=${CARGO_TARGET_DIR:-$PWD/target}/release
SHIM=containerd-shim-crab-v1

die() {
	echo "install.sh: $*" >&2
	exit 1
}

[[ $PREFIX == /* ]] || die "PREFIX must be an absolute path, not '$PREFIX'"
[[ $CONFDIR == /* ]] || die "CONFDIR must be an absolute path, not '$CONFDIR'"
for b in "$SHIM" crabctl; do
	[[ -x $TARGET/$b ]] || die "$TARGET/$b is not built: run 'make build' first"
done

bin=$DESTDIR$PREFIX/bin
conf=$DESTDIR$CONFDIR
install -d -m 0755 "$bin" "$conf"
install -m 0755 "$TARGET/$SHIM" "$TARGET/crabctl" "$bin/"
echo "installed $bin/$SHIM and $bin/crabctl"
if [[ -e $conf/config.toml || -L $conf/config.toml ]]; then
	install -m 0644 runtime-config/examples/crab.toml "$conf/config.toml.example"
	echo "kept $conf/config.toml; the annotated defaults are in $conf/config.toml.example"
else
	install -m 0644 runtime-config/examples/crab.toml "$conf/config.toml"
	echo "installed $conf/config.toml (the defaults, annotated: it changes nothing as shipped)"
fi

config_note=""
[[ $CONFDIR == /etc/crab ]] ||
	config_note="  (crab reads /etc/crab/config.toml by default: set CRAB_CONFIG=$CONFDIR/config.toml
   in the environment containerd starts shims with, or name the file in the runtime options)"
cat <<EOF

Next steps (nothing below was changed for you):

1. containerd finds the shim for runtime io.containerd.crab.v1 on its PATH: $PREFIX/bin must
   be on containerd's PATH (it is for /usr/local and /usr). Try it:
     ctr run --rm --runtime io.containerd.crab.v1 docker.io/library/busybox:latest t1 echo hi
$config_note
2. Kubernetes: add the handler to /etc/containerd/config.toml (containerd 2.x) and restart
   containerd (runtime-config/examples/containerd-config.toml has the 1.7 form):

   [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.crab]
     runtime_type = "io.containerd.runc.v2"
     runtime_path = "$PREFIX/bin/$SHIM"
     pod_annotations = ["io.crab/*"]
     container_annotations = ["io.crab/*"]

   then create the RuntimeClass (runtime-config/examples/runtimeclass.yaml, handler: crab).

3. Docker: 'docker run --runtime io.containerd.crab.v1 ...' works as is; to pass crab's
   config, add to /etc/docker/daemon.json and restart dockerd:

   { "runtimes": { "crab": { "runtimeType": "io.containerd.crab.v1",
                             "options": { "ConfigPath": "$CONFDIR/config.toml" } } } }

crab needs runc and CRIU 4.x on the node (Debian: apt-get install runc criu).
EOF
