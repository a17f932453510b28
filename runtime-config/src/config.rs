use std::ffi::OsStr;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use log::LevelFilter;
use serde::de::{Error as _, Unexpected};
use serde::{Deserialize, Deserializer};

use crate::error::{ConfigError, Location};

/// Where the shim looks for its config when containerd passes none.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/crab/config.toml";

/// The environment variable naming crab's config file when the runtime options do not
/// ([`Config::load_or_default`]).
pub const CONFIG_ENV: &str = "CRAB_CONFIG";

/// crab's configuration: one TOML file, every key optional.
///
/// Values are validated while parsing, so a `Config` that came out of
/// [`Config::from_toml_str`] or [`Config::load`] is valid.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "a table of crab settings")]
pub struct Config {
    pub runc: RuncConfig,
    pub store: StoreConfig,
    pub log: LogConfig,
    pub checkpoint: CheckpointConfig,
    pub engine: EngineConfig,
    pub restore: RestoreConfig,
    pub limits: LimitsConfig,
    pub shim: ShimConfig,
    pub replication: ReplicationConfig,
}

/// Off-node replication: every durable checkpoint pushed, in the background, to an OCI
/// registry, tagged per lineage, so a container of the lineage created on another node (with
/// `io.crab/resume: newest`) comes back from it. Off unless `registry` is set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [replication] table")]
pub struct ReplicationConfig {
    /// `HOST[:PORT]/REPOSITORY` (e.g. `registry.example:5000/crab/checkpoints`). Default none:
    /// no replication.
    #[serde(deserialize_with = "some_registry")]
    pub registry: Option<String>,
    /// Speak plain HTTP to the registry (a registry on a private network). Default `false`.
    pub insecure: bool,
    /// A Docker-style credentials file (`config.json` / `auth.json` with `auths`); default none
    /// (anonymous).
    #[serde(deserialize_with = "some_absolute_path")]
    pub auth_file: Option<PathBuf>,
    /// The most bytes one replicated checkpoint may send (its layers and process image);
    /// a larger one is not replicated and the reason recorded. Default 4096 (MiB).
    #[serde(deserialize_with = "positive_u64")]
    pub max_mib: u64,
    /// The longest wait between two attempts of a push that failed, in milliseconds (the
    /// waits double from 250 ms up to this). Default 10000.
    #[serde(deserialize_with = "positive_u64")]
    pub retry_max_ms: u64,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            registry: None,
            insecure: false,
            auth_file: None,
            max_mib: 4096,
            retry_max_ms: 10_000,
        }
    }
}

/// `HOST[:PORT]/REPOSITORY`: a host, then a repository path of lowercase letters, digits and
/// `._-/` (the OCI distribution rule), no tag, no digest.
pub fn check_registry(v: &str) -> Result<(), String> {
    let Some((host, repo)) = v.split_once('/') else {
        return Err(format!(
            "{v:?} names no repository (HOST[:PORT]/REPOSITORY)"
        ));
    };
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
    if !host_ok {
        return Err(format!("{v:?}: {host:?} is no registry host"));
    }
    let repo_ok = !repo.is_empty()
        && repo.len() <= 255
        && repo.split('/').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        });
    if !repo_ok {
        return Err(format!(
            "{v:?}: {repo:?} is no repository (lowercase letters, digits, ._- and /, no tag)"
        ));
    }
    Ok(())
}

fn some_registry<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v = String::deserialize(d)?;
    check_registry(&v).map_err(serde::de::Error::custom)?;
    Ok(Some(v))
}

/// How containers share shim processes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [shim] table")]
pub struct ShimConfig {
    /// The values of the `io.containerd.crab.v1.group` annotation a container may carry (each
    /// 1 to 64 of `[A-Za-z0-9._-]`). Containers carrying the same value share one shim; any
    /// client that can set annotations can choose a value, so a value not listed here fails
    /// Create. Default none.
    #[serde(deserialize_with = "group_names")]
    pub groups: Vec<String>,
}

/// Whether `g` is a well-formed shim group name.
pub fn is_group_name(g: &str) -> bool {
    !g.is_empty()
        && g.len() <= 64
        && g.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn group_names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    if let Some(bad) = names.iter().find(|g| !is_group_name(g)) {
        return Err(serde::de::Error::custom(format!(
            "a group name must be 1 to 64 of [A-Za-z0-9._-], got {bad:?}"
        )));
    }
    Ok(names)
}

/// How crab runs runc.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [runc] table")]
pub struct RuncConfig {
    /// A command name looked up on `PATH` (see [`Config::resolve_runc_binary`])
    /// or an absolute path. Default `runc`.
    #[serde(deserialize_with = "command_or_absolute_path")]
    pub binary: PathBuf,
    /// runc's state directory (`runc --root`; the containerd namespace is appended). Default
    /// `/run/crab/runc`: apart from the stock runc shim's `/run/containerd/runc`, so the
    /// two never see each other's containers.
    #[serde(deserialize_with = "absolute_path")]
    pub root: PathBuf,
    /// Let systemd manage the container cgroups (`runc --systemd-cgroup`).
    pub systemd_cgroup: bool,
    /// CRIU binary crab starts itself: for process dumps (`[checkpoint] process_dump =
    /// "criu"`) and as the page daemon of lazy restores (`[restore] lazy_pages_min_mib`);
    /// `None` finds `criu` on `PATH`. runc always finds its own on `PATH`: both must be the
    /// same CRIU.
    #[serde(deserialize_with = "some_absolute_path")]
    pub criu: Option<PathBuf>,
}

impl Default for RuncConfig {
    fn default() -> Self {
        RuncConfig {
            binary: PathBuf::from("runc"),
            root: PathBuf::from("/run/crab/runc"),
            systemd_cgroup: false,
            criu: None,
        }
    }
}

/// Where crab keeps its on-disk state (checkpoint store).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [store] table")]
pub struct StoreConfig {
    /// Default `/var/lib/crab`.
    #[serde(deserialize_with = "absolute_path")]
    pub state_dir: PathBuf,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            state_dir: PathBuf::from("/var/lib/crab"),
        }
    }
}

/// The shim's own logging.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [log] table")]
pub struct LogConfig {
    /// One of `error`, `warn`, `info`, `debug`, `trace`. Default `info`.
    #[serde(deserialize_with = "level_filter")]
    pub level: LevelFilter,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: LevelFilter::Info,
        }
    }
}

/// Turn-end checkpointing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [checkpoint] table")]
pub struct CheckpointConfig {
    /// Take checkpoints at turn ends. Default `true`; `false` makes crab
    /// behave like a plain runc shim.
    pub enabled: bool,
    /// Retention: keep the newest N checkpoints of a sandbox (N >= 1);
    /// `None` keeps all. Accepted and validated now, enforced by the store
    /// once retention lands.
    #[serde(deserialize_with = "some_positive_u32")]
    pub keep_last: Option<u32>,
    /// Retention: additionally keep every Nth checkpoint (N >= 1) beyond
    /// `keep_last`; `None` keeps none of the older ones. Accepted and
    /// validated now, enforced by the store once retention lands.
    #[serde(deserialize_with = "some_positive_u32")]
    pub keep_every: Option<u32>,
    /// How long the next action may wait for the previous turn's checkpoint
    /// to become durable, in milliseconds (1 ..= 3_600_000). Default 30000.
    #[serde(deserialize_with = "action_wait_timeout_ms")]
    pub action_wait_timeout_ms: u64,
    /// How long a restore from a process image (`runc restore`, CRIU) may take before it is
    /// abandoned and everything it started is killed, in milliseconds (1 ..= 3_600_000).
    /// Default 120000. A corrupt image can make CRIU spin forever.
    #[serde(deserialize_with = "action_wait_timeout_ms")]
    pub restore_timeout_ms: u64,
    /// Where writable bind-mounted volumes are part of the sandbox's state: a bind mount of a
    /// host directory at or below one of these paths inside the container is tracked (the
    /// inspector watches it as it does the rootfs, and checkpoints capture its contents below
    /// its path: a base, then each turn's changes). Default `/workspace`, `/app`, `/testbed`
    /// (where agent harnesses mount the task's repository); `[]` tracks none. Other volumes
    /// are outside crab's checkpoints.
    #[serde(deserialize_with = "absolute_paths")]
    pub tracked_volumes: Vec<PathBuf>,
    /// What ends a turn: `annotation` (a `Tasks.Update` with `io.crab/turn-end`, the
    /// default) or `exec` (zero-integration mode: each exec that finishes while no other exec
    /// runs ends a turn). A container's spec annotation `io.crab/turn-boundary` overrides it.
    pub turn_boundary: TurnBoundary,
    /// Which checkpoint a turn end takes (see [`CheckpointPolicy`]). A container's spec
    /// annotation `io.crab/checkpoint-policy` overrides it.
    pub policy: CheckpointPolicy,
    /// How process images are dumped (see [`ProcessDump`]). Default `criu`.
    pub process_dump: ProcessDump,
    /// Whether a process image holds the container's network namespace (see
    /// [`NetnsDump`]). Default `when-changeable`.
    pub network_namespace: NetnsDump,
    /// What a turn end does with a process whose memory changed by its own doing alone (see
    /// [`SelfContainedChanges`]). Default `checkpoint`. A container's spec annotation
    /// `io.crab/self-contained-changes` overrides it.
    pub self_contained_changes: SelfContainedChanges,
}

