//! crabctl's command line: the commands, their flags and positional arguments (clap derive),
//! the help text, and shell completions generated from the same definition.
//!
//! [`parse`] turns the arguments into an [`Invocation`]: the global options and one
//! [`Request`] whose container is already a [`Target`] (an id, or a pod's container by name),
//! so the commands never see how it was spelled.

use std::{ffi::OsString, path::PathBuf};

use clap::{
    parser::ValueSource, ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand,
};

use crate::{
    error::EXIT_CODES_HELP,
    output::{self, Format},
    pod::DEFAULT_POD_NAMESPACE,
    PodContainer,
};

const ABOUT: &str = "crab's command line: end turns, read their answers and checkpoints, export a \
checkpoint as an OCI image, start containers from one (fork, rollback, recover), show the host \
engine, prune what removed containers left behind, diff two points of a sandbox's history";

const AFTER_HELP: &str = "\
CONTAINER is a containerd container id, or in its place (anywhere after the command) a Kubernetes
pod's container by name: --pod POD [--pod-namespace NS] --container NAME (NS: the pod's Kubernetes
namespace, default \"default\"). Use it with the CRI's containerd namespace (--namespace k8s.io). It
names the pod's app container NAME, never the pod's sandbox (pause) container; of a restarted
container's records the newest running one. fork, rollback and recover refuse a container run by
Kubernetes (the CRI would delete a task started behind its back): export the checkpoint and run a
pod from that image with the crab runtime class instead.

