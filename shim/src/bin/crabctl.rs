//! crabctl: crab's command line for people and agent harnesses.
//!
//!   crabctl [GLOBAL] turn-end CONTAINER [--turn ID]   end a turn (Tasks.Update with io.crab/turn-end)
//!   crabctl [GLOBAL] turns CONTAINER                  list the turn answers, one line each
//!   crabctl [GLOBAL] show CONTAINER TURN              explain one turn's answer (by seq or turn id)
//!   crabctl [GLOBAL] checkpoints CONTAINER            list the checkpoint lineage
//!   crabctl [GLOBAL] export CONTAINER [--turn T] REF  a checkpoint as OCI image REF in containerd
//!   crabctl [GLOBAL] fork CONTAINER --at T --count N  N new containers from checkpoint T
//!   crabctl [GLOBAL] rollback CONTAINER --to T        the container back at checkpoint T (same id)
//!   crabctl [GLOBAL] recover CONTAINER                the container back at its last recovery point
//!   crabctl [GLOBAL] engine [--json]                  the host engine: slots, queue, stats
//!   crabctl [GLOBAL] prune [--dry-run]                stores and internal images of containers
//!                                                     that are gone (`--all-namespaces`: of all)
//!
//! CONTAINER is a containerd container id, or a Kubernetes pod's container by name:
//! `--pod P [--pod-namespace NS] --container C` in its place (anywhere after the command),
//! resolved through the CRI's container records (`crab_shim::ctl::pod`).
//!
//! Every command finds the container's store through its own runtime options (as its shim
//! does) unless --config says otherwise; their logic is in `crab_shim::ctl`.
//!
//! GLOBAL: --address SOCK (default /run/containerd/containerd.sock, or $CONTAINERD_ADDRESS),
//!         --namespace NS (default "default", or $CONTAINERD_NAMESPACE), or for prune
//!         --all-namespaces (-A),
//!         --config PATH (crab's config, for its state directory; default: as the shim finds it).
//!
//! Exit status: 0 on success, 1 on failure (with a message on stderr), 2 on a usage error.

use std::{path::PathBuf, process::ExitCode};

use crab_runtime_config::Config;
use crab_shim::ctl::{pod::DEFAULT_POD_NAMESPACE, Client, Ctl, PodContainer};

struct Global {
    address: PathBuf,
    namespace: String,
    config: Option<PathBuf>,
    all_namespaces: bool,
}

const USAGE: &str =
    "usage: crabctl [--address SOCK] [--namespace NS | --all-namespaces] [--config PATH] <command>
commands:
  turn-end CONTAINER [--turn ID]   end a turn of CONTAINER (its answer is logged and stored)
  turns CONTAINER                  list CONTAINER's turn answers
  show CONTAINER TURN              explain one turn (TURN: sequence number or turn id)
  checkpoints CONTAINER            list CONTAINER's checkpoints (lineage, kinds, sizes, timings)
  export CONTAINER [--turn T] REF  write checkpoint T (default: the newest recovery point) as the
                                   OCI image REF into containerd (base image layers + fs layers +
                                   a layer with the CRIU image); `ctr run --runtime
                                   io.containerd.crab.v1 REF ID` starts from it
  fork CONTAINER --at T --count N  start N new containers CONTAINER-fork-<i> from checkpoint T,
                                   concurrently (same spec, runtime and options); prints their ids
  rollback CONTAINER --to T        return CONTAINER to checkpoint T, keeping its id: its task is
                                   killed (running execs end) and a new one starts from T
  recover CONTAINER                after a crash (its processes, shim or containerd killed): like
                                   rollback to its newest recovery point
  engine [--json]                  the host engine that schedules every shim's checkpoint jobs
                                   ([engine] root of the config): who holds its slots, the queue
                                   (urgent first), cumulative stats (jobs, waits, bytes)
  prune [--dry-run]                remove the checkpoint stores and the internal images
                                   (crab.local/checkpoint/NS/ID:SEQ) of containers that have no
                                   container record any more (a record without a task keeps
                                   them: recover needs them); prints each with its size and a
                                   total. Looks in --config's state_dir if given, else in the
                                   default config's and in those of the configs the namespace's
                                   existing crab containers name (a state_dir no remaining
                                   container names needs --config). Leaves alone and reports:
                                   symlinks (never followed), entries that are not crab stores,
                                   stores changed in the last 60 s, stores in use, images a
                                   container still uses. --all-namespaces (-A): every namespace
                                   containerd has. --dry-run: remove nothing, say what would go.
                                   A state_dir must be this containerd's alone: another
                                   containerd's containers look gone from here