/// What a turn end does with a process whose memory changed only by its own doing: nothing
/// reached it from outside (no syscall but waits that timed out, clocks, its own memory and
/// signal set-up; no signal; nobody wrote into it), it had no effect outside itself, and it
/// shares no writable memory. An idle server's timer wake-ups are such changes: its image at
/// the last checkpoint, left to run, is indistinguishable from it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SelfContainedChanges {
    /// Such a change is a change like any other: a process checkpoint.
    #[default]
    Checkpoint,
    /// Keep the process's last image: the change alone makes no process checkpoint. Attaches
    /// a BPF program to every syscall's return on the host (see the README's performance
    /// notes for its cost).
    Keep,
}

impl SelfContainedChanges {
    pub const ALL: [SelfContainedChanges; 2] =
        [SelfContainedChanges::Checkpoint, SelfContainedChanges::Keep];

    /// The name in the config file (and the `io.crab/self-contained-changes` annotation).
    pub fn name(self) -> &'static str {
        match self {
            SelfContainedChanges::Checkpoint => "checkpoint",
            SelfContainedChanges::Keep => "keep",
        }
    }

    pub fn from_name(name: &str) -> Option<SelfContainedChanges> {
        Self::ALL.into_iter().find(|v| v.name() == name)
    }
}

/// Whether a process dump (`process_dump = "criu"`) holds the container's network namespace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetnsDump {
    /// Dumped unless it cannot have changed since runc made it: a namespace of its own, no
    /// OCI hook but crab's, no `net.*` sysctl in the spec, `CAP_NET_ADMIN` granted to no
    /// process of the container (init, execs; checked in the kernel at each dump), `lo` its
    /// only interface. Left out, it costs the frozen container no `ip`/`iptables-save` runs;
    /// a restore makes a fresh one (`lo` up), as `runc create` did.
    #[default]
    WhenChangeable,
    /// Always dumped, as `runc checkpoint` does.
    Always,
}

/// How a process image is dumped. Both write the same image (`runc restore` restores either).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessDump {
    /// crab drives CRIU through its RPC interface (`criu swrk`) with the options `runc
    /// checkpoint` would pass: one CRIU start per dump, no runc start-up.
    #[default]
    Criu,
    /// `runc checkpoint`, which starts CRIU twice (its version, then the dump).
    Runc,
}

/// Which checkpoint a turn end takes, given what the inspector found.
///
/// `minimal` is crab: the smallest checkpoint that keeps what the turn left behind (none,
/// fs, proc or full). The other two are the baselines crab is measured against, and keep
/// less or more than `minimal` on purpose:
/// - `fs-every-turn`: an fs checkpoint (one layer of the turn's net file change) at every
///   turn end, also when nothing changed (an empty layer: what such a baseline costs), and
///   never a process image (files only, like snapshotting a workspace).
/// - `full-every-turn`: fs and proc at every turn end, whatever changed.
///
/// "No checkpoints" (and "chat-only", which keeps no OS state) is `enabled = false`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointPolicy {
    #[default]
    Minimal,
    FsEveryTurn,
    FullEveryTurn,
}

impl CheckpointPolicy {
    pub const ALL: [CheckpointPolicy; 3] = [
        CheckpointPolicy::Minimal,
        CheckpointPolicy::FsEveryTurn,
        CheckpointPolicy::FullEveryTurn,
    ];

    /// The name in the config file (and the `io.crab/checkpoint-policy` annotation).
    pub fn name(self) -> &'static str {
        match self {
            CheckpointPolicy::Minimal => "minimal",
            CheckpointPolicy::FsEveryTurn => "fs-every-turn",
            CheckpointPolicy::FullEveryTurn => "full-every-turn",
        }
    }

    pub fn from_name(name: &str) -> Option<CheckpointPolicy> {
        CheckpointPolicy::ALL.into_iter().find(|p| p.name() == name)
    }
}

impl fmt::Display for CheckpointPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What ends a turn (see [`CheckpointConfig::turn_boundary`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnBoundary {
    #[default]
    Annotation,
    Exec,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            enabled: true,
            keep_last: None,
            keep_every: None,
            action_wait_timeout_ms: 30_000,
            restore_timeout_ms: 120_000,
            tracked_volumes: ["/workspace", "/app", "/testbed"]
                .into_iter()
                .map(PathBuf::from)
                .collect(),
            turn_boundary: TurnBoundary::Annotation,
            policy: CheckpointPolicy::Minimal,
            process_dump: ProcessDump::Criu,
            network_namespace: NetnsDump::WhenChangeable,
            self_contained_changes: SelfContainedChanges::Checkpoint,
        }
    }
}

/// The host engine: one bounded scheduler for the checkpoint jobs of every sandbox on the
/// host. Shims have no daemon in common; they share the directory `root` (slot locks, a queue
/// of tickets, stats), so every shim whose config names the same `root` is in the same engine.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [engine] table")]
pub struct EngineConfig {
    /// How many checkpoint jobs run at once on the host (1 ..= 1024). Default half the host's
    /// online CPUs, at least 2 ([`default_max_jobs`]). Shims that share `root` should agree:
    /// a job only takes one of its own config's first `max_jobs` slots (the default is the
    /// same for every shim of a host).
    #[serde(deserialize_with = "max_jobs")]
    pub max_jobs: u32,
    /// The bytes per second checkpoint jobs may write, host-wide, in MB/s (10^6 bytes, >= 1);
    /// `None` (the default) sets no budget. Applied when jobs are admitted (a job waits while
    /// the host's bytes written exceed the budget), not by slowing a running job.
    #[serde(deserialize_with = "some_positive_u32")]
    pub io_budget_mb_s: Option<u32>,
    /// The directory the shims share. Default `/run/crab/engine` (a tmpfs: nothing in it
    /// outlives a reboot, when no job can be running either). crab makes it `0700` and its
    /// files `0600`: whoever can lock a slot file can stall every sandbox's checkpoints.
    #[serde(deserialize_with = "absolute_path")]
    pub root: PathBuf,
    /// How long a checkpoint job may wait for a slot, in milliseconds (1 ..= 3_600_000).
    /// Default 300000. A job still waiting then is recorded `failed` (naming the slots'
    /// holders) and the sandbox's next turn takes a full checkpoint.
    #[serde(deserialize_with = "action_wait_timeout_ms")]
    pub wait_timeout_ms: u64,
    /// How long a checkpoint job may hold its slot, in milliseconds (1 ..= 3_600_000).
    /// Default 600000. A job still running then is aborted (`runc checkpoint` and CRIU
    /// killed, the container thawed) and recorded `failed`.
    #[serde(deserialize_with = "action_wait_timeout_ms")]
    pub job_timeout_ms: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_jobs: default_max_jobs(),
            io_budget_mb_s: None,
            root: PathBuf::from("/run/crab/engine"),
            wait_timeout_ms: 300_000,
            job_timeout_ms: 600_000,
        }
    }
}

/// `[engine] max_jobs` when the config sets none: half the host's online CPUs, at least 2.
///
/// Measured by `make soak` on 2 CPUs (1,000 sandboxes, one full checkpoint each, turn ends at
/// 20/s): 2 slots drained 10 checkpoints/s with a job p50 of 187 ms, 4 slots 12/s with jobs at
/// 317 ms: on a saturated host more slots mostly share the same CPUs, and every slot is CPU
/// the agents' own commands do not get. Half the CPUs keeps the other half for the sandboxes
/// and gives a 1,000-sandbox host of 16 or more CPUs the 8 slots the replay's projection asks
/// for. Read from `/sys/devices/system/cpu/online` (the host's, whatever cgroup or affinity
/// the reading shim has, so every shim of a host agrees); 2 if it cannot be read.
pub fn default_max_jobs() -> u32 {
    let cpus = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|list| count_cpu_list(&list))
        .unwrap_or(2);
    (cpus / 2).clamp(2, 1024)
}

