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

use crate::{error::EXIT_CODES_HELP, pod::DEFAULT_POD_NAMESPACE, PodContainer};

const ABOUT: &str = "crab's command line: end turns, read their answers and checkpoints, export a \
checkpoint as an OCI image, start containers from one (fork, rollback, recover), show the host \
engine, prune what removed containers left behind";

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
unless --config says otherwise.";

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
    /// List CONTAINER's turn answers, one line each
    Turns {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// Explain one turn's answer (TURN: its sequence number or turn id)
    #[command(override_usage = "crabctl show [OPTIONS] CONTAINER TURN\n       \
        crabctl show [OPTIONS] --pod POD [--pod-namespace NS] --container NAME TURN")]
    Show {
        /// CONTAINER TURN, or TURN alone with --pod/--container
        #[arg(value_name = "ARGS", num_args = 1..=2, required = true)]
        args: Vec<String>,
        #[command(flatten)]
        pod: PodArgs,
    },
    /// List CONTAINER's checkpoints (lineage, kinds, sizes, timings)
    Checkpoints {
        #[command(flatten)]
        target: TargetArgs,
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
    },
    /// Start N new containers CONTAINER-fork-<i> from checkpoint T, concurrently (same spec,
    /// runtime and options); prints their ids
    Fork {
        #[command(flatten)]
        target: TargetArgs,
        /// the checkpoint (sequence number or turn id)
        #[arg(long, value_name = "T")]
        at: String,
        /// how many forks
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        count: u32,
    },
    /// Return CONTAINER to checkpoint T, keeping its id: its task is killed (running execs
    /// end) and a new one starts from T
    Rollback {
        #[command(flatten)]
        target: TargetArgs,
        /// the checkpoint (sequence number or turn id)
        #[arg(long, value_name = "T")]
        to: String,
    },
    /// After a crash (its processes, shim or containerd killed): like rollback to
    /// CONTAINER's newest recovery point
    Recover {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// The host engine that schedules every shim's checkpoint jobs ([engine] root of the
    /// config): who holds its slots, the queue (urgent first), cumulative stats
    Engine {
        /// the snapshot as JSON
        #[arg(long)]
        json: bool,
    },
    /// Remove the checkpoint stores and internal images (crab.local/checkpoint/NS/ID:SEQ) of
    /// containers that have no container record any more
    #[command(long_about = PRUNE_LONG)]
    Prune {
        /// remove nothing, say what would go
        #[arg(long)]
        dry_run: bool,
    },
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
    },
    Show {
        target: Target,
        turn: String,
    },
    Checkpoints {
        target: Target,
    },
    Export {
        target: Target,
        turn: Option<String>,
        reference: String,
        base_image: Option<String>,
        output: Option<PathBuf>,
    },
    Fork {
        target: Target,
        at: String,
        count: usize,
    },
    Rollback {
        target: Target,
        to: String,
    },
    Recover {
        target: Target,
    },
    Engine {
        json: bool,
    },
    Prune {
        dry_run: bool,
    },
    Completions {
        shell: clap_complete::Shell,
    },
}

impl Request {
    /// The container the request names, if it names one.
    pub fn target(&self) -> Option<&Target> {
        match self {
            Request::TurnEnd { target, .. }
            | Request::Turns { target }
            | Request::Show { target, .. }
            | Request::Checkpoints { target }
            | Request::Export { target, .. }
            | Request::Fork { target, .. }
            | Request::Rollback { target, .. }
            | Request::Recover { target } => Some(target),
            Request::Engine { .. } | Request::Prune { .. } | Request::Completions { .. } => None,
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
        Command::Turns { target } => Request::Turns {
            target: target.into_target(),
        },
        Command::Show { args, pod } => {
            let (target, [turn]) = split_target("show", "CONTAINER TURN", args, pod)?;
            Request::Show { target, turn }
        }
        Command::Checkpoints { target } => Request::Checkpoints {
            target: target.into_target(),
        },
        Command::Export {
            args,
            pod,
            turn,
            base_image,
            output,
        } => {
            let (target, [reference]) = split_target("export", "CONTAINER REF", args, pod)?;
            Request::Export {
                target,
                turn,
                reference,
                base_image,
                output,
            }
        }
        Command::Fork { target, at, count } => Request::Fork {
            target: target.into_target(),
            at,
            count: count as usize,
        },
        Command::Rollback { target, to } => Request::Rollback {
            target: target.into_target(),
            to,
        },
        Command::Recover { target } => Request::Recover {
            target: target.into_target(),
        },
        Command::Engine { json } => Request::Engine { json },
        Command::Prune { dry_run } => Request::Prune { dry_run },
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
            ("turns c1", Request::Turns { target: id("c1") }),
            (
                "show c1 3",
                Request::Show {
                    target: id("c1"),
                    turn: s("3"),
                },
            ),
            ("checkpoints c1", Request::Checkpoints { target: id("c1") }),
            (
                "export c1 localhost/x:1",
                Request::Export {
                    target: id("c1"),
                    turn: None,
                    reference: s("localhost/x:1"),
                    base_image: None,
                    output: None,
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
                },
            ),
            (
                "fork c1 --at t1 --count 4",
                Request::Fork {
                    target: id("c1"),
                    at: s("t1"),
                    count: 4,
                },
            ),
            (
                "fork c1 --count 4 --at t1",
                Request::Fork {
                    target: id("c1"),
                    at: s("t1"),
                    count: 4,
                },
            ),
            (
                "rollback c1 --to 2",
                Request::Rollback {
                    target: id("c1"),
                    to: s("2"),
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
                },
            ),
            ("recover c1", Request::Recover { target: id("c1") }),
            ("engine", Request::Engine { json: false }),
            ("engine --json", Request::Engine { json: true }),
            ("prune", Request::Prune { dry_run: false }),
            ("prune --dry-run", Request::Prune { dry_run: true }),
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
                },
            ),
            (
                "show 3 --container app --pod agent",
                Request::Show {
                    target: agent(),
                    turn: s("3"),
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
                Request::Checkpoints { target: agent() },
            ),
            (
                "turns --container app --pod agent",
                Request::Turns { target: agent() },
            ),
            (
                "export --pod agent --turn t1 --container app localhost/x:1",
                Request::Export {
                    target: agent(),
                    turn: Some(s("t1")),
                    reference: s("localhost/x:1"),
                    base_image: None,
                    output: None,
                },
            ),
            (
                "fork --at t1 --pod agent --count 2 --container app",
                Request::Fork {
                    target: agent(),
                    at: s("t1"),
                    count: 2,
                },
            ),
            (
                "rollback --pod agent --container app --to t1",
                Request::Rollback {
                    target: agent(),
                    to: s("t1"),
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
