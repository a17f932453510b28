//! Whether a process dump may leave the container's network namespace out (CRIU's `empty_ns`
//! for the network): the namespace could not have changed since runc made it.
//!
//! A network namespace runc creates for a container holds `lo`, up, and nothing else. Its
//! configuration (links, addresses, routes, rules, iptables and nftables, its `net.*`
//! sysctls) changes only by someone holding `CAP_NET_ADMIN` over it, by an OCI hook (run by
//! the host, before or after the container starts), or by the spec's `net.*` sysctls (which
//! runc writes at create and a restore would not). When none of those can have happened, the
//! namespace is the one a fresh container gets, and dumping it is waste: CRIU runs `ip`
//! (addresses, routes, rules) and `iptables-save`/`ip6tables-save` (nft and legacy) with the
//! container frozen, ~25-45 ms of a small process dump. The image then holds no network
//! namespace; a restore creates a blank one, and crab's loopback hook brings `lo` up in it
//! before CRIU puts the sockets back, which is what `runc create` gave the original.
//!
//! Two sources decide, both required:
//! - [`Eligibility`]: what the container was given. Its spec (its own namespace, runc-made;
//!   no hook but crab's loopback hook; no `net.*` sysctl; `CAP_NET_ADMIN` not in the init's
//!   bounding set), and every exec since (an exec granted `CAP_NET_ADMIN` taints the
//!   container for good, as does a restore from an image that carried a network namespace).
//! - [`kernel_agrees`]: what the kernel holds at the dump, the container frozen. Every live
//!   process of the container in the init's network namespace (CRIU dumps one empty
//!   namespace only), none with `CAP_NET_ADMIN` in its bounding set, and the namespace's
//!   only interface `lo`.

use std::{
    io,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use oci_spec::runtime::{Capability, LinuxNamespaceType, Process, Spec};

/// `CAP_NET_ADMIN`'s bit in a capability mask.
const CAP_NET_ADMIN_BIT: u32 = 12;

/// What a container was given, as far as its network namespace goes (see the module doc).
/// Cheap to clone: the taint is shared between the container's execs and its capture.
#[derive(Debug, Clone, Default)]
pub struct Eligibility {
    /// The spec allows leaving the namespace out (`None`: not yet read).
    spec: Arc<std::sync::OnceLock<bool>>,
    /// Set for good once anything could have changed the namespace.
    tainted: Arc<AtomicBool>,
}

impl Eligibility {
    /// Records what the container's spec allows (its `createRuntime` hooks may hold crab's
    /// loopback hook, named by `own_hook_arg`). Only the first call counts.
    pub fn read_spec(&self, spec: &Spec, own_hook_arg: &str) {
        let _ = self.spec.set(spec_allows(spec, own_hook_arg));
    }

    /// An exec with `process` was added: a bounding set with `CAP_NET_ADMIN` taints.
    pub fn exec_added(&self, process: &Process) {
        if grants_net_admin(process) {
            self.taint("an exec granted CAP_NET_ADMIN");
        }
    }

    /// The namespace may hold more than a fresh one (a restore from an image that carried
    /// one, for example): from now on it is always dumped.
    pub fn taint(&self, why: &str) {
        if !self.tainted.swap(true, Ordering::SeqCst) {
            log::debug!("network namespace dumped from now on: {why}");
        }
    }

    /// Whether what the container was given allows leaving the namespace out.
    pub fn holds(&self) -> bool {
        self.spec.get().copied().unwrap_or(false) && !self.tainted.load(Ordering::SeqCst)
    }
}

/// The spec part of [`Eligibility`]: a network namespace runc creates (no path), no OCI hook
/// but crab's loopback hook, no `net.*` sysctl, no `CAP_NET_ADMIN` in the init's bounding set.
pub fn spec_allows(spec: &Spec, own_hook_arg: &str) -> bool {
    let Some(linux) = spec.linux() else {
        return false;
    };
    let own_netns = linux.namespaces().as_ref().is_some_and(|ns| {
        ns.iter()
            .any(|n| n.typ() == LinuxNamespaceType::Network && n.path().is_none())
    });
    let net_sysctl = linux.sysctl().as_ref().is_some_and(|s| {
        s.keys()
            .any(|k| k.starts_with("net.") || k.starts_with("net/"))
    });
    let init_admin = spec.process().as_ref().is_some_and(grants_net_admin);
    own_netns && !net_sysctl && !init_admin && only_own_hooks(spec, own_hook_arg)
}

/// No OCI hook, but crab's loopback hook in `createRuntime` (the shim binary with
/// `own_hook_arg` as its only argument).
fn only_own_hooks(spec: &Spec, own_hook_arg: &str) -> bool {
    let Some(hooks) = spec.hooks() else {
        return true;
    };
    #[allow(deprecated)]
    let others = [
        hooks.prestart(),
        hooks.create_container(),
        hooks.start_container(),
        hooks.poststart(),
        hooks.poststop(),
    ];
    let is_own = |h: &oci_spec::runtime::Hook| {
        let args = h.args().as_deref().unwrap_or_default();
        args.len() == 2
            && args[1] == own_hook_arg
            && h.path().file_name().and_then(|n| n.to_str()) == Some(crate::SHIM_BINARY)
    };
    others
        .iter()
        .all(|l| l.as_ref().is_none_or(|l| l.is_empty()))
        && hooks
            .create_runtime()
            .as_ref()
            .is_none_or(|l| l.iter().all(is_own))
}

/// Whether `process`'s bounding set holds `CAP_NET_ADMIN` (no capabilities: none).
fn grants_net_admin(process: &Process) -> bool {
    process
        .capabilities()
        .as_ref()
        .and_then(|c| c.bounding().as_ref())
        .is_some_and(|b| b.contains(&Capability::NetAdmin))
}

/// Whether the CRIU image in `dir` holds a network namespace (a `netns-<id>.img`), as a
/// dump that did not leave it out writes; an unreadable directory counts as holding one.
pub fn image_holds_one(dir: &Path) -> bool {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("netns-") && name.ends_with(".img")
        }),
        Err(_) => true,
    }
}