/// The number of CPUs in a kernel CPU list (`0-3,8,10-11`); `None` if it is not one.
fn count_cpu_list(list: &str) -> Option<u32> {
    let mut n: u32 = 0;
    for part in list.trim().split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<u32>().ok()?, hi.parse::<u32>().ok()?),
            None => {
                let c = part.parse::<u32>().ok()?;
                (c, c)
            }
        };
        n = n.checked_add(hi.checked_sub(lo)?.checked_add(1)?)?;
    }
    Some(n)
}

/// Starting containers from checkpoint images (see docs/security.md): whose
/// images are restored, and how large one may be.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [restore] table")]
pub struct RestoreConfig {
    /// The key `crabctl export` (and fork, rollback, recover) signs checkpoint images with.
    /// Default `<store.state_dir>/keys/checkpoint-signing.key`, generated (mode 0600) on first
    /// use; its public half is written next to it as `.pub`.
    #[serde(deserialize_with = "some_absolute_path")]
    pub signing_key: Option<PathBuf>,
    /// Files of public keys (`ed25519:<hex>` lines) whose signatures make an image's
    /// processes restorable, e.g. a cluster key from a Kubernetes Secret. Default none.
    #[serde(deserialize_with = "absolute_paths")]
    pub trusted_keys: Vec<PathBuf>,
    /// Trust the signing key's own public half (this host's exports). Default `true`.
    pub trust_signing_key: bool,
    /// A checkpoint not signed by a trusted key (a crab image, or containerd's checkpoint
    /// through `ctr c restore` / the CRI): `refuse` (the default) fails the container's Create
    /// with the reason; `start-fresh` starts it as an ordinary image (its entrypoint, none of
    /// the checkpoint's processes), the checkpoint directory hidden; `kernel-check` restores
    /// its processes on the kernel check alone (what CRIU restored compared with the spec
    /// before anything runs; the image's own claims are not vouched for by anyone): for
    /// trusted single-host use only.
    pub unsigned_images: UnsignedImages,
    /// The most bytes a checkpoint image's CRIU directory may hold, in MiB (>= 1). Default
    /// 16384 (16 GiB: the memory of a large sandbox; the image is copied into the
    /// bundle, which is often a tmpfs). Larger images are refused before anything is copied.
    #[serde(deserialize_with = "positive_u64")]
    pub max_image_mib: u64,
    /// The most files a checkpoint image's CRIU directory may hold (>= 1). Default 100000.
    #[serde(deserialize_with = "positive_u64")]
    pub max_image_files: u64,
    /// The most MiB the host's cache of verified CRIU images may hold
    /// (`<store.state_dir>/.restore-cache`): an image restored once (the N forks of one
    /// checkpoint, a rollback repeated) is verified and copied once, and later restores and
    /// their stores' imports link that verified copy instead of reading the image again.
    /// Least recently used images go first; an image larger than this is not cached. `0`
    /// turns the cache off. Default 4096.
    pub cache_mib: u64,
    /// Restore a process image lazily (CRIU's lazy pages over userfaultfd: the processes run
    /// before their memory is copied, pages arrive on first touch and in the background) when
    /// its memory pages hold at least this many MiB; `0` restores every image eagerly. The
    /// default, 64, is where lazy restores stop costing more than they save on this project's
    /// hosts (`bench-restore` section 5). The pages of each process's command line and
    /// environment are restored before it runs, so `ps`, `pgrep -f` and `pkill -f` see it at
    /// once. A checkpoint of the container waits until every page has arrived; if the page
    /// transfer fails, the container is killed rather than left with missing memory. Until
    /// the last page has arrived (about 0.2-1 s for 512 MiB), other reads of the processes'
    /// memory from outside them (debuggers, `process_vm_readv`) fail where a page is still
    /// missing. A restore is eager anyway where the kernel's userfaultfd cannot serve CRIU.
    pub lazy_pages_min_mib: u64,
    /// Check the digests of a signed image's large page files while CRIU restores, from the
    /// restore's private copy, with every restored process held at CRIU's post-restore stage
    /// until they are found to be the signed ones (`true`, the default: the hashing, ~30 ms
    /// per 50 MB, is off the restore's critical path); `false` checks every file before the
    /// restore begins.
    pub verify_during_restore: bool,
}

/// What to do with a checkpoint image no trusted key signed (see
/// [`RestoreConfig::unsigned_images`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnsignedImages {
    #[default]
    Refuse,
    StartFresh,
    KernelCheck,
}

impl Default for RestoreConfig {
    fn default() -> Self {
        RestoreConfig {
            signing_key: None,
            trusted_keys: Vec::new(),
            trust_signing_key: true,
            unsigned_images: UnsignedImages::Refuse,
            max_image_mib: 16_384,
            max_image_files: 100_000,
            cache_mib: 4096,
            lazy_pages_min_mib: 64,
            verify_during_restore: true,
        }
    }
}

/// Bounds on what one container can make the shim hold in memory or write to disk, per
/// container. Everything inside a sandbox is untrusted (its number of files, their names and
/// sizes, its processes' fds): each bound turns an excess into a logged outcome (the turn's
/// checkpoint is recorded `failed` with the reason, or, for the two totals of what a turn end
/// reads of all its processes, taken `full`; the container keeps running), never into
/// unbounded memory, disk or stack in the shim.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "the [limits] table")]
pub struct LimitsConfig {
    /// Entries (files, directories, ...) in one manifest of the upperdir or of a tracked
    /// volume (1 ..= 100000000). Default 1000000 (about 200 MB of shim memory at most).
    #[serde(deserialize_with = "max_manifest_entries")]
    pub max_manifest_entries: u64,
    /// Bytes of the paths of one manifest, summed (1 MiB ..= 64 GiB). Default 268435456
    /// (256 MiB): a deep tree of long names costs its whole path per entry.
    #[serde(deserialize_with = "max_manifest_path_bytes")]
    pub max_manifest_path_bytes: u64,
    /// Directory levels below the upperdir (or a tracked volume) that a walk descends
    /// (1 ..= 4096). Default 256. Walks are iterative; this bounds their open fds and memory.
    #[serde(deserialize_with = "max_walk_depth")]
    pub max_walk_depth: u32,
    /// Bytes of `/proc/PID/fdinfo` kept per process in a mark (4096 ..= 1 GiB); beyond it an
    /// fd's info is kept as a 64-bit hash (still compared exactly). Default 1048576 (1 MiB).
    #[serde(deserialize_with = "max_fdinfo_bytes")]
    pub max_fdinfo_bytes: u64,
    /// Bytes of file data one fs layer may hold, uncompressed, holes of sparse files excluded
    /// (1 MiB ..= 16 TiB). Default 17179869184 (16 GiB).
    #[serde(deserialize_with = "max_layer_bytes")]
    pub max_layer_bytes: u64,
    /// Apparent bytes of the regular files in one fs layer, holes of sparse files included
    /// (1 MiB ..= 16 TiB). Default 68719476736 (64 GiB). A sparse file is stored with its holes,
    /// but containerd's differ writes them as zeros when it unpacks the layer (a rollback,
    /// recover or fork that recreates the container): this bounds what that writes.
    #[serde(deserialize_with = "max_layer_apparent_bytes")]
    pub max_layer_apparent_bytes: u64,
    /// Bytes of process memory one observation of the container reads and hashes, all its
    /// processes together, each shared-memory object (memfd, SysV or tmpfs, keyed by device
    /// and inode) once however many processes map it; an idle process's image carried over
    /// from the mark counts with the memory it read (1 MiB ..= 16 TiB). Default 17179869184
    /// (16 GiB). Beyond it the turn is `full`, naming this key.
    #[serde(deserialize_with = "max_memory_image_bytes")]
    pub max_memory_image_bytes: u64,
    /// Bytes of `/proc/PID/fdinfo` one observation of the container reads, all its processes
    /// together (an idle process's carried over from the mark counts with what it read)
    /// (4096 ..= 16 GiB). Default 67108864 (64 MiB). Beyond it the turn is `full`, naming
    /// this key.
    #[serde(deserialize_with = "max_fdinfo_total_bytes")]
    pub max_fdinfo_total_bytes: u64,
    /// Processes of the container that hold a run count in the host's eBPF programs at once
    /// (1 ..= 4194304). Default 65536. Their memory is charged to the shim that loaded the
    /// programs, not to the container: beyond the bound a process gets no run count and the
    /// container's own turns are DEGRADED (`full`), nobody else's.
    #[serde(deserialize_with = "max_bpf_processes")]
    pub max_bpf_processes: u64,
    /// Layers of an image `crabctl export` writes: the base image's, the checkpoint's fs
    /// layers and the checkpoint layer (3 ..= 1000). Default 100 (Docker refuses images of more
    /// than 125). Every fs or full checkpoint adds a layer to the chain; beyond the bound runs
    /// of them are squashed into one layer each.
    #[serde(deserialize_with = "max_image_layers")]
    pub max_image_layers: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_manifest_entries: 1_000_000,
            max_manifest_path_bytes: 256 << 20,
            max_walk_depth: 256,
            max_fdinfo_bytes: 1 << 20,
            max_layer_bytes: 16 << 30,
            max_layer_apparent_bytes: 64 << 30,
            max_memory_image_bytes: 16 << 30,
            max_fdinfo_total_bytes: 64 << 20,
            max_bpf_processes: 65536,
            max_image_layers: 100,
        }
    }
}

