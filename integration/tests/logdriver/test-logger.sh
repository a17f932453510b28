#!/bin/bash
# A logging binary for the binary:// stdio tests (the contract is containerd's; see
# shim/src/logdriver.rs): the process's stdout arrives on fd 3, its stderr on fd 4, and
# closing fd 5 tells the shim the logger is ready.
#
# Arguments are the URI's query as `key value` pairs, in any order:
#   dir DIR            where to write (required)
#   ready_delay SECS   wait this long before saying ready
#   never_ready 1      never say ready (keep fd 5 open)
# It writes into DIR:
#   pid                its pid, first thing
#   args, env          its arguments (one a line) and its environment (`env`)
#   ready              just before it closes fd 5
#   stdout, stderr     what it read from fds 3 and 4
#   sigterm            if it got SIGTERM
#   exited             once both reached EOF, just before it exits
set -euo pipefail

declare -A opt=()
args=("$@")
while (($# >= 2)); do
  opt[$1]=$2
  shift 2
done
dir=${opt[dir]:?no dir argument}

echo $$ >"$dir/pid"
printf '%s\n' "${args[@]}" >"$dir/args"
/usr/bin/env >"$dir/env"

if [[ ${opt[never_ready]:-} == 1 ]]; then
  exec /bin/sleep 1000 3<&- 4<&-
fi
[[ -z ${opt[ready_delay]:-} ]] || /bin/sleep "${opt[ready_delay]}"

# The copies must not inherit fd 5, or the shim would wait for them too.
/bin/cat <&3 >"$dir/stdout" 4<&- 5>&- &
/bin/cat <&4 >"$dir/stderr" 3<&- 5>&- &
exec 3<&- 4<&-
: >"$dir/ready"
exec 5>&-
# containerd's runc shim sends SIGTERM right after it closes the pipes; like a logger that
# flushes on SIGTERM, this one still copies to EOF. (`wait` returns early on a trapped signal.)
trap ': >"$dir/sigterm"' TERM
until wait; do :; done
: >"$dir/exited"