/// Why the kernel says the namespace must be dumped (see [`kernel_agrees`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Dissent {
    /// A process of the container lives in another network namespace.
    OtherNamespace(u32),
    /// A process of the container holds `CAP_NET_ADMIN` in its bounding set.
    NetAdmin(u32),
    /// The namespace has an interface besides `lo`.
    Interface(String),
}

impl std::fmt::Display for Dissent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dissent::OtherNamespace(p) => write!(f, "process {p} is in another network namespace"),
            Dissent::NetAdmin(p) => write!(f, "process {p} may hold CAP_NET_ADMIN"),
            Dissent::Interface(i) => write!(f, "the namespace has interface {i:?}"),
        }
    }
}

/// The kernel's side (see the module doc), for a frozen container whose init is `init` and
/// whose live processes are `pids`: `Ok(())` when the namespace may be left out. A process
/// that exited meanwhile is skipped; anything else unreadable is an error (the caller dumps
/// the namespace).
pub fn kernel_agrees(proc: &Path, init: u32, pids: &[u32]) -> io::Result<Result<(), Dissent>> {
    let ns_of = |pid: u32| std::fs::metadata(proc.join(format!("{pid}/ns/net")));
    let init_ns = std::os::unix::fs::MetadataExt::ino(&ns_of(init)?);
    for &pid in pids {
        let ns = match ns_of(pid) {
            Ok(m) => std::os::unix::fs::MetadataExt::ino(&m),
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if ns != init_ns {
            return Ok(Err(Dissent::OtherNamespace(pid)));
        }
        let status = match std::fs::read(proc.join(format!("{pid}/status"))) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        match bounding_has_net_admin(&status) {
            Some(false) => {}
            // Unreadable counts as held.
            _ => return Ok(Err(Dissent::NetAdmin(pid))),
        }
    }
    let dev = std::fs::read(proc.join(format!("{init}/net/dev")))?;
    match interfaces(&dev).into_iter().find(|i| i != "lo") {
        Some(other) => Ok(Err(Dissent::Interface(other))),
        None => Ok(Ok(())),
    }
}

/// Whether the `CapBnd:` line of a `/proc/PID/status` text has `CAP_NET_ADMIN`; `None` when
/// the line is missing or malformed.
pub fn bounding_has_net_admin(status: &[u8]) -> Option<bool> {
    let text = std::str::from_utf8(status).ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("CapBnd:"))?;
    let mask = u64::from_str_radix(line.trim(), 16).ok()?;
    Some(mask & (1 << CAP_NET_ADMIN_BIT) != 0)
}

/// The interface names of a `/proc/PID/net/dev` text (two header lines, then `name: counters`
/// per interface). A line without a colon counts as an interface named by the whole line, so
/// that anything unexpected makes the namespace look non-empty.
pub fn interfaces(dev: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(dev)
        .lines()
        .skip(2)
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split_once(':')
                .map_or(l, |(name, _)| name)
                .trim()
                .to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests;