impl Config {
    /// Where the checkpoint signing key is: `[restore] signing_key`, else under the store.
    pub fn signing_key_path(&self) -> PathBuf {
        self.restore
            .signing_key
            .clone()
            .unwrap_or_else(|| self.store.state_dir.join("keys/checkpoint-signing.key"))
    }
}

/// Where a loaded [`Config`] came from, for the shim's startup log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigSource {
    File(PathBuf),
    /// The file `$CRAB_CONFIG` names ([`CONFIG_ENV`]).
    Env(PathBuf),
    BuiltinDefaults,
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigSource::File(path) => write!(f, "{}", path.display()),
            ConfigSource::Env(path) => write!(f, "{} (${CONFIG_ENV})", path.display()),
            ConfigSource::BuiltinDefaults => f.write_str("built-in defaults"),
        }
    }
}

impl Config {
    /// Parses and validates TOML. `origin` only labels errors: the file the
    /// text came from, or something like `runtime options config_body` for
    /// inline TOML.
    pub fn from_toml_str(s: &str, origin: &Path) -> Result<Config, ConfigError> {
        serde_path_to_error::deserialize(toml::Deserializer::new(s)).map_err(|err| {
            // serde_path_to_error renders the document root as ".".
            let key = Some(err.path().to_string()).filter(|k| k != ".");
            let err = err.into_inner();
            ConfigError::Invalid {
                origin: origin.to_path_buf(),
                key,
                location: err.span().map(|span| Location::from_offset(s, span.start)),
                // toml splits syntax errors over lines; keep ours on one.
                message: err.message().trim_end().replace('\n', ": "),
            }
        })
    }

    /// Reads and validates the config file at `path`; a missing file is an error.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml_str(&text, path)
    }

    /// The shim's lookup: the `explicit` path (from containerd's runtime
    /// options) must exist; without one, [`DEFAULT_CONFIG_PATH`] is used if it
    /// exists, else the built-in defaults.
    ///
    /// With no `explicit` path, the file `$CRAB_CONFIG` ([`CONFIG_ENV`]) names comes before the
    /// default file: it must then exist, like an explicit path. This is how a handler registered
    /// with runc's runtime type (whose options cannot name crab's config) gets one other than
    /// [`DEFAULT_CONFIG_PATH`]: containerd passes its environment to the shims it starts, and a
    /// wrapper script at the handler's `runtime_path` can set it for one handler alone.
    pub fn load_or_default(explicit: Option<&Path>) -> Result<(Config, ConfigSource), ConfigError> {
        let env = std::env::var_os(CONFIG_ENV).filter(|v| !v.is_empty());
        load_or_default_from(
            explicit,
            env.as_deref().map(Path::new),
            Path::new(DEFAULT_CONFIG_PATH),
        )
    }

    /// Finds the runc executable: `runc.binary` itself if absolute, else the
    /// first executable file of that name in the directories of `PATH`.
    pub fn resolve_runc_binary(&self) -> Result<PathBuf, ConfigError> {
        resolve_executable(&self.runc.binary, std::env::var_os("PATH").as_deref())
    }
}

fn load_or_default_from(
    explicit: Option<&Path>,
    env: Option<&Path>,
    default_path: &Path,
) -> Result<(Config, ConfigSource), ConfigError> {
    if let Some(path) = explicit {
        return Ok((Config::load(path)?, ConfigSource::File(path.to_path_buf())));
    }
    if let Some(path) = env {
        if !path.is_absolute() {
            return Err(ConfigError::Read {
                path: path.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("${CONFIG_ENV} must be an absolute path"),
                ),
            });
        }
        return Ok((Config::load(path)?, ConfigSource::Env(path.to_path_buf())));
    }
    match fs::read_to_string(default_path) {
        Ok(text) => Ok((
            Config::from_toml_str(&text, default_path)?,
            ConfigSource::File(default_path.to_path_buf()),
        )),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            Ok((Config::default(), ConfigSource::BuiltinDefaults))
        }
        // A config that exists but cannot be read must not be silently ignored.
        Err(source) => Err(ConfigError::Read {
            path: default_path.to_path_buf(),
            source,
        }),
    }
}

fn resolve_executable(binary: &Path, path_var: Option<&OsStr>) -> Result<PathBuf, ConfigError> {
    let not_found = |reason: String| ConfigError::RuncBinaryNotFound {
        binary: binary.to_path_buf(),
        reason,
    };
    if binary.is_absolute() {
        return match fs::metadata(binary) {
            Ok(meta) if is_executable(&meta) => Ok(binary.to_path_buf()),
            Ok(_) => Err(not_found("not an executable file".into())),
            Err(err) => Err(not_found(err.to_string())),
        };
    }
    let Some(path_var) = path_var else {
        return Err(not_found("PATH is not set".into()));
    };
    std::env::split_paths(path_var)
        // An empty or relative PATH entry would resolve against the shim's
        // working directory (the bundle), never where runc lives.
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(binary))
        .find(|candidate| fs::metadata(candidate).is_ok_and(|meta| is_executable(&meta)))
        .ok_or_else(|| {
            not_found(format!(
                "no executable file of that name in PATH ({})",
                path_var.to_string_lossy()
            ))
        })
}

fn is_executable(meta: &fs::Metadata) -> bool {
    meta.is_file() && meta.permissions().mode() & 0o111 != 0
}

fn absolute_path<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
    let path = PathBuf::deserialize(d)?;
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(D::Error::invalid_value(
            Unexpected::Str(&path.to_string_lossy()),
            &"an absolute path",
        ))
    }
}

fn absolute_paths<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    let paths = Vec::<PathBuf>::deserialize(d)?;
    match paths.iter().find(|p| !p.is_absolute()) {
        Some(p) => Err(D::Error::invalid_value(
            Unexpected::Str(&p.to_string_lossy()),
            &"absolute paths",
        )),
        None => Ok(paths),
    }
}

fn some_absolute_path<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
    absolute_path(d).map(Some)
}

fn command_or_absolute_path<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
    let path = PathBuf::deserialize(d)?;
    let is_command_name = !path.as_os_str().is_empty()
        && path.components().count() == 1
        && path.file_name().is_some();
    if path.is_absolute() || is_command_name {
        Ok(path)
    } else {
        Err(D::Error::invalid_value(
            Unexpected::Str(&path.to_string_lossy()),
            &"a command name (looked up on PATH) or an absolute path",
        ))
    }
}

const LEVELS: [(&str, LevelFilter); 5] = [
    ("error", LevelFilter::Error),
    ("warn", LevelFilter::Warn),
    ("info", LevelFilter::Info),
    ("debug", LevelFilter::Debug),
    ("trace", LevelFilter::Trace),
];

fn level_filter<'de, D: Deserializer<'de>>(d: D) -> Result<LevelFilter, D::Error> {
    let name = String::deserialize(d)?;
    LEVELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, level)| *level)
        .ok_or_else(|| {
            D::Error::invalid_value(
                Unexpected::Str(&name),
                &"one of `error`, `warn`, `info`, `debug`, `trace`",
            )
        })
}

fn some_positive_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    match u32::deserialize(d)? {
        0 => Err(D::Error::invalid_value(
            Unexpected::Unsigned(0),
            &"an integer from 1 to 4294967295",
        )),
        n => Ok(Some(n)),
    }
}

fn action_wait_timeout_ms<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    const RANGE: std::ops::RangeInclusive<u64> = 1..=3_600_000;
    let ms = u64::deserialize(d)?;
    if RANGE.contains(&ms) {
        Ok(ms)
    } else {
        Err(D::Error::invalid_value(
            Unexpected::Unsigned(ms),
            &"milliseconds from 1 to 3600000 (one hour)",
        ))
    }
}

