#!/usr/bin/env bash
# crab's node installer: puts crab on a Kubernetes node whose root filesystem is mounted at
# HOST_ROOT (the DaemonSet in crab-installer.yaml mounts it at /host), or on this machine with
# HOST_ROOT=/.
#
#   install-node.sh [SOURCE_DIR]               install (or bring up to date)
#   install-node.sh --uninstall                remove what an install added
#
# Install:
#   1. copies containerd-shim-crab-v1 and crabctl from SOURCE_DIR into HOST_ROOT/usr/local/bin
#      (mode 0755; each written under a temporary name and renamed over the old one, so that
#      a shim starting meanwhile never runs a half-written binary);
#   2. writes HOST_ROOT/etc/crab/config.toml, crab's annotated defaults, only if there is none
#      (an existing config is never touched);
#   3. registers the CRI runtime handler `crab` (runtime_type io.containerd.crab.v1, pod and
#      container annotations io.crab/*) in containerd's config: appended as a marked section
#      (`# crab runtime (added by crab's node installer) ...` to `# end of crab runtime`) to a
#      config of version 2 or 3, in that version's spelling; without a config, a minimal
#      version 2 one is created (containerd 1.7 and 2.x read it). The original is kept once as
#      config.toml.crab-backup. A config that already has a `crab` runtime (ours or anyone's)
#      is left as it is, so a second run changes nothing.
# Uninstall removes the binaries and the marked section (the rest of containerd's config is
# left byte for byte; a config the installer created is removed, and so is the backup once
# the config is back to its bytes). crab's config and checkpoints stay.
#
# Before writing anything the installer checks every directory it writes into below
# HOST_ROOT: a symbolic link there (which could lead out of the node's root) makes it refuse.
#
# Environment:
#   HOST_ROOT            the node's root filesystem (default /host; / for this machine)
#   CRAB_SOURCE_DIR      where containerd-shim-crab-v1 and crabctl are (the argument wins;
#                        default: this script's directory if they are there, else /opt/crab/bin)
#   CRAB_EXAMPLE_CONFIG  crab's annotated default config (default: ../share/crab.toml next to
#                        this script, as in the installer image, else a checkout's
#                        runtime-config/examples/crab.toml)
#   CONTAINERD_CONFIG    containerd's config, a path on the node (default
#                        /etc/containerd/config.toml)
#   RESTART_CONTAINERD   1: when containerd's config changed, restart containerd on the node:
#                        `nsenter -t 1 -m -u -i -n -p -- systemctl restart containerd` (needs
#                        hostPID and privilege; running containers keep running). Default 0:
#                        nothing is restarted, and the installer says that a restart is due.
set -euo pipefail
export LC_ALL=C

SHIM=containerd-shim-crab-v1
CTL=crabctl
INSTALL_DIR=/usr/local/bin
CRAB_CONFIG_DIR=/etc/crab
BEGIN_MARK="# crab runtime (added by crab's node installer; install-node.sh --uninstall removes it)"
END_MARK="# end of crab runtime"
CREATED_HEADER="# containerd config created by crab's node installer (the node had none): containerd's
# defaults and crab's runtime handler. install-node.sh --uninstall removes it again.
version = 2
"

say() { echo "install-node.sh: $*"; }
die() {
	echo "install-node.sh: $*" >&2
	exit 1
}

usage() {
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit "${1:-2}"
}

mode=install
source_arg=
while (($#)); do
	case $1 in
	--uninstall) mode=uninstall ;;
	-h | --help) usage 0 ;;
	-*) die "unknown option '$1' (see --help)" ;;
	*)
		[[ -z $source_arg ]] || die "one SOURCE_DIR only (see --help)"
		source_arg=$1
		;;
	esac
	shift
done

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