CONTAINER: a container id, or in its place (anywhere after the command) a Kubernetes pod's
  container by name: --pod POD [--pod-namespace NS] --container NAME (NS: the pod's Kubernetes
  namespace, default \"default\"). Use it with the CRI's containerd namespace (--namespace k8s.io).
  It names the pod's app container NAME, never the pod's sandbox (pause) container; of a
  restarted container's records the newest running one. fork, rollback and recover refuse a
  container run by Kubernetes (the CRI would delete a task started behind its back): export the
  checkpoint and run a pod from that image with the crab runtime class instead.
T: a checkpoint's sequence number or turn id (see `checkpoints`); failed checkpoints are refused.
Containers started by fork/rollback/recover get no stdio (/dev/null) and no terminal.
--config overrides the crab config the container's runtime options name (for its state_dir).";

fn usage(msg: &str) -> ExitCode {
    eprintln!("crabctl: {msg}\n{USAGE}");
    ExitCode::from(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut g = Global {
        address: std::env::var_os("CONTAINERD_ADDRESS")
            .map(PathBuf::from)
            .unwrap_or_else(|| "/run/containerd/containerd.sock".into()),
        namespace: std::env::var("CONTAINERD_NAMESPACE").unwrap_or_else(|_| "default".into()),
        config: None,
        all_namespaces: false,
    };
    let mut namespace_given = false;
    while let Some(flag) = args.first().filter(|a| a.starts_with('-')).cloned() {
        args.remove(0);
        if flag == "--help" {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        if flag == "--all-namespaces" || flag == "-A" {
            g.all_namespaces = true;
            continue;
        }
        let Some(value) = (!args.is_empty()).then(|| args.remove(0)) else {
            return usage(&format!("{flag} needs a value"));
        };
        match flag.as_str() {
            "--address" | "-a" => g.address = value.into(),
            "--namespace" | "-n" => (g.namespace, namespace_given) = (value, true),
            "--config" => g.config = Some(value.into()),
            _ => return usage(&format!("unknown option {flag}")),
        }
    }
    if g.all_namespaces && namespace_given {
        return usage("--namespace and --all-namespaces exclude each other");
    }
    if g.all_namespaces && args.first().is_some_and(|c| c != "prune") {
        return usage("--all-namespaces is for prune only");
    }
    match take_pod_container(&mut args) {
        Ok(None) => {}
        Ok(Some(target)) => {
            if !args
                .first()
                .is_some_and(|c| CONTAINER_COMMANDS.contains(&c.as_str()))
            {
                return usage(&format!(
                    "--pod and --container name a container, which `{}` does not take",
                    args.join(" ")
                ));
            }
            match resolve(&g, &target).await {
                Ok(id) => args.insert(1, id),
                Err(e) => {
                    eprintln!("crabctl: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        Err(e) => return usage(&e),
    }
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["turn-end", container] => turn_end(&g, container, None).await,
        ["turn-end", container, "--turn", id] => turn_end(&g, container, Some(id)).await,
        ["turns", container] => turns(&g, container).await,
        ["show", container, turn] => show(&g, container, turn).await,
        ["checkpoints", container] => checkpoints(&g, container).await,
        ["export", container, reference] => export(&g, container, None, reference).await,
        ["export", container, "--turn", turn, reference]
        | ["export", container, reference, "--turn", turn] => {
            export(&g, container, Some(turn), reference).await
        }
        ["fork", container, "--at", at, "--count", n]
        | ["fork", container, "--count", n, "--at", at] => match n.parse() {
            Ok(n) if n > 0 => fork(&g, container, at, n).await,
            _ => return usage(&format!("--count needs a positive number, not {n:?}")),
        },
        ["rollback", container, "--to", to] => rollback(&g, container, Some(to)).await,
        ["recover", container] => rollback(&g, container, None).await,
        ["engine"] => engine(&g, false),
        ["engine", "--json"] => engine(&g, true),
        ["prune"] => prune(&g, false).await,
        ["prune", "--dry-run"] => prune(&g, true).await,
        [] => return usage("no command"),
        _ => return usage(&format!("cannot parse `{}`", args.join(" "))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crabctl: {e}");
            ExitCode::from(1)
        }
    }
}

/// The commands that take a CONTAINER (first after the command name).
const CONTAINER_COMMANDS: [&str; 8] = [
    "turn-end",
    "turns",
    "show",
    "checkpoints",
    "export",
    "fork",
    "rollback",
    "recover",
];

/// Takes `--pod P [--pod-namespace NS] --container C` out of the command's arguments.
fn take_pod_container(args: &mut Vec<String>) -> Result<Option<PodContainer>, String> {
    let (mut pod, mut pod_namespace, mut container) = (None, None, None);
    let mut i = 1;
    while i < args.len() {
        let slot = match args[i].as_str() {
            "--pod" => &mut pod,
            "--pod-namespace" => &mut pod_namespace,
            "--container" => &mut container,
            _ => {
                i += 1;
                continue;
            }
        };
        let flag = args.remove(i);
        // No pod or container name starts with '-': that is the next option, the value missing.
        if i >= args.len() || args[i].is_empty() || args[i].starts_with('-') {
            return Err(format!("{flag} needs a value"));
        }
        if slot.replace(args.remove(i)).is_some() {
            return Err(format!("{flag} is given twice"));
        }
    }
    match (pod, container) {
        (Some(pod), Some(container)) => Ok(Some(PodContainer {
            pod,
            pod_namespace: pod_namespace.unwrap_or_else(|| DEFAULT_POD_NAMESPACE.to_string()),
            container,
        })),
        (None, None) if pod_namespace.is_none() => Ok(None),
        (Some(_), None) => {
            Err("--pod needs --container NAME (the container's name in the pod)".into())
        }
        (None, _) => Err("--container and --pod-namespace need --pod NAME".into()),
    }
}

/// The id of the container `target` names; a note about the choice goes to stderr.
async fn resolve(g: &Global, target: &PodContainer) -> Result<String, String> {
    let resolved = ctl(g)
        .await?
        .resolve_pod_container(target)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(note) = &resolved.note {
        eprintln!("crabctl: {note}");
    }
    Ok(resolved.id)
}

async fn turn_end(g: &Global, container: &str, turn: Option<&str>) -> Result<(), String> {
    let turn = match turn {
        Some(t) => t.to_string(),
        None => format!(
            "crabctl-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis()
        ),
    };
    ctl(g)
        .await?
        .client
        .end_turn(container, &turn)
        .await
        .map_err(|e| e.to_string())?;
    println!("turn {turn} of {container} ended");
    Ok(())
}

/// The directory of `container`'s store and turn answers. With --config no containerd is
/// needed; without, the container's runtime options say which config its shim used.
async fn sandbox_dir(g: &Global, container: &str) -> Result<PathBuf, String> {
    match &g.config {
        Some(path) => {
            let config = Config::load(path).map_err(|e| e.to_string())?;
            Ok(crab_shim::turns::sandbox_dir(
                &config.store.state_dir,
                &g.namespace,
                container,
            ))
        }
        None => ctl(g)
            .await?
            .sandbox_dir(container)
            .await
            .map_err(|e| e.to_string()),
    }
}

async fn ctl(g: &Global) -> Result<Ctl, String> {
    let client = Client::connect(&g.address, &g.namespace)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Ctl::new(client, g.config.clone()))
}

async fn export(
    g: &Global,
    container: &str,
    turn: Option<&str>,
    reference: &str,
) -> Result<(), String> {
    let exported = ctl(g)
        .await?
        .export(container, turn, reference)
        .await
        .map_err(|e| e.to_string())?;
    println!("exported {}", exported.summary());
    Ok(())
}

async fn fork(g: &Global, container: &str, at: &str, count: usize) -> Result<(), String> {
    let forked = ctl(g)
        .await?
        .fork(container, at, count)
        .await
        .map_err(|e| e.to_string())?;
    for f in &forked.forks {
        println!("{}", f.id);
    }
    let s = &forked.exported.source;
    eprintln!(
        "crabctl: started {} forks of {} from checkpoint {} (turn {:?}) in {}",
        forked.forks.len(),
        container,
        s.seq,
        s.turn_id,
        forked.phases
    );
    Ok(())
}

/// rollback (`to` given) and recover (the newest recovery point).
async fn rollback(g: &Global, container: &str, to: Option<&str>) -> Result<(), String> {
    let r = ctl(g)
        .await?
        .rollback(container, to)
        .await
        .map_err(|e| e.to_string())?;
    let s = &r.exported.source;
    let verb = if to.is_some() {
        "rolled back"
    } else {
        "recovered"
    };
    println!(
        "{verb} {container} to checkpoint {} (turn {:?}, {}) in {}: pid {}, image {}",
        s.seq,
        s.turn_id,
        format!("{:?}", r.exported.kind).to_lowercase(),
        r.phases,
        r.restarted.pid,
        r.exported.reference
    );
    if !r.had_task {
        println!("{container} had no task (its shim or processes were gone)");
    }
    if !r.execs_ended.is_empty() {
        println!(
            "ended {} running execs with the old task (killed): {}",
            r.execs_ended.len(),
            r.execs_ended.join(", ")
        );
    }
    Ok(())
}

fn engine(g: &Global, json: bool) -> Result<(), String> {
    let (config, _) = Config::load_or_default(g.config.as_deref()).map_err(|e| e.to_string())?;
    let snapshot = crab_shim::engine::Engine::new(&config.engine)
        .snapshot()
        .map_err(|e| e.to_string())?;
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(&snapshot).map_err(|e| e.to_string())?
        ),
        false => println!("{snapshot}"),
    }
    Ok(())
}

async fn prune(g: &Global, dry_run: bool) -> Result<(), String> {
    let pruned = ctl(g)
        .await?
        .prune(g.all_namespaces, dry_run)
        .await
        .map_err(|e| e.to_string())?;
    println!("{pruned}");
    match pruned.failures() {
        0 => Ok(()),
        n => Err(format!("{n} removals failed (see above)")),
    }
}

async fn answers(g: &Global, container: &str) -> Result<Vec<serde_json::Value>, String> {
    let dir = sandbox_dir(g, container).await?.join("turns");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("no turns of {container} in {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| {
            let data = std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?;
            serde_json::from_slice(&data).map_err(|e| format!("{}: {e}", f.display()))
        })
        .collect()
}

fn count(v: &serde_json::Value) -> usize {
    v.as_array().map(Vec::len).unwrap_or(0)
}

async fn turns(g: &Global, container: &str) -> Result<(), String> {
    println!(
        "{:>5}  {:<20} {:<5} {:>9}  WHY",
        "SEQ", "TURN", "KIND", "TOOK(us)"
    );
    for a in answers(g, container).await? {
        let fs = &a["fs"];
        let p = &a["procs"];
        let mut why = Vec::new();
        if count(&a["degraded"]) > 0 {
            why.push("DEGRADED".to_string());
        }
        if fs["changed"] == true {
            why.push(format!(
                "fs +{} ~{} -{}",
                count(&fs["added"]),
                count(&fs["modified"]),
                count(&fs["deleted"])
            ));
        }
        if p["changed"] == true {
            why.push(format!(
                "procs +{} -{} mem {}",
                count(&p["started"]),
                count(&p["ended"]),
                count(&p["memory"])
            ));
        }
        println!(
            "{:>5}  {:<20} {:<5} {:>9}  {}",
            a["seq"].as_u64().unwrap_or_default(),
            a["turn_id"].as_str().unwrap_or("-"),
            a["kind"].as_str().unwrap_or("?"),
            a["elapsed_us"].as_u64().unwrap_or_default(),
            why.join(", ")
        );
    }
    Ok(())
}

async fn show(g: &Global, container: &str, turn: &str) -> Result<(), String> {
    let all = answers(g, container).await?;
    let found = all
        .iter()
        .find(|a| {
            a["turn_id"].as_str() == Some(turn)
                || a["seq"].as_u64().map(|s| s.to_string()).as_deref() == Some(turn)
        })
        .ok_or_else(|| format!("{container} has no turn {turn}"))?;
    println!(
        "{}",
        serde_json::to_string_pretty(found).map_err(|e| e.to_string())?
    );
    Ok(())
}

async fn checkpoints(g: &Global, container: &str) -> Result<(), String> {
    let root = sandbox_dir(g, container).await?;
    if !root.join("checkpoints").is_dir() {
        return Err(format!(
            "{container} has no checkpoint store in {}",
            root.display()
        ));
    }
    let store = crab_shim::checkpoint::store::Store::open(&root).map_err(|e| e.to_string())?;
    println!(
        "{:>5} {:>6}  {:<20} {:<6} {:>6} {:>12} {:>9} {:>9}  CREATED",
        "SEQ", "PARENT", "TURN", "KIND", "LAYERS", "PROC(bytes)", "FREEZE", "TOTAL"
    );
    for m in store.list().map_err(|e| e.to_string())? {
        println!(
            "{:>5} {:>6}  {:<20} {:<6} {:>6} {:>12} {:>7.1}ms {:>7.1}ms  {}",
            m.seq,
            m.parent
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            m.turn_id,
            format!("{:?}", m.kind).to_lowercase(),
            m.fs_layers.len(),
            m.process
                .as_ref()
                .map(|p| p.bytes_stored.to_string())
                .unwrap_or_else(|| "-".into()),
            m.timings.freeze_ms,
            m.timings.total_ms,
            m.created_at
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn pod_and_container_names_are_taken_out_of_the_arguments() {
        let mut a = args("show --pod agent --container app 3");
        let t = take_pod_container(&mut a).unwrap().unwrap();
        assert_eq!(
            (
                t.pod.as_str(),
                t.pod_namespace.as_str(),
                t.container.as_str()
            ),
            ("agent", "default", "app")
        );
        assert_eq!(a, args("show 3"));
        let mut a = args("turn-end --turn t1 --container app --pod-namespace tools --pod agent");
        let t = take_pod_container(&mut a).unwrap().unwrap();
        assert_eq!(
            (t.pod_namespace.as_str(), a),
            ("tools", args("turn-end --turn t1"))
        );
        // An id is left alone.
        let mut a = args("turns c1");
        assert_eq!(take_pod_container(&mut a), Ok(None));
        assert_eq!(a, args("turns c1"));
        for bad in [
            "turns --pod agent",
            "turns --container app",
            "turns --pod --container app",
            "turns --pod a --pod b --container c",
            "turns --pod-namespace x c1",
        ] {
            assert!(take_pod_container(&mut args(bad)).is_err(), "{bad}");
        }
    }
}