fn positive_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match u64::deserialize(d)? {
        0 => Err(D::Error::invalid_value(
            Unexpected::Unsigned(0),
            &"a positive integer",
        )),
        n => Ok(n),
    }
}

fn max_jobs<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = u32::deserialize(d)?;
    if (1..=1024).contains(&n) {
        Ok(n)
    } else {
        Err(D::Error::invalid_value(
            Unexpected::Unsigned(n.into()),
            &"an integer from 1 to 1024",
        ))
    }
}

fn u64_in<'de, D: Deserializer<'de>>(
    d: D,
    range: std::ops::RangeInclusive<u64>,
    expected: &'static str,
) -> Result<u64, D::Error> {
    let n = u64::deserialize(d)?;
    if range.contains(&n) {
        Ok(n)
    } else {
        Err(D::Error::invalid_value(Unexpected::Unsigned(n), &expected))
    }
}

fn max_manifest_entries<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(d, 1..=100_000_000, "an integer from 1 to 100000000")
}

fn max_manifest_path_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(
        d,
        1 << 20..=64 << 30,
        "bytes from 1048576 (1 MiB) to 68719476736 (64 GiB)",
    )
}

fn max_walk_depth<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    u64_in(d, 1..=4096, "an integer from 1 to 4096").map(|n| n as u32)
}

fn max_image_layers<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(d, 3..=1000, "an integer from 3 to 1000")
}

fn max_bpf_processes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(d, 1..=4 << 20, "an integer from 1 to 4194304")
}

fn max_fdinfo_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(d, 4096..=1 << 30, "bytes from 4096 to 1073741824 (1 GiB)")
}

fn max_layer_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(
        d,
        1 << 20..=16 << 40,
        "bytes from 1048576 (1 MiB) to 17592186044416 (16 TiB)",
    )
}

fn max_layer_apparent_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    max_layer_bytes(d)
}

fn max_memory_image_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    max_layer_bytes(d)
}