HOST_ROOT=${HOST_ROOT:-/host}
[[ $HOST_ROOT == /* ]] || die "HOST_ROOT must be an absolute path, not '$HOST_ROOT'"
[[ -d $HOST_ROOT ]] || die "HOST_ROOT=$HOST_ROOT is not a directory (is the node's root mounted?)"
host_root=$(cd "$HOST_ROOT" && pwd -P)
[[ $host_root != / ]] || host_root=

CONTAINERD_CONFIG=${CONTAINERD_CONFIG:-/etc/containerd/config.toml}
RESTART_CONTAINERD=${RESTART_CONTAINERD:-0}
[[ $RESTART_CONTAINERD == [01] ]] || die "RESTART_CONTAINERD must be 0 or 1, not '$RESTART_CONTAINERD'"

# A path on the node, checked: absolute, no empty, . or .. components.
check_node_path() {
	local p=$1 c comps
	[[ $p == /* && $p != */ ]] || die "$p: a path on the node must be absolute (and not end in /)"
	IFS=/ read -ra comps <<<"${p#/}"
	for c in "${comps[@]}"; do
		[[ -n $c && $c != . && $c != .. ]] || die "$p: no empty, . or .. components, please"
	done
}

# Checks that a directory on the node ($1), and each directory above it up to HOST_ROOT, is a
# real directory or missing, never a symbolic link: what the installer writes there stays below
# HOST_ROOT.
check_dir() {
	local dir=$1 p=$host_root c comps
	check_node_path "$dir"
	IFS=/ read -ra comps <<<"${dir#/}"
	for c in "${comps[@]}"; do
		p=$p/$c
		if [[ -L $p ]]; then
			die "refusing to write into $p: it is a symbolic link (to $(readlink "$p")), and the installer writes only into real directories below HOST_ROOT=$HOST_ROOT"
		fi
		[[ ! -e $p || -d $p ]] || die "$p is in the way: not a directory"
	done
}