An id of lowercase hex digits (Docker's) may be shortened to a unique prefix, as Docker's short
ids; a prefix several ids share is a usage error listing them. Docker runs its containers in the
containerd namespace moby (-n moby): there CONTAINER may also be a Docker container name, asked of
dockerd at $DOCKER_HOST (default unix:///var/run/docker.sock). fork, rollback and recover refuse a
container dockerd owns: export it (with --output FILE for Docker's overlay2 storage, then `docker
load -i FILE`) and `docker run --runtime io.containerd.crab.v1 REF`. A Docker container that has
exited has no containerd record: export it by name (--config if its runtime's crab config is not
the default).

T is a checkpoint's sequence number or turn id (see `checkpoints`); failed checkpoints are refused.
Containers started by fork/rollback/recover get no stdio (/dev/null) and no terminal.
Every command finds the container's store through its own runtime options (as its shim does)
unless --config says otherwise.

-o json (or --json) on turns, show, checkpoints, diff, fork, engine and prune prints one JSON
document on stdout (field names are stable, snake_case, listed in docs/crabctl.md); a failure then
prints {\"error\": {\"kind\", \"exit_code\", \"message\"}} there instead (prune: its report, with
\"failures\"), and the message on stderr as always. export and fork show their progress on stderr
when it is a terminal (--progress: always; never with -o json unless --progress).";

const GLOBAL: &str = "Global options";

/// crabctl's command line as clap sees it.
#[derive(Debug, Parser)]
#[command(
    name = "crabctl",
    version,
    about = ABOUT,
    after_help = format!("{AFTER_HELP}\n\n{EXIT_CODES_HELP}"),
    max_term_width = 100
)]
pub struct Cli {
    /// containerd's socket
    #[arg(
        long,
        short = 'a',
        global = true,
        help_heading = GLOBAL,
        value_name = "SOCK",
        env = "CONTAINERD_ADDRESS",
        default_value = "/run/containerd/containerd.sock"
    )]
    pub address: PathBuf,
    /// containerd namespace
    #[arg(
        long,
        short = 'n',
        global = true,
        help_heading = GLOBAL,
        value_name = "NS",
        env = "CONTAINERD_NAMESPACE",
        default_value = "default"
    )]
    pub namespace: String,
    /// every namespace containerd has (prune only)
    #[arg(long, short = 'A', global = true, help_heading = GLOBAL)]
    pub all_namespaces: bool,
    /// crab's config, for its state_dir (default: the one the container's runtime options
    /// name, as its shim finds it)
    #[arg(long, global = true, help_heading = GLOBAL, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

/// `--pod P [--pod-namespace NS] --container C`: a pod's container by name.
#[derive(Debug, Args)]
pub struct PodArgs {
    /// the Kubernetes pod whose container to use (with --container, in place of CONTAINER)
    #[arg(long, value_name = "POD", requires = "container", value_parser = non_empty)]
    pub pod: Option<String>,
    /// the pod's Kubernetes namespace
    #[arg(long, value_name = "NS", requires = "pod", value_parser = non_empty)]
    pub pod_namespace: Option<String>,
    /// the container's name in the pod
    #[arg(long, value_name = "NAME", requires = "pod", value_parser = non_empty)]
    pub container: Option<String>,
}

/// `-o FORMAT` / `--json`: how a list or show command prints its result.
#[derive(Debug, Args)]
pub struct OutputArgs {
    /// text (for people) or json (one document on stdout, stable field names: see docs/crabctl.md;
    /// a failure prints {"error": {...}} there instead)
    #[arg(
        long = "output",
        short = 'o',
        value_name = "FORMAT",
        value_enum,
        default_value_t = Format::Text
    )]
    pub format: Format,
    /// the same as -o json
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
}

impl OutputArgs {
    fn format(&self) -> Format {
        match self.json {
            true => Format::Json,
            false => self.format,
        }
    }
}

/// CONTAINER, or a pod's container by name.
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// container id (or --pod/--container in its place)
    #[arg(
        value_name = "CONTAINER",
        required_unless_present = "pod",
        conflicts_with = "pod"
    )]
    pub id: Option<String>,
    #[command(flatten)]
    pub pod: PodArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// End a turn of CONTAINER (Tasks.Update with io.crab/turn-end): its answer is logged and
    /// stored
    TurnEnd {
        #[command(flatten)]
        target: TargetArgs,
        /// the turn's id (default: crabctl-<milliseconds since the epoch>)
        #[arg(long, value_name = "ID")]
        turn: Option<String>,
    },
    /// List CONTAINER's turn answers, one line each (-o json: the answers whole)
    #[command(after_long_help = output::ANSWER_FIELDS)]
    Turns {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Explain one turn's answer (TURN: its sequence number or turn id; the newest of that id),
    /// printed as JSON in either format
    #[command(
        override_usage = "crabctl show [OPTIONS] CONTAINER TURN\n       \
        crabctl show [OPTIONS] --pod POD [--pod-namespace NS] --container NAME TURN",
        after_long_help = output::ANSWER_FIELDS
    )]
    Show {
        /// CONTAINER TURN, or TURN alone with --pod/--container
        #[arg(value_name = "ARGS", num_args = 1..=2, required = true)]
        args: Vec<String>,
        #[command(flatten)]
        pod: PodArgs,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// List CONTAINER's checkpoints (lineage, kinds, sizes, timings)
    #[command(after_long_help = output::CHECKPOINT_FIELDS)]
    Checkpoints {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// What changed in CONTAINER between A and B (default: the newest turn): files created,
    /// modified, deleted; processes started, ended, alive; memory; checkpoints taken
    #[command(
        override_usage = "crabctl diff [OPTIONS] CONTAINER A [B]\n       \
        crabctl diff [OPTIONS] --pod POD [--pod-namespace NS] --container NAME A [B]",
        long_about = DIFF_LONG,
        after_long_help = output::DIFF_FIELDS
    )]
    Diff {
        /// CONTAINER A [B], or A [B] alone with --pod/--container
        #[arg(value_name = "ARGS", num_args = 1..=3, required = true, value_parser = non_empty)]
        args: Vec<String>,
        #[command(flatten)]
        pod: PodArgs,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Write checkpoint T (default: the newest recovery point) as the OCI image REF into
    /// containerd (base image layers + fs layers + a layer with the CRIU image); `ctr run
    /// --runtime io.containerd.crab.v1 REF ID` starts from it
    #[command(override_usage = "crabctl export [OPTIONS] CONTAINER REF\n       \
        crabctl export [OPTIONS] --pod POD [--pod-namespace NS] --container NAME REF")]
    Export {
        /// CONTAINER REF, or REF alone with --pod/--container
        #[arg(value_name = "ARGS", num_args = 1..=2, required = true)]
        args: Vec<String>,
        #[command(flatten)]
        pod: PodArgs,
        /// the checkpoint (sequence number or turn id)
        #[arg(long, value_name = "T")]
        turn: Option<String>,
        /// the base layers and config from image BASE (in the same namespace) instead of
        /// the container's image, or for a container without one (Docker's) its rootfs's
        /// lower layers
        #[arg(long, value_name = "BASE", value_parser = non_empty)]
        base_image: Option<String>,
        /// write the image as an archive FILE (OCI layout with Docker's manifest.json: `docker
        /// load -i FILE`, `ctr images import FILE`) instead of into containerd
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
        /// only the checkpoint's files: a plain image (base and fs layers, the container's
        /// command) without the checkpoint layer, so nothing of the processes' memory; it starts
        /// the command afresh. For publishing a sandbox's files (`docker commit` of a restored
        /// sandbox carries the memory under a whiteout)
        #[arg(long)]
        files_only: bool,
        /// show the layers and bytes written on stderr even when it is no terminal
        #[arg(long)]
        progress: bool,
    },
    /// Start N new containers CONTAINER-fork-<i> from checkpoint T, concurrently (same spec,
    /// runtime and options); prints their ids
    #[command(after_long_help = output::FORK_FIELDS)]
    Fork {
        #[command(flatten)]
        target: TargetArgs,
        /// the checkpoint (sequence number or turn id)
        #[arg(long, value_name = "T")]
        at: String,
        /// how many forks
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        count: u32,
        /// mark the forks' processes for the kernel's same-page merging (annotation
        /// io.crab/merge-memory): while the host's ksmd runs, the pages the forks hold alike
        /// are kept once
        #[arg(long)]
        merge_memory: bool,
        /// show the forks started on stderr even when it is no terminal (or with -o json)
        #[arg(long)]
        progress: bool,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Return CONTAINER to checkpoint T, keeping its id: in place when T shares its process
    /// epoch (its files are reset, its processes keep running), else its task is killed
    /// (running execs end) and a new one starts from T
    Rollback {
        #[command(flatten)]
        target: TargetArgs,
        /// the checkpoint (sequence number or turn id)
        #[arg(long, value_name = "T")]
        to: String,
        /// recreate the container from T even when its files could be reset in place
        #[arg(long)]
        recreate: bool,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// After a crash (its processes, shim or containerd killed): like rollback to
    /// CONTAINER's newest recovery point
    Recover {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// The lineages with checkpoints on this node (in the namespace): each one's stores and
    /// its newest recovery point, the one a container of it created with io.crab/resume:
    /// newest starts from
    Lineages {
        /// only this lineage
        #[arg(value_name = "LINEAGE")]
        lineage: Option<String>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Off-node replication ([replication] registry) per lineage: each store's newest
    /// checkpoint, the newest replicated, the lag, bytes sent and skipped, the last error
    Replication {
        /// only this lineage
        #[arg(value_name = "LINEAGE")]
        lineage: Option<String>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// The host engine that schedules every shim's checkpoint jobs ([engine] root of the
    /// config): who holds its slots, the queue (urgent first), cumulative stats
    #[command(after_long_help = output::ENGINE_FIELDS)]
    Engine {
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Remove the checkpoint stores and internal images (crab.local/checkpoint/NS/ID:SEQ) of
    /// containers that have no container record any more
    #[command(long_about = PRUNE_LONG, after_long_help = output::PRUNE_FIELDS)]
    Prune {
        /// remove nothing, say what would go
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// crab's host-level figures (turns, checkpoints by kind and outcome, bytes, latencies,
    /// the engine, restores) in the OpenMetrics text format, from every store of the config's
    /// state_dir: print once (node-exporter's textfile collector) or serve them (--listen)
    #[command(long_about = crate::metrics::LONG_ABOUT)]
    Metrics(crate::metrics::MetricsArgs),
    /// Print a completion script for SHELL to stdout (e.g. `crabctl completions bash >
    /// /etc/bash_completion.d/crabctl`)
    Completions {
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },
}

const PRUNE_LONG: &str = "\
Remove the checkpoint stores and the internal images (crab.local/checkpoint/NS/ID:SEQ) of
containers that have no container record any more (a record without a task keeps them: recover
needs them); prints each with its size and a total.

Looks in --config's state_dir if given, else in the default config's and in those of the configs
the namespace's existing crab containers name (a state_dir no remaining container names needs
--config). Leaves alone and reports: symlinks (never followed), entries that are not crab stores,
stores changed in the last 60 s, stores in use, images a container still uses. --all-namespaces
(-A): every namespace containerd has. A state_dir must be this containerd's alone: another
containerd's containers look gone from here.";

const DIFF_LONG: &str = "\
What changed in CONTAINER's sandbox between two points of its history, like `git diff --stat`:
files created, modified and deleted; processes started (and still running), ended, started and
ended again, alive throughout; memory changed; the checkpoints taken on the way and the layers
they added. It is derived from what the store recorded: the inspector's turn answers composed
turn by turn, and the checkpoint manifests.

A and B are checkpoints' sequence numbers (as `checkpoints` lists them) or turn ids: the state
right after that turn ended (an origin checkpoint, `created` or `restored`: its task's start).
B defaults to the newest turn. A must not be newer than B (refused, exit 4: swap them); a point
that is neither a checkpoint nor a turn is not found (exit 3, listing those there are). A diff
across a rollback or recovery is refused (the turns before it were undone): diff from the
restored checkpoint on. A turn the inspector could not fully observe makes the diff
incomplete, and it says so.";

/// The global options every command shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Global {
    pub address: PathBuf,
    pub namespace: String,
    pub config: Option<PathBuf>,
    pub all_namespaces: bool,
}

/// The container a command works on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Id(String),
    Pod(PodContainer),
}

/// One command with its arguments, as the commands take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    TurnEnd {
        target: Target,
        turn: Option<String>,
    },
    Turns {
        target: Target,
        format: Format,
    },
    Show {
        target: Target,
        turn: String,
        format: Format,
    },
    Checkpoints {
        target: Target,
        format: Format,
    },
    Diff {
        target: Target,
        from: String,
        to: Option<String>,
        format: Format,
    },
    Export {
        target: Target,
        turn: Option<String>,
        reference: String,
        base_image: Option<String>,
        output: Option<PathBuf>,
        files_only: bool,
        progress: bool,
    },
    Fork {
        target: Target,
        at: String,
        count: usize,
        merge_memory: bool,
        format: Format,
        progress: bool,
    },
    Rollback {
        target: Target,
        to: String,
        recreate: bool,
        format: Format,
    },
    Recover {
        target: Target,
    },
    Lineages {
        lineage: Option<String>,
        format: Format,
    },
    Replication {
        lineage: Option<String>,
        format: Format,
    },
    Engine {
        format: Format,
    },
    Prune {
        dry_run: bool,
        format: Format,
    },
    Metrics(crate::metrics::MetricsArgs),
    Completions {
        shell: clap_complete::Shell,
    },
}

impl Request {
    /// The container the request names, if it names one.
    pub fn target(&self) -> Option<&Target> {
        match self {
            Request::TurnEnd { target, .. }
            | Request::Turns { target, .. }
            | Request::Show { target, .. }
            | Request::Checkpoints { target, .. }
            | Request::Diff { target, .. }
            | Request::Export { target, .. }
            | Request::Fork { target, .. }
            | Request::Rollback { target, .. }
            | Request::Recover { target } => Some(target),
            Request::Engine { .. }
            | Request::Lineages { .. }
            | Request::Replication { .. }
            | Request::Prune { .. }
            | Request::Metrics(_)
            | Request::Completions { .. } => None,
        }
    }

    /// How the request's result (or failure) is printed.
    pub fn format(&self) -> Format {
        match self {
            Request::Turns { format, .. }
            | Request::Show { format, .. }
            | Request::Checkpoints { format, .. }
            | Request::Diff { format, .. }
            | Request::Fork { format, .. }
            | Request::Rollback { format, .. }
            | Request::Engine { format }
            | Request::Lineages { format, .. }
            | Request::Replication { format, .. }
            | Request::Prune { format, .. } => *format,
            Request::TurnEnd { .. }
            | Request::Export { .. }
            | Request::Recover { .. }
            | Request::Metrics(_)
            | Request::Completions { .. } => Format::Text,
        }
    }
}

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    pub global: Global,
    pub request: Request,
}

/// Parses crabctl's arguments (the first is the program name). A usage error, `--help` and
/// `--version` come back as clap's error, whose `exit()` prints them and exits (2 for a usage
/// error, 0 for help and version).
pub fn parse<I, T>(args: I) -> Result<Invocation, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let given_on_command_line =
        |m: &ArgMatches| m.value_source("namespace") == Some(ValueSource::CommandLine);
    let namespace_given = given_on_command_line(&matches)
        || matches
            .subcommand()
            .is_some_and(|(_, sub)| given_on_command_line(sub));
    if cli.all_namespaces && namespace_given {
        return Err(usage("--namespace and --all-namespaces exclude each other"));
    }
    if cli.all_namespaces && !matches!(cli.command, Command::Prune { .. }) {
        return Err(usage("--all-namespaces is for prune only"));
    }
    let request = match cli.command {
        Command::TurnEnd { target, turn } => Request::TurnEnd {
            target: target.into_target(),
            turn,
        },
        Command::Turns { target, out } => Request::Turns {
            target: target.into_target(),
            format: out.format(),
        },
        Command::Show { args, pod, out } => {
            let (target, [turn]) = split_target("show", "CONTAINER TURN", args, pod)?;
            Request::Show {
                target,
                turn,
                format: out.format(),
            }
        }
        Command::Checkpoints { target, out } => Request::Checkpoints {
            target: target.into_target(),
            format: out.format(),
        },
        Command::Diff { args, pod, out } => {
            let (target, from, to) = split_diff(args, pod)?;
            Request::Diff {
                target,
                from,
                to,
                format: out.format(),
            }
        }
        Command::Export {
            args,
            pod,
            turn,
            base_image,
            output,
            files_only,
            progress,
        } => {
            let (target, [reference]) = split_target("export", "CONTAINER REF", args, pod)?;
            Request::Export {
                target,
                turn,
                reference,
                base_image,
                output,
                files_only,
                progress,
            }
        }
        Command::Fork {
            target,
            at,
            count,
            merge_memory,
            progress,
            out,
        } => Request::Fork {
            target: target.into_target(),
            at,
            count: count as usize,
            merge_memory,
            format: out.format(),
            progress,
        },
        Command::Rollback {
            target,
            to,
            recreate,
            out,
        } => Request::Rollback {
            target: target.into_target(),
            to,
            recreate,
            format: out.format(),
        },
        Command::Recover { target } => Request::Recover {
            target: target.into_target(),
        },
        Command::Engine { out } => Request::Engine {
            format: out.format(),
        },
        Command::Lineages { lineage, out } => Request::Lineages {
            lineage,
            format: out.format(),
        },
        Command::Replication { lineage, out } => Request::Replication {
            lineage,
            format: out.format(),
        },
        Command::Prune { dry_run, out } => Request::Prune {
            dry_run,
            format: out.format(),
        },
        Command::Metrics(args) => Request::Metrics(args),
        Command::Completions { shell } => Request::Completions { shell },
    };
    Ok(Invocation {
        global: Global {
            address: cli.address,
            namespace: cli.namespace,
            config: cli.config,
            all_namespaces: cli.all_namespaces,
        },
        request,
    })
}

/// Writes the completion script for `shell` to `out`.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn std::io::Write) {
    clap_complete::generate(shell, &mut Cli::command(), "crabctl", out);
}

fn usage(message: &str) -> clap::Error {
    Cli::command().error(clap::error::ErrorKind::ArgumentConflict, message)
}

fn non_empty(s: &str) -> Result<String, String> {
    match s.is_empty() {
        true => Err("a name cannot be empty".into()),
        false => Ok(s.to_string()),
    }
}

impl PodArgs {
    fn into_pod_container(self) -> Option<PodContainer> {
        Some(PodContainer {
            pod: self.pod?,
            pod_namespace: self
                .pod_namespace
                .unwrap_or_else(|| DEFAULT_POD_NAMESPACE.to_string()),
            container: self.container?,
        })
    }
}

impl TargetArgs {
    /// clap has checked that exactly one of CONTAINER and --pod/--container is given.
    fn into_target(self) -> Target {
        match (self.id, self.pod.into_pod_container()) {
            (Some(id), _) => Target::Id(id),
            (None, Some(pod)) => Target::Pod(pod),
            (None, None) => unreachable!("clap requires CONTAINER or --pod and --container"),
        }
    }
}

/// `CONTAINER X` or, with --pod/--container, `X` alone: the target and X.
fn split_target(
    command: &str,
    names: &str,
    mut args: Vec<String>,
    pod: PodArgs,
) -> Result<(Target, [String; 1]), clap::Error> {
    let wrong = |what: &str| {
        usage(&format!(
            "{command} takes {names}, or --pod POD --container NAME in place of CONTAINER: {what}"
        ))
    };
    match (pod.into_pod_container(), args.len()) {
        (Some(pod), 1) => Ok((Target::Pod(pod), [args.remove(0)])),
        (None, 2) => {
            let x = args.remove(1);
            Ok((Target::Id(args.remove(0)), [x]))
        }
        (Some(_), _) => Err(wrong("a CONTAINER besides --pod and --container")),
        (None, _) => Err(wrong("one argument missing")),
    }
}

/// `CONTAINER A [B]` or, with --pod/--container, `A [B]`: the target, A and B.
fn split_diff(
    mut args: Vec<String>,
    pod: PodArgs,
) -> Result<(Target, String, Option<String>), clap::Error> {
    let wrong = |what: &str| {
        usage(&format!(
            "diff takes CONTAINER A [B], or --pod POD --container NAME in place of CONTAINER: \
             {what}"
        ))
    };
    let target = match (pod.into_pod_container(), args.len()) {
        (Some(pod), 1 | 2) => Target::Pod(pod),
        (None, 2 | 3) => Target::Id(args.remove(0)),
        (Some(_), _) => return Err(wrong("a CONTAINER besides --pod and --container")),
        (None, _) => return Err(wrong("A missing")),
    };
    let to = (args.len() == 2).then(|| args.remove(1));
    Ok((target, args.remove(0), to))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_line(line: &str) -> Result<Invocation, clap::Error> {
        parse(std::iter::once("crabctl").chain(line.split_whitespace()))
    }

    fn request(line: &str) -> Request {
        match parse_line(line) {
            Ok(i) => i.request,
            Err(e) => panic!("{line}: {e}"),
        }
    }

    fn id(s: &str) -> Target {
        Target::Id(s.into())
    }

    fn pod(pod: &str, ns: &str, container: &str) -> Target {
        Target::Pod(PodContainer {
            pod: pod.into(),
            pod_namespace: ns.into(),
            container: container.into(),
        })
    }

    fn s(v: &str) -> String {
        v.to_string()
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_command_parses_as_before() {
        let cases = [
            (
                "turn-end c1",
                Request::TurnEnd {
                    target: id("c1"),
                    turn: None,
                },
            ),
            (
                "turn-end c1 --turn t7",
                Request::TurnEnd {
                    target: id("c1"),
                    turn: Some(s("t7")),
                },
            ),
            (
                "turns c1",
                Request::Turns {
                    target: id("c1"),
                    format: Format::Text,
                },
            ),
            (
                "show c1 3",
                Request::Show {
                    target: id("c1"),
                    turn: s("3"),
                    format: Format::Text,
                },
            ),
            (
                "checkpoints c1",
                Request::Checkpoints {
                    target: id("c1"),
                    format: Format::Text,
                },
            ),
            (
                "export c1 localhost/x:1",
                Request::Export {
                    target: id("c1"),
                    turn: None,
                    reference: s("localhost/x:1"),
                    base_image: None,
                    output: None,
                    files_only: false,
                    progress: false,
                },
            ),
            (
                "export c1 --turn t1 localhost/x:1",
                Request::Export {
                    target: id("c1"),
                    turn: Some(s("t1")),
                    reference: s("localhost/x:1"),
                    base_image: None,
                    output: None,
                    files_only: false,
                    progress: false,
                },
            ),
            (
                "export c1 localhost/x:1 --turn t1",
                Request::Export {
                    target: id("c1"),
                    turn: Some(s("t1")),
                    reference: s("localhost/x:1"),
                    base_image: None,
                    output: None,
                    files_only: false,
                    progress: false,
                },
            ),
            (
                "fork c1 --at t1 --count 4",
                Request::Fork {
                    target: id("c1"),
                    at: s("t1"),
                    count: 4,
                    merge_memory: false,
                    format: Format::Text,
                    progress: false,
                },
            ),
            (
                "fork c1 --count 4 --at t1 --merge-memory",
                Request::Fork {
                    target: id("c1"),
                    at: s("t1"),
                    count: 4,
                    merge_memory: true,
                    format: Format::Text,
                    progress: false,
                },
            ),
            (
                "rollback c1 --to 2",
                Request::Rollback {
                    target: id("c1"),
                    to: s("2"),
                    recreate: false,
                    format: Format::Text,
                },
            ),
            (
                "rollback c1 --to 2 --recreate -o json",
                Request::Rollback {
                    target: id("c1"),
                    to: s("2"),
                    recreate: true,
                    format: Format::Json,
                },
            ),
            (
                "export 3f4e c1/x:1 --base-image busybox:1 -o /tmp/x.tar",
                Request::Export {
                    target: id("3f4e"),
                    turn: None,
                    reference: s("c1/x:1"),
                    base_image: Some(s("busybox:1")),
                    output: Some("/tmp/x.tar".into()),
                    files_only: false,
                    progress: false,
                },
            ),
            (
                "-n moby export agent-1 --output x.tar localhost/x --turn 2",
                Request::Export {
                    target: id("agent-1"),
                    turn: Some(s("2")),
                    reference: s("localhost/x"),
                    base_image: None,
                    output: Some("x.tar".into()),
                    files_only: false,
                    progress: false,
                },
            ),
            ("recover c1", Request::Recover { target: id("c1") }),
            (
                "engine",
                Request::Engine {
                    format: Format::Text,
                },
            ),
            (
                "engine --json",
                Request::Engine {
                    format: Format::Json,
                },
            ),
            (
                "engine -o json",
                Request::Engine {
                    format: Format::Json,
                },
            ),
            (
                "prune",
                Request::Prune {
                    dry_run: false,
                    format: Format::Text,
                },
            ),
            (
                "prune --dry-run --json",
                Request::Prune {
                    dry_run: true,
                    format: Format::Json,
                },
            ),
            (
                "completions bash",
                Request::Completions {
                    shell: clap_complete::Shell::Bash,
                },
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(request(line), expected, "{line}");
        }
    }

    #[test]
    fn pod_and_container_stand_for_container_anywhere_after_the_command() {
        let agent = || pod("agent", "default", "app");
        let cases = [
            (
                "show --pod agent --container app 3",
                Request::Show {
                    target: agent(),
                    turn: s("3"),
                    format: Format::Text,
                },
            ),
            (
                "show 3 --container app --pod agent",
                Request::Show {
                    target: agent(),
                    turn: s("3"),
                    format: Format::Text,
                },
            ),
            (
                "turn-end --turn t1 --container app --pod-namespace tools --pod agent",
                Request::TurnEnd {
                    target: pod("agent", "tools", "app"),
                    turn: Some(s("t1")),
                },
            ),
            (
                "checkpoints --pod agent --container app",
                Request::Checkpoints {
                    target: agent(),
                    format: Format::Text,
                },
            ),
            (
                "turns --container app --pod agent",
                Request::Turns {
                    target: agent(),
                    format: Format::Text,
                },
            ),
            (
                "export --pod agent --turn t1 --container app localhost/x:1",
                Request::Export {
                    target: agent(),
                    turn: Some(s("t1")),
                    reference: s("localhost/x:1"),
                    base_image: None,
                    output: None,
                    files_only: false,
                    progress: false,
                },
            ),
            (
                "fork --at t1 --pod agent --count 2 --container app",
                Request::Fork {
                    target: agent(),
                    at: s("t1"),
                    count: 2,
                    merge_memory: false,
                    format: Format::Text,
                    progress: false,
                },
            ),
            (
                "rollback --pod agent --container app --to t1",
                Request::Rollback {
                    target: agent(),
                    to: s("t1"),
                    recreate: false,
                    format: Format::Text,
                },
            ),
            (
                "recover --pod agent --container app",
                Request::Recover { target: agent() },
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(request(line), expected, "{line}");
        }
    }

    #[test]
    fn output_formats_diff_and_progress_parse() {
        let json = Format::Json;
        let cases = [
            (
                "turns c1 -o json",
                Request::Turns {
                    target: id("c1"),
                    format: json,
                },
            ),
            (
                "turns --json c1",
                Request::Turns {
                    target: id("c1"),
                    format: json,
                },
            ),
            (
                "show c1 t1 --output json",
                Request::Show {
                    target: id("c1"),
                    turn: s("t1"),
                    format: json,
                },
            ),
            (
                "checkpoints c1 -o text",
                Request::Checkpoints {
                    target: id("c1"),
                    format: Format::Text,
                },
            ),
            (
                "diff c1 2",
                Request::Diff {
                    target: id("c1"),
                    from: s("2"),
                    to: None,
                    format: Format::Text,
                },
            ),
            (
                "diff c1 t1 t3 -o json",
                Request::Diff {
                    target: id("c1"),
                    from: s("t1"),
                    to: Some(s("t3")),
                    format: json,
                },
            ),
            (
                "diff --pod agent --container app t1 --json",
                Request::Diff {
                    target: pod("agent", "default", "app"),
                    from: s("t1"),
                    to: None,
                    format: json,
                },
            ),
            (
                "diff t1 4 --pod agent --container app",
                Request::Diff {
                    target: pod("agent", "default", "app"),
                    from: s("t1"),
                    to: Some(s("4")),
                    format: Format::Text,
                },
            ),
            (
                "fork c1 --at 2 --count 3 -o json --progress",
                Request::Fork {
                    target: id("c1"),
                    at: s("2"),
                    count: 3,
                    merge_memory: false,
                    format: json,
                    progress: true,
                },
            ),
            (
                "export c1 x:1 -o x.tar --progress",
                Request::Export {
                    target: id("c1"),
                    turn: None,
                    reference: s("x:1"),
                    base_image: None,
                    output: Some("x.tar".into()),
                    files_only: false,
                    progress: true,
                },
            ),
            (
                "export c1 x:1 --files-only",
                Request::Export {
                    target: id("c1"),
                    turn: None,
                    reference: s("x:1"),
                    base_image: None,
                    output: None,
                    files_only: true,
                    progress: false,
                },
            ),
        ];
        for (line, expected) in cases {
            let r = request(line);
            assert_eq!(r.format(), expected.format(), "{line}");
            assert_eq!(r, expected, "{line}");
        }
        // Commands without a JSON document print text.
        assert_eq!(request("recover c1").format(), Format::Text);
        assert_eq!(request("export c1 x:1 -o json").format(), Format::Text);
        for bad in [
            "turns c1 -o yaml",
            "turns c1 -o json --json",
            "turns c1 -o text --json",
            "diff c1",
            "diff c1 1 2 3",
            "diff c1 1 \"\"",
            "diff --pod agent --container app",
            "diff --pod agent --container app 1 2 3",
            "turn-end c1 -o json",
            "rollback c1 --to 1 --json -o text",
            "rollback c1 --to 1 --recreate=no",
            "turns c1 --progress",
        ] {
            let e = parse(std::iter::once("crabctl".to_string()).chain(shell_words(bad)))
                .expect_err(bad);
            assert_eq!(
                e.exit_code(),
                i32::from(crate::error::EXIT_USAGE),
                "{bad}: {e}"
            );
        }
    }

    /// Whitespace-separated words, `""` standing for an empty one.
    fn shell_words(line: &str) -> Vec<String> {
        line.split_whitespace()
            .map(|w| {
                if w == "\"\"" {
                    String::new()
                } else {
                    w.to_string()
                }
            })
            .collect()
    }

    #[test]
    fn global_options_and_their_defaults() {
        // Flags given win over the environment; the defaults apply without either.
        let i =
            parse_line("--address /tmp/c.sock -n k8s.io --config /etc/x.toml turns c1").unwrap();
        assert_eq!(
            i.global,
            Global {
                address: "/tmp/c.sock".into(),
                namespace: s("k8s.io"),
                config: Some("/etc/x.toml".into()),
                all_namespaces: false,
            }
        );
        // Also after the command (a superset of before).
        let i = parse_line("turns c1 --namespace k8s.io").unwrap();
        assert_eq!(i.global.namespace, "k8s.io");
        let i = parse_line("-A prune --dry-run").unwrap();
        assert!(i.global.all_namespaces);
        let i = parse_line("prune --all-namespaces").unwrap();
        assert!(i.global.all_namespaces);
    }

    #[test]
    fn usage_errors_exit_2() {
        for bad in [
            "",
            "frobnicate",
            "turns",
            "turns c1 c2",
            "show c1",
            "show c1 2 3",
            "export c1",
            "fork c1 --at t1",
            "fork c1 --at t1 --count 0",
            "fork c1 --at t1 --count -1",
            "fork c1 --at t1 --count many",
            "rollback c1",
            "engine --dry-run",
            "export c1 x --base-image",
            "export c1 x --base-image=",
            "export c1 x --output",
            "--bogus turns c1",
            "--namespace x -A prune",
            "-A turns c1",
            "--address",
            "completions nosh",
            // --pod/--container in place of CONTAINER: both or neither, never both kinds.
            "turns --pod agent",
            "turns --container app",
            "turns --pod --container app",
            "turns --pod a --pod b --container c",
            "turns --pod-namespace x c1",
            "turns c1 --pod agent --container app",
            "show c1 3 --pod agent --container app",
            "export --pod agent --container app",
            "engine --pod agent --container app",
            "prune --pod agent --container app",
        ] {
            match parse_line(bad) {
                Ok(i) => panic!("{bad:?} parsed: {i:?}"),
                Err(e) => assert_eq!(
                    e.exit_code(),
                    i32::from(crate::error::EXIT_USAGE),
                    "{bad:?}: {e}"
                ),
            }
        }
        // Help and version are no errors.
        for ok in ["--help", "help", "turns --help", "--version"] {
            let e = parse_line(ok).unwrap_err();
            assert_eq!(e.exit_code(), 0, "{ok}");
        }
    }

    #[test]
    fn help_documents_the_exit_statuses() {
        let help = Cli::command().render_long_help().to_string();
        for needle in [
            "Exit status:",
            "3  not found",
            "4  refused",
            "--pod POD",
            "namespace moby",
            "DOCKER_HOST",
            "a unique prefix",
        ] {
            assert!(help.contains(needle), "{needle}: {help}");
        }
    }

    #[test]
    fn completions_are_generated_for_every_command() {
        let mut out = Vec::new();
        completions(clap_complete::Shell::Bash, &mut out);
        let script = String::from_utf8(out).unwrap();
        for word in [
            "turn-end",
            "checkpoints",
            "rollback",
            "--pod-namespace",
            "--dry-run",
        ] {
            assert!(script.contains(word), "{word} missing");
        }
    }
}