fn max_fdinfo_total_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    u64_in(
        d,
        4096..=16 << 30,
        "bytes from 4096 to 17179869184 (16 GiB)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(s, Path::new("/etc/crab/test.toml"))
    }

    fn parse_err(s: &str) -> (String, Option<String>, Option<Location>) {
        match parse(s) {
            Err(err @ ConfigError::Invalid { .. }) => {
                let msg = err.to_string();
                let ConfigError::Invalid { key, location, .. } = err else {
                    unreachable!()
                };
                (msg, key, location)
            }
            other => panic!("expected ConfigError::Invalid for {s:?}, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let c = Config::default();
        assert_eq!(c.runc.binary, Path::new("runc"));
        assert_eq!(c.runc.root, Path::new("/run/crab/runc"));
        assert!(!c.runc.systemd_cgroup);
        assert_eq!(c.runc.criu, None);
        assert_eq!(c.store.state_dir, Path::new("/var/lib/crab"));
        assert_eq!(c.log.level, LevelFilter::Info);
        assert!(c.checkpoint.enabled);
        assert_eq!(c.checkpoint.keep_last, None);
        assert_eq!(c.checkpoint.keep_every, None);
        assert_eq!(c.checkpoint.action_wait_timeout_ms, 30_000);
        assert_eq!(c.checkpoint.policy, CheckpointPolicy::Minimal);
    }

    #[test]
    fn example_config_parses_to_the_defaults() {
        // examples/crab.toml documents the defaults; keep the two in step.
        let c = parse(include_str!("../examples/crab.toml")).unwrap();
        assert_eq!(c, Config::default());
        // The commented-out keys are valid once uncommented.
        let uncommented = include_str!("../examples/crab.toml")
            .lines()
            .map(|l| {
                l.strip_prefix("# ")
                    .filter(|rest| {
                        rest.split_once(" = ").is_some_and(|(k, _)| {
                            k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                        })
                    })
                    .unwrap_or(l)
            })
            .collect::<Vec<_>>()
            .join("\n");
        let c = parse(&uncommented).unwrap();
        assert_eq!(c.runc.criu.as_deref(), Some(Path::new("/usr/sbin/criu")));
        assert_eq!(
            (c.checkpoint.keep_last, c.checkpoint.keep_every),
            (Some(20), Some(10))
        );
    }

    #[test]
    fn example_containerd_config_registers_the_crab_handler() {
        let doc: toml::Table =
            toml::from_str(include_str!("../examples/containerd-config.toml")).unwrap();
        let crab =
            &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["crab"];
        assert_eq!(doc["version"].as_integer(), Some(3));
        // runc's runtime type with crab's shim as its binary (the README's recommendation).
        assert_eq!(crab["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert!(crab["runtime_path"]
            .as_str()
            .is_some_and(|p| p.ends_with("/containerd-shim-crab-v1")));
        assert!(crab.get("options").is_none());
    }

    #[test]
    fn empty_document_and_empty_tables_give_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(
            parse("[runc]\n[store]\n[log]\n[checkpoint]\n[engine]\n[restore]\n[limits]\n").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn full_document_parses() {
        let c = parse(
            r#"
            [runc]
            binary = "/usr/local/sbin/runc"
            root = "/run/crab/runc"
            systemd_cgroup = true
            criu = "/usr/sbin/criu"

            [store]
            state_dir = "/srv/crab"

            [log]
            level = "trace"

            [checkpoint]
            enabled = false
            keep_last = 10
            keep_every = 5
            action_wait_timeout_ms = 1500
            restore_timeout_ms = 2500
            tracked_volumes = ["/workspace", "/data"]
            turn_boundary = "exec"
            policy = "full-every-turn"
            process_dump = "runc"
            network_namespace = "always"
            self_contained_changes = "keep"

            [engine]
            max_jobs = 4
            io_budget_mb_s = 200
            root = "/run/crab/engine-test"
            wait_timeout_ms = 5000
            job_timeout_ms = 7000

            [restore]
            signing_key = "/etc/crab/keys/node.key"
            trusted_keys = ["/etc/crab/keys/cluster.pub"]
            trust_signing_key = false
            unsigned_images = "start-fresh"
            max_image_mib = 1024
            max_image_files = 500
            cache_mib = 0
            lazy_pages_min_mib = 256
            verify_during_restore = false

            [limits]
            max_manifest_entries = 20000
            max_manifest_path_bytes = 2097152
            max_walk_depth = 64
            max_fdinfo_bytes = 8192
            max_layer_bytes = 1073741824
            max_layer_apparent_bytes = 2147483648
            max_memory_image_bytes = 1073741824
            max_fdinfo_total_bytes = 4194304
            max_bpf_processes = 512
            max_image_layers = 40

            [shim]
            groups = ["agents", "rl.rollouts-1"]

            [replication]
            registry = "registry.example:5000/crab/checkpoints"
            insecure = true
            auth_file = "/etc/crab/auth.json"
            max_mib = 512
            retry_max_ms = 2000
            "#,
        )
        .unwrap();
        assert_eq!(
            c,
            Config {
                runc: RuncConfig {
                    binary: "/usr/local/sbin/runc".into(),
                    root: "/run/crab/runc".into(),
                    systemd_cgroup: true,
                    criu: Some("/usr/sbin/criu".into()),
                },
                store: StoreConfig {
                    state_dir: "/srv/crab".into()
                },
                log: LogConfig {
                    level: LevelFilter::Trace
                },
                checkpoint: CheckpointConfig {
                    enabled: false,
                    keep_last: Some(10),
                    keep_every: Some(5),
                    action_wait_timeout_ms: 1500,
                    restore_timeout_ms: 2500,
                    tracked_volumes: vec!["/workspace".into(), "/data".into()],
                    turn_boundary: TurnBoundary::Exec,
                    policy: CheckpointPolicy::FullEveryTurn,
                    process_dump: ProcessDump::Runc,
                    network_namespace: NetnsDump::Always,
                    self_contained_changes: SelfContainedChanges::Keep,
                },
                engine: EngineConfig {
                    max_jobs: 4,
                    io_budget_mb_s: Some(200),
                    root: "/run/crab/engine-test".into(),
                    wait_timeout_ms: 5000,
                    job_timeout_ms: 7000,
                },
                restore: RestoreConfig {
                    signing_key: Some("/etc/crab/keys/node.key".into()),
                    trusted_keys: vec!["/etc/crab/keys/cluster.pub".into()],
                    trust_signing_key: false,
                    unsigned_images: UnsignedImages::StartFresh,
                    max_image_mib: 1024,
                    max_image_files: 500,
                    cache_mib: 0,
                    lazy_pages_min_mib: 256,
                    verify_during_restore: false,
                },
                limits: LimitsConfig {
                    max_manifest_entries: 20_000,
                    max_manifest_path_bytes: 2 << 20,
                    max_walk_depth: 64,
                    max_fdinfo_bytes: 8192,
                    max_layer_bytes: 1 << 30,
                    max_layer_apparent_bytes: 2 << 30,
                    max_memory_image_bytes: 1 << 30,
                    max_fdinfo_total_bytes: 4 << 20,
                    max_bpf_processes: 512,
                    max_image_layers: 40,
                },
                shim: ShimConfig {
                    groups: vec!["agents".into(), "rl.rollouts-1".into()],
                },
                replication: ReplicationConfig {
                    registry: Some("registry.example:5000/crab/checkpoints".into()),
                    insecure: true,
                    auth_file: Some("/etc/crab/auth.json".into()),
                    max_mib: 512,
                    retry_max_ms: 2000,
                },
            }
        );
        for bad in [
            "localhost:5000",
            "localhost:5000/Crab",
            "localhost:5000/a//b",
            "localhost:5000/a:tag",
            "/repo",
            "host name/repo",
        ] {
            let e = Config::from_toml_str(
                &format!("[replication]\nregistry = {bad:?}\n"),
                Path::new("t.toml"),
            );
            assert!(e.is_err(), "{bad} accepted");
        }
        assert_eq!(c.signing_key_path(), Path::new("/etc/crab/keys/node.key"));
        assert_eq!(
            Config::default().signing_key_path(),
            Path::new("/var/lib/crab/keys/checkpoint-signing.key")
        );
    }

    #[test]
    fn a_malformed_group_name_is_named() {
        for bad in [
            "\"\"",
            "\"../x\"",
            "\"a b\"",
            &format!("\"{}\"", "x".repeat(65)),
        ] {
            let e = parse(&format!("[shim]\ngroups = [{bad}]\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("group name must be 1 to 64"), "{bad}: {e}");
        }
        assert!(parse("[shim]\ngroup = []\n").is_err(), "an unknown key");
    }

    #[test]
    fn bad_restore_settings_are_named() {
        for (doc, key) in [
            (
                "[restore]\nunsigned_images = \"allow\"\n",
                "restore.unsigned_images",
            ),
            (
                "[restore]\ntrusted_keys = [\"keys/a.pub\"]\n",
                "restore.trusted_keys",
            ),
            ("[restore]\nsigning_key = \"k\"\n", "restore.signing_key"),
            ("[restore]\nmax_image_mib = 0\n", "restore.max_image_mib"),
            (
                "[restore]\nmax_image_files = 0\n",
                "restore.max_image_files",
            ),
            ("[restore]\ntrusted_key = []\n", "restore.trusted_key"),
        ] {
            let (msg, got, location) = parse_err(doc);
            assert_eq!(got.as_deref(), Some(key), "{doc}: {msg}");
            assert_eq!(location.map(|l| l.line), Some(2), "{doc}: {msg}");
        }
    }

    #[test]
    fn process_dump_names() {
        assert_eq!(
            parse("").unwrap().checkpoint.process_dump,
            ProcessDump::Criu
        );
        for (name, want) in [("criu", ProcessDump::Criu), ("runc", ProcessDump::Runc)] {
            let doc = format!("checkpoint.process_dump = {name:?}");
            assert_eq!(parse(&doc).unwrap().checkpoint.process_dump, want);
        }
        for bad in ["\"CRIU\"", "\"\"", "\"criu-rpc\"", "1", "true"] {
            let (msg, key, location) = parse_err(&format!("[checkpoint]\nprocess_dump = {bad}\n"));
            assert_eq!(
                key.as_deref(),
                Some("checkpoint.process_dump"),
                "{bad}: {msg}"
            );
            assert_eq!(location.map(|l| l.line), Some(2), "{bad}: {msg}");
        }
    }

    #[test]
    fn network_namespace_names() {
        assert_eq!(
            parse("").unwrap().checkpoint.network_namespace,
            NetnsDump::WhenChangeable
        );
        for (name, want) in [
            ("when-changeable", NetnsDump::WhenChangeable),
            ("always", NetnsDump::Always),
        ] {
            let doc = format!("checkpoint.network_namespace = {name:?}");
            assert_eq!(parse(&doc).unwrap().checkpoint.network_namespace, want);
        }
        for bad in ["\"never\"", "\"Always\"", "\"\"", "false", "0"] {
            let (msg, key, location) =
                parse_err(&format!("[checkpoint]\nnetwork_namespace = {bad}\n"));
            assert_eq!(
                key.as_deref(),
                Some("checkpoint.network_namespace"),
                "{bad}: {msg}"
            );
            assert_eq!(location.map(|l| l.line), Some(2), "{bad}: {msg}");
        }
    }

    #[test]
    fn checkpoint_policy_names() {
        for p in CheckpointPolicy::ALL {
            let doc = format!("checkpoint.policy = {:?}", p.name());
            assert_eq!(parse(&doc).unwrap().checkpoint.policy, p);
            assert_eq!(CheckpointPolicy::from_name(p.name()), Some(p));
            assert_eq!(p.to_string(), p.name());
        }
        assert_eq!(CheckpointPolicy::from_name("Minimal"), None);
        for bad in ["\"none\"", "\"fs_every_turn\"", "\"\"", "1"] {
            let (msg, key, location) = parse_err(&format!("[checkpoint]\npolicy = {bad}\n"));
            assert_eq!(key.as_deref(), Some("checkpoint.policy"), "{bad}: {msg}");
            assert_eq!(location.map(|l| l.line), Some(2), "{bad}: {msg}");
        }
        let (msg, _, _) = parse_err("checkpoint.policy = \"every-turn\"");
        assert!(
            msg.ends_with(
                "key `checkpoint.policy`: unknown variant `every-turn`, \
                 expected one of `minimal`, `fs-every-turn`, `full-every-turn`"
            ),
            "{msg}"
        );
    }

    #[test]
    fn cpu_lists_are_counted_and_nonsense_is_not() {
        for (list, n) in [
            ("0\n", Some(1)),
            ("0-1\n", Some(2)),
            ("0-3,8,10-11", Some(7)),
            ("0-63", Some(64)),
            ("", None),
            ("3-1", None),
            ("0-x", None),
            ("0,,2", None),
            ("0-4294967295", None),
        ] {
            assert_eq!(count_cpu_list(list), n, "{list:?}");
        }
    }

    #[test]
    fn engine_settings_are_validated() {
        let c = Config::default().engine;
        assert_eq!(
            (c.max_jobs, c.io_budget_mb_s, c.root.as_path()),
            (default_max_jobs(), None, Path::new("/run/crab/engine"))
        );
        assert!(c.max_jobs >= 2);
        assert_eq!((c.wait_timeout_ms, c.job_timeout_ms), (300_000, 600_000));
        for (doc, key, expected) in [
            ("engine.max_jobs = 0", "engine.max_jobs", "an integer from 1 to 1024"),
            ("engine.max_jobs = 1025", "engine.max_jobs", "an integer from 1 to 1024"),
            ("engine.max_jobs = -1", "engine.max_jobs", ""),
            ("engine.max_jobs = \"2\"", "engine.max_jobs", ""),
            ("engine.io_budget_mb_s = 0", "engine.io_budget_mb_s", "an integer from 1"),
            ("engine.io_budget_mb_s = 1.5", "engine.io_budget_mb_s", ""),
            ("engine.root = \"run/crab\"", "engine.root", "an absolute path"),
            ("engine.wait_timeout_ms = 0", "engine.wait_timeout_ms", "milliseconds from 1 to 3600000"),
            ("engine.wait_timeout_ms = 3600001", "engine.wait_timeout_ms", "milliseconds from 1 to 3600000"),
            ("engine.job_timeout_ms = 0", "engine.job_timeout_ms", "milliseconds from 1 to 3600000"),
            ("engine.job_timeout_ms = \"1s\"", "engine.job_timeout_ms", ""),
            ("engine.slots = 2", "engine.slots", "expected one of `max_jobs`, `io_budget_mb_s`, `root`, `wait_timeout_ms`, `job_timeout_ms`"),
        ] {
            let (msg, got, location) = parse_err(doc);
            assert_eq!(got.as_deref(), Some(key), "{doc}: {msg}");
            assert!(location.is_some(), "{doc}: {msg}");
            assert!(msg.contains(expected), "{doc}: {msg}");
        }
        let c = parse("[engine]\nmax_jobs = 1024\nio_budget_mb_s = 1\nwait_timeout_ms = 1\njob_timeout_ms = 3600000\n").unwrap().engine;
        assert_eq!((c.max_jobs, c.io_budget_mb_s), (1024, Some(1)));
        assert_eq!((c.wait_timeout_ms, c.job_timeout_ms), (1, 3_600_000));
    }

    #[test]
    fn limits_are_validated() {
        let c = Config::default().limits;
        assert_eq!(
            (
                c.max_manifest_entries,
                c.max_manifest_path_bytes,
                c.max_walk_depth,
                c.max_fdinfo_bytes,
                c.max_layer_bytes,
                c.max_layer_apparent_bytes,
                c.max_memory_image_bytes,
                c.max_fdinfo_total_bytes
            ),
            (
                1_000_000,
                268_435_456,
                256,
                1_048_576,
                17_179_869_184,
                68_719_476_736,
                17_179_869_184,
                67_108_864
            )
        );
        assert_eq!(c.max_bpf_processes, 65_536);
        assert_eq!(c.max_image_layers, 100);
        for (doc, key, expected) in [
            (
                "limits.max_manifest_entries = 0",
                "limits.max_manifest_entries",
                "from 1 to 100000000",
            ),
            (
                "limits.max_manifest_entries = 100000001",
                "limits.max_manifest_entries",
                "from 1",
            ),
            (
                "limits.max_manifest_entries = -5",
                "limits.max_manifest_entries",
                "",
            ),
            (
                "limits.max_manifest_path_bytes = 1048575",
                "limits.max_manifest_path_bytes",
                "1 MiB",
            ),
            (
                "limits.max_walk_depth = 0",
                "limits.max_walk_depth",
                "from 1 to 4096",
            ),
            (
                "limits.max_walk_depth = 4097",
                "limits.max_walk_depth",
                "from 1 to 4096",
            ),
            ("limits.max_walk_depth = \"9\"", "limits.max_walk_depth", ""),
            (
                "limits.max_fdinfo_bytes = 4095",
                "limits.max_fdinfo_bytes",
                "from 4096",
            ),
            (
                "limits.max_image_layers = 2",
                "limits.max_image_layers",
                "from 3 to 1000",
            ),
            (
                "limits.max_image_layers = 1001",
                "limits.max_image_layers",
                "from 3 to 1000",
            ),
            (
                "limits.max_bpf_processes = 0",
                "limits.max_bpf_processes",
                "from 1 to 4194304",
            ),
            (
                "limits.max_bpf_processes = 4194305",
                "limits.max_bpf_processes",
                "from 1 to 4194304",
            ),
            (
                "limits.max_layer_bytes = 17592186044417",
                "limits.max_layer_bytes",
                "16 TiB",
            ),
            ("limits.max_layer_bytes = 1.5", "limits.max_layer_bytes", ""),
            (
                "limits.max_layer_apparent_bytes = 1048575",
                "limits.max_layer_apparent_bytes",
                "from 1048576 (1 MiB)",
            ),
            (
                "limits.max_layer_apparent_bytes = 17592186044417",
                "limits.max_layer_apparent_bytes",
                "16 TiB",
            ),
            (
                "limits.max_memory_image_bytes = 1048575",
                "limits.max_memory_image_bytes",
                "from 1048576 (1 MiB)",
            ),
            (
                "limits.max_memory_image_bytes = 17592186044417",
                "limits.max_memory_image_bytes",
                "16 TiB",
            ),
            (
                "limits.max_fdinfo_total_bytes = 4095",
                "limits.max_fdinfo_total_bytes",
                "from 4096",
            ),
            (
                "limits.max_fdinfo_total_bytes = 17179869185",
                "limits.max_fdinfo_total_bytes",
                "16 GiB",
            ),
            (
                "limits.max_fdinfo_total_bytes = -1",
                "limits.max_fdinfo_total_bytes",
                "",
            ),
            (
                "limits.max_files = 2",
                "limits.max_files",
                "expected one of `max_manifest_entries`",
            ),
        ] {
            let (msg, got, location) = parse_err(doc);
            assert_eq!(got.as_deref(), Some(key), "{doc}: {msg}");
            assert!(location.is_some(), "{doc}: {msg}");
            assert!(msg.contains(expected), "{doc}: {msg}");
        }
        let c = parse(
            "[limits]\nmax_manifest_entries = 1\nmax_walk_depth = 4096\nmax_layer_bytes = 1048576\nmax_layer_apparent_bytes = 17592186044416\nmax_memory_image_bytes = 1048576\nmax_fdinfo_total_bytes = 17179869184\n",
        )
        .unwrap()
        .limits;
        assert_eq!(
            (
                c.max_manifest_entries,
                c.max_walk_depth,
                c.max_layer_bytes,
                c.max_layer_apparent_bytes,
                c.max_memory_image_bytes,
                c.max_fdinfo_total_bytes
            ),
            (1, 4096, 1 << 20, 16 << 40, 1 << 20, 16 << 30)
        );
    }

    #[test]
    fn tracked_volumes_must_be_absolute() {
        let e = parse("[checkpoint]\ntracked_volumes = [\"/ok\", \"rel\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("checkpoint.tracked_volumes"), "{e}");
        assert!(e.contains("absolute"), "{e}");
    }

    #[test]
    fn dotted_keys_work_like_tables() {
        let c = parse("runc.systemd_cgroup = true\nlog.level = \"debug\"\n").unwrap();
        assert!(c.runc.systemd_cgroup);
        assert_eq!(c.log.level, LevelFilter::Debug);
    }

    #[test]
    fn unknown_top_level_key_is_named() {
        let (msg, key, location) = parse_err("[store]\nstate_dir = \"/x\"\n\n[runtime]\nfoo = 1\n");
        assert_eq!(key.as_deref(), Some("runtime"));
        assert_eq!(location, Some(Location { line: 4, column: 2 }));
        assert_eq!(
            msg,
            "invalid crab config /etc/crab/test.toml:4:2: key `runtime`: unknown field `runtime`, \
             expected one of `runc`, `store`, `log`, `checkpoint`, `engine`, `restore`, `limits`, `shim`, `replication`"
        );
    }

    #[test]
    fn unknown_nested_key_is_named() {
        let (msg, key, location) = parse_err("[runc]\nbinary = \"runc\"\nsystemd_cgroups = true\n");
        assert_eq!(key.as_deref(), Some("runc.systemd_cgroups"));
        assert_eq!(location, Some(Location { line: 3, column: 1 }));
        assert!(
            msg.starts_with(
                "invalid crab config /etc/crab/test.toml:3:1: key `runc.systemd_cgroups`: \
                 unknown field `systemd_cgroups`, expected one of `binary`, `root`, `systemd_cgroup`, `criu`"
            ),
            "{msg}"
        );
    }

    #[test]
    fn wrong_type_names_the_key() {
        let (msg, key, location) = parse_err("[runc]\nsystemd_cgroup = \"yes\"\n");
        assert_eq!(key.as_deref(), Some("runc.systemd_cgroup"));
        assert_eq!(
            location,
            Some(Location {
                line: 2,
                column: 18
            })
        );
        assert_eq!(
            msg,
            "invalid crab config /etc/crab/test.toml:2:18: key `runc.systemd_cgroup`: \
             invalid type: string \"yes\", expected a boolean"
        );

        let (msg, key, _) = parse_err("log = \"debug\"\n");
        assert_eq!(key.as_deref(), Some("log"));
        assert!(
            msg.ends_with("invalid type: string \"debug\", expected the [log] table"),
            "{msg}"
        );
    }

    #[test]
    fn relative_state_dir_is_rejected() {
        let (msg, key, location) = parse_err("[store]\nstate_dir = \"var/lib/crab\"\n");
        assert_eq!(key.as_deref(), Some("store.state_dir"));
        assert_eq!(
            location,
            Some(Location {
                line: 2,
                column: 13
            })
        );
        assert_eq!(
            msg,
            "invalid crab config /etc/crab/test.toml:2:13: key `store.state_dir`: \
             invalid value: string \"var/lib/crab\", expected an absolute path"
        );
    }

    #[test]
    fn other_paths_are_validated() {
        for (doc, key) in [
            ("runc.root = \"run/runc\"", "runc.root"),
            ("runc.criu = \"criu\"", "runc.criu"),
            ("runc.binary = \"bin/runc\"", "runc.binary"),
            ("runc.binary = \"./runc\"", "runc.binary"),
            ("runc.binary = \"\"", "runc.binary"),
            ("store.state_dir = \"\"", "store.state_dir"),
        ] {
            let (msg, got, _) = parse_err(doc);
            assert_eq!(got.as_deref(), Some(key), "{doc}: {msg}");
        }
        assert_eq!(
            parse("runc.binary = \"crun\"").unwrap().runc.binary,
            Path::new("crun")
        );
    }

    #[test]
    fn bad_log_level_is_rejected() {
        let (msg, key, _) = parse_err("[log]\nlevel = \"verbose\"\n");
        assert_eq!(key.as_deref(), Some("log.level"));
        assert!(
            msg.ends_with(
                "key `log.level`: invalid value: string \"verbose\", \
                 expected one of `error`, `warn`, `info`, `debug`, `trace`"
            ),
            "{msg}"
        );
        for bad in ["off", "INFO", ""] {
            let (_, key, _) = parse_err(&format!("log.level = {bad:?}"));
            assert_eq!(key.as_deref(), Some("log.level"), "{bad}");
        }
        for (name, level) in LEVELS {
            assert_eq!(
                parse(&format!("log.level = {name:?}")).unwrap().log.level,
                level
            );
        }
    }

    #[test]
    fn numbers_out_of_range_are_rejected() {
        for (doc, key) in [
            ("checkpoint.keep_last = 0", "checkpoint.keep_last"),
            ("checkpoint.keep_last = -1", "checkpoint.keep_last"),
            ("checkpoint.keep_every = 0", "checkpoint.keep_every"),
            (
                "checkpoint.keep_every = 4294967296",
                "checkpoint.keep_every",
            ),
            (
                "checkpoint.action_wait_timeout_ms = 0",
                "checkpoint.action_wait_timeout_ms",
            ),
            (
                "checkpoint.action_wait_timeout_ms = 3600001",
                "checkpoint.action_wait_timeout_ms",
            ),
            (
                "checkpoint.action_wait_timeout_ms = 1.5",
                "checkpoint.action_wait_timeout_ms",
            ),
            (
                "checkpoint.restore_timeout_ms = 0",
                "checkpoint.restore_timeout_ms",
            ),
        ] {
            let (msg, got, location) = parse_err(doc);
            assert_eq!(got.as_deref(), Some(key), "{doc}: {msg}");
            assert!(location.is_some(), "{doc}: {msg}");
        }
        let c =
            parse("checkpoint.keep_last = 1\ncheckpoint.action_wait_timeout_ms = 3600000").unwrap();
        assert_eq!(c.checkpoint.keep_last, Some(1));
        assert_eq!(c.checkpoint.action_wait_timeout_ms, 3_600_000);
    }

    #[test]
    fn syntax_error_has_location_but_no_key() {
        let (msg, key, location) = parse_err("[runc]\nbinary = \n");
        assert_eq!(key, None);
        assert_eq!(location.map(|l| l.line), Some(2));
        assert!(
            msg.starts_with("invalid crab config /etc/crab/test.toml:2:"),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "{msg}");

        let (msg, key, _) = parse_err("[runc]\n[runc]\n");
        assert_eq!(key, None);
        assert!(msg.contains("duplicate key `runc`"), "{msg}");
    }

    #[test]
    fn missing_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.toml");
        let err = Config::load(&path).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Read { path: p, source } if *p == path && source.kind() == io::ErrorKind::NotFound),
            "{err:?}"
        );
        assert!(err
            .to_string()
            .starts_with(&format!("cannot read crab config {}: ", path.display())));
    }

    #[test]
    fn load_reports_the_file_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("crab.toml");
        fs::write(&path, "[store]\nstate_dir = \"rel\"\n").unwrap();
        let msg = Config::load(&path).unwrap_err().to_string();
        assert!(
            msg.starts_with(&format!(
                "invalid crab config {}:2:13: key `store.state_dir`",
                path.display()
            )),
            "{msg}"
        );
    }

    #[test]
    fn load_or_default_precedence() {
        let dir = tempfile::tempdir().unwrap();
        let explicit = dir.path().join("explicit.toml");
        let default_path = dir.path().join("default.toml");
        let missing = dir.path().join("missing.toml");
        fs::write(&explicit, "log.level = \"debug\"").unwrap();
        fs::write(&default_path, "log.level = \"warn\"").unwrap();

        // An explicit path wins over the default file.
        let (c, src) = load_or_default_from(Some(&explicit), None, &default_path).unwrap();
        assert_eq!(
            (c.log.level, src),
            (LevelFilter::Debug, ConfigSource::File(explicit.clone()))
        );

        // An explicit path must exist, even when the default file does.
        let err = load_or_default_from(Some(&missing), None, &default_path).unwrap_err();
        assert!(matches!(err, ConfigError::Read { path, .. } if path == missing));

        // No explicit path: the default file if it exists...
        let (c, src) = load_or_default_from(None, None, &default_path).unwrap();
        assert_eq!(
            (c.log.level, src),
            (LevelFilter::Warn, ConfigSource::File(default_path.clone()))
        );

        // ... else built-in defaults.
        let (c, src) = load_or_default_from(None, None, &missing).unwrap();
        assert_eq!((c, src), (Config::default(), ConfigSource::BuiltinDefaults));

        // An invalid default file is an error, not a silent fallback.
        fs::write(&default_path, "bogus = 1").unwrap();
        assert!(load_or_default_from(None, None, &default_path).is_err());

        // $CRAB_CONFIG: after an explicit path, before the default file; it must exist and be
        // absolute, like an explicit path.
        let env = dir.path().join("env.toml");
        fs::write(&env, "log.level = \"error\"").unwrap();
        fs::write(&default_path, "log.level = \"warn\"").unwrap();
        let (c, src) = load_or_default_from(None, Some(&env), &default_path).unwrap();
        assert_eq!(
            (c.log.level, src),
            (LevelFilter::Error, ConfigSource::Env(env.clone()))
        );
        let (c, _) = load_or_default_from(Some(&explicit), Some(&env), &default_path).unwrap();
        assert_eq!(c.log.level, LevelFilter::Debug);
        let err = load_or_default_from(None, Some(&missing), &default_path).unwrap_err();
        assert!(matches!(err, ConfigError::Read { path, .. } if path == missing));
        let err =
            load_or_default_from(None, Some(Path::new("env.toml")), &default_path).unwrap_err();
        assert!(err.to_string().contains("absolute"), "{err}");
        fs::write(&env, "bogus = 1").unwrap();
        assert!(load_or_default_from(None, Some(&env), &default_path).is_err());
    }

    #[test]
    fn config_source_display() {
        assert_eq!(
            ConfigSource::BuiltinDefaults.to_string(),
            "built-in defaults"
        );
        assert_eq!(
            ConfigSource::File("/etc/crab/config.toml".into()).to_string(),
            "/etc/crab/config.toml"
        );
    }

    #[test]
    fn resolve_runc_binary_on_path_and_absolute() {
        let dir = tempfile::tempdir().unwrap();
        let (empty, bin) = (dir.path().join("empty"), dir.path().join("bin"));
        fs::create_dir(&empty).unwrap();
        fs::create_dir(&bin).unwrap();
        let runc = bin.join("runc");
        fs::write(&runc, "#!/bin/sh\n").unwrap();
        fs::set_permissions(&runc, fs::Permissions::from_mode(0o755)).unwrap();
        let plain = bin.join("plain");
        fs::write(&plain, "").unwrap();
        fs::set_permissions(&plain, fs::Permissions::from_mode(0o644)).unwrap();

        let path_var = std::env::join_paths([&empty, &bin]).unwrap();
        assert_eq!(
            resolve_executable(Path::new("runc"), Some(&path_var)).unwrap(),
            runc
        );
        assert_eq!(resolve_executable(&runc, None).unwrap(), runc);

        // A relative PATH entry is not searched, even if it would match.
        let relative = OsStr::new("relative/bin");
        assert!(resolve_executable(Path::new("runc"), Some(relative)).is_err());

        for (binary, path_var) in [
            (Path::new("runc"), None),
            (Path::new("runc"), Some(empty.as_os_str())),
            (Path::new("plain"), Some(path_var.as_os_str())),
            (plain.as_path(), None),
            (bin.as_path(), None),
            (Path::new("/nonexistent/runc"), None),
        ] {
            let err = resolve_executable(binary, path_var).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.starts_with(&format!(
                    "runc binary `{}` not found (runc.binary)",
                    binary.display()
                )),
                "{msg}"
            );
        }
    }

    #[test]
    fn resolve_runc_binary_uses_config() {
        let mut c = Config::default();
        c.runc.binary = "/nonexistent/runc".into();
        let err = c.resolve_runc_binary().unwrap_err();
        assert!(
            matches!(err, ConfigError::RuncBinaryNotFound { binary, .. } if binary == Path::new("/nonexistent/runc"))
        );
    }
}