# A file's bytes, exactly (TOML holds no NUL bytes; one would be cut off, so it is refused).
read_exact() {
	local -n _out=$2
	_out=
	IFS= read -r -d '' _out <"$1" || true
	[[ ${#_out} -eq $(stat -c %s "$1") ]] || die "$1: cannot read it exactly (a NUL byte?)"
}

# Writes $2 to the file $1 under a temporary name in its directory, then renames it over $1.
# $3: mode, or a file whose mode and owner to copy.
write_atomic() {
	local dst=$1 content=$2 like=$3 tmp
	tmp=$(mktemp "$(dirname "$dst")/.$(basename "$dst").crab.XXXXXX")
	tmp_files+=("$tmp")
	printf '%s' "$content" >"$tmp"
	if [[ -e $like ]]; then
		chmod --reference="$like" "$tmp"
		chown --reference="$like" "$tmp"
	else
		chmod "$like" "$tmp"
	fi
	mv -f -T "$tmp" "$dst"
}

# Copies the file $1 to $2 the same way (mode 0755).
copy_atomic() {
	local src=$1 dst=$2 tmp
	tmp=$(mktemp "$(dirname "$dst")/.$(basename "$dst").crab.XXXXXX")
	tmp_files+=("$tmp")
	cat "$src" >"$tmp"
	chmod 0755 "$tmp"
	mv -f -T "$tmp" "$dst"
}

tmp_files=()
cleanup() {
	local f
	for f in "${tmp_files[@]}"; do rm -f -- "$f"; done
}
trap cleanup EXIT

# The `version = N` of a containerd config (top level, before any table), or nothing.
config_version() {
	awk '
		/^[[:space:]]*\[/ { exit }
		/^[[:space:]]*version[[:space:]]*=/ {
			v = $0
			sub(/^[^=]*=[[:space:]]*/, "", v)
			sub(/[[:space:]]*(#.*)?$/, "", v)
			print v
			exit
		}' "$1"
}

# Whether a containerd config has a runtime `crab` (any plugin's spelling, quoted or not).
has_crab_runtime() {
	sed -e 's/#.*//' -e "s/[[:space:]\"']//g" "$1" |
		grep -Eq '^\[plugins\..*\.containerd\.runtimes\.crab(\..*)?\]$'
}

# The section for config version $1, as appended (a newline first: the marker starts a line
# whether or not the config ended with one, and uninstalling removes exactly these bytes).
crab_section() {
	local plugin
	case $1 in
	2) plugin='"io.containerd.grpc.v1.cri"' ;;
	3) plugin='"io.containerd.cri.v1.runtime"' ;;
	esac
	printf '\n%s\n' "$BEGIN_MARK"
	printf '[plugins.%s.containerd.runtimes.crab]\n' "$plugin"
	printf '  runtime_type = "io.containerd.crab.v1"\n'
	printf '  # crab reads its annotations (io.crab/turn-boundary, io.crab/probe-commands, ...) only\n'
	printf '  # when containerd passes the pod'\''s and container'\''s on.\n'
	printf '  pod_annotations = ["io.crab/*"]\n'
	printf '  container_annotations = ["io.crab/*"]\n'
	printf '%s\n' "$END_MARK"
}

restart_containerd() {
	if [[ $RESTART_CONTAINERD == 1 ]]; then
		say "restarting containerd on the node (RESTART_CONTAINERD=1)"
		nsenter -t 1 -m -u -i -n -p -- systemctl restart containerd
		say "containerd restarted"
	else
		say "containerd was not restarted: restart it on the node (systemctl restart containerd) to $1, or run this with RESTART_CONTAINERD=1"
	fi
}

bin_dir=$host_root$INSTALL_DIR
conf_dir=$host_root$CRAB_CONFIG_DIR
check_node_path "$CONTAINERD_CONFIG"
ctrd_cfg=$host_root$CONTAINERD_CONFIG
ctrd_dir=$(dirname "$ctrd_cfg")
backup=$ctrd_cfg.crab-backup

# Checks before anything is written.
check_dir "$INSTALL_DIR"
check_dir "$(dirname "$CONTAINERD_CONFIG")"
[[ $mode == uninstall ]] || check_dir "$CRAB_CONFIG_DIR"
for f in "$ctrd_cfg" "$backup"; do
	[[ ! -L $f ]] || die "refusing $f: a symbolic link (to $(readlink "$f"))"
	[[ ! -e $f || -f $f ]] || die "$f is not a regular file"
done
for b in "$SHIM" "$CTL"; do
	[[ ! -d $bin_dir/$b || -L $bin_dir/$b ]] || die "$bin_dir/$b is a directory"
done

ctrd_version=
if [[ -e $ctrd_cfg ]]; then
	ctrd_version=$(config_version "$ctrd_cfg")
	if [[ $mode == install && $ctrd_version != [23] ]] && ! has_crab_runtime "$ctrd_cfg"; then
		die "$ctrd_cfg has config version '${ctrd_version:-none}': the installer adds crab's runtime to configs of version 2 (containerd 1.7) and 3 (containerd 2.x) only; add it by hand (deploy/README.md) or migrate the config (containerd config migrate)"
	fi
fi

uninstall() {
	local changed=0 content pre rest post b
	if [[ -e $ctrd_cfg ]]; then
		read_exact "$ctrd_cfg" content
		pre=${content%%$'\n'"$BEGIN_MARK"$'\n'*}
		if [[ $pre == "$content" ]]; then
			say "$ctrd_cfg has no section of the installer's: left as it is"
		else
			rest=${content:${#pre}+${#BEGIN_MARK}+2}
			post=${rest#*$'\n'"$END_MARK"}
			[[ $post != "$rest" ]] || die "$ctrd_cfg: the crab section has no end line '$END_MARK'; remove it by hand"
			post=${post#$'\n'}
			if [[ $pre$post == "$CREATED_HEADER" ]]; then
				rm -f -- "$ctrd_cfg"
				say "removed $ctrd_cfg (the installer had created it)"
			else
				write_atomic "$ctrd_cfg" "$pre$post" "$ctrd_cfg"
				say "removed the crab runtime from $ctrd_cfg"
			fi
			changed=1
		fi
	fi
	if [[ -f $backup ]]; then
		if [[ -f $ctrd_cfg ]] && cmp -s "$backup" "$ctrd_cfg"; then
			rm -f -- "$backup"
			say "removed $backup ($ctrd_cfg is back to its bytes)"
		else
			say "kept $backup: $ctrd_cfg differs from it (changed since the install)"
		fi
	fi
	((changed == 0)) || restart_containerd "drop the crab runtime"
	for b in "$SHIM" "$CTL"; do
		if [[ -e $bin_dir/$b || -L $bin_dir/$b ]]; then
			rm -f -- "${bin_dir:?}/$b"
			say "removed $bin_dir/$b"
		fi
	done
	say "left $conf_dir/config.toml and crab's checkpoints (/var/lib/crab by default) on the node"
}

install() {
	local src=${source_arg:-${CRAB_SOURCE_DIR:-}} example content b
	if [[ -z $src ]]; then
		src=/opt/crab/bin
		[[ ! -e $script_dir/$SHIM ]] || src=$script_dir
	fi
	for b in "$SHIM" "$CTL"; do
		[[ -f $src/$b && -x $src/$b ]] || die "$src/$b: no such executable (SOURCE_DIR, CRAB_SOURCE_DIR)"
	done
	example=${CRAB_EXAMPLE_CONFIG:-}
	if [[ -z $example ]]; then
		example=$script_dir/../share/crab.toml
		[[ -f $example ]] || example=$script_dir/../runtime-config/examples/crab.toml
	fi
	local want_config=1
	[[ ! -e $conf_dir/config.toml && ! -L $conf_dir/config.toml ]] || want_config=0
	((want_config == 0)) || [[ -f $example ]] || die "$example: crab's example config is missing (CRAB_EXAMPLE_CONFIG)"

	# 1. The binaries.
	mkdir -p "$bin_dir"
	for b in "$SHIM" "$CTL"; do
		copy_atomic "$src/$b" "$bin_dir/$b"
		say "installed $bin_dir/$b"
	done

	# 2. crab's config, unless there is one.
	if ((want_config)); then
		mkdir -p "$conf_dir"
		read_exact "$example" content
		write_atomic "$conf_dir/config.toml" "$content" 0644
		say "installed $conf_dir/config.toml (crab's defaults, annotated: as shipped it changes nothing)"
	else
		say "kept $conf_dir/config.toml"
	fi

	# 3. containerd's runtime handler.
	if [[ ! -e $ctrd_cfg ]]; then
		mkdir -p "$ctrd_dir"
		write_atomic "$ctrd_cfg" "$CREATED_HEADER$(crab_section 2)"$'\n' 0644
		say "created $ctrd_cfg (version 2) with the crab runtime"
		restart_containerd "load the crab runtime"
	elif has_crab_runtime "$ctrd_cfg"; then
		if grep -qxF "$BEGIN_MARK" "$ctrd_cfg"; then
			say "$ctrd_cfg already has the crab runtime: unchanged"
		else
			say "$ctrd_cfg already has a runtime 'crab' of its own: left as it is"
		fi
	else
		read_exact "$ctrd_cfg" content
		if grep -Eq '^[[:space:]]*disabled_plugins[[:space:]]*=.*["'\''](cri|io\.containerd\.grpc\.v1\.cri)["'\'']' "$ctrd_cfg"; then
			say "warning: $ctrd_cfg disables containerd's CRI plugin: Kubernetes cannot use any runtime of it, crab's included"
		fi
		if [[ ! -e $backup ]]; then
			write_atomic "$backup" "$content" "$ctrd_cfg"
			say "kept the original as $backup"
		fi
		write_atomic "$ctrd_cfg" "$content$(crab_section "$ctrd_version")"$'\n' "$ctrd_cfg"
		say "added the crab runtime to $ctrd_cfg (version $ctrd_version)"
		restart_containerd "load the crab runtime"
	fi
}

say "HOST_ROOT=$HOST_ROOT, containerd config $CONTAINERD_CONFIG"
"$mode"
say "done ($mode)"
