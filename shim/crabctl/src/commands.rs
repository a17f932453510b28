//! The commands: each runs one [`Request`] against containerd and crab's store and prints its
//! output (stdout for results, stderr for notes).

use std::path::PathBuf;

use crab_runtime_config::Config;
use serde_json::Value;

use crate::{
    cli::{Global, Request, Target},
    export::ExportOptions,
    Client, Ctl, CtlError, Result,
};

/// Runs `request`.
pub async fn run(g: &Global, request: Request) -> Result<()> {
    if let Request::Completions { shell } = request {
        crate::cli::completions(shell, &mut std::io::stdout());
        return Ok(());
    }
    let container = match request.target() {
        Some(target) => resolve(g, target).await?,
        None => String::new(),
    };
    let container = container.as_str();
    match request {
        Request::TurnEnd { turn, .. } => turn_end(g, container, turn).await,
        Request::Turns { .. } => turns(g, container).await,
        Request::Show { turn, .. } => show(g, container, &turn).await,
        Request::Checkpoints { .. } => checkpoints(g, container).await,
        Request::Export {
            turn,
            reference,
            base_image,
            output,
            ..
        } => {
            let options = ExportOptions {
                turn,
                base_image,
                output,
            };
            export(g, container, &reference, &options).await
        }
        Request::Fork { at, count, .. } => fork(g, container, &at, count).await,
        Request::Rollback { to, .. } => rollback(g, container, Some(&to)).await,
        Request::Recover { .. } => rollback(g, container, None).await,
        Request::Engine { json } => engine(g, json),
        Request::Prune { dry_run } => prune(g, dry_run).await,
        Request::Completions { .. } => unreachable!("handled above"),
    }
}

/// The id of the container `target` names; a note about the choice goes to stderr.
async fn resolve(g: &Global, target: &Target) -> Result<String> {
    let target = match target {
        Target::Id(id) => return resolve_id(g, id).await,
        Target::Pod(target) => target,
    };
    let resolved = ctl(g).await?.resolve_pod_container(target).await?;
    if let Some(note) = &resolved.note {
        eprintln!("crabctl: {note}");
    }
    Ok(resolved.id)
}

/// The container `arg` stands for (an id, a unique id prefix, a Docker name: see
/// [`crate::resolve`]). Without containerd, `arg` as given: the commands that read a store
/// with --config need none, the others say containerd is unreachable.
async fn resolve_id(g: &Global, arg: &str) -> Result<String> {
    let Ok(ctl) = ctl(g).await else {
        return Ok(arg.to_string());
    };
    let resolved = ctl.resolve_id(arg).await?;
    if let Some(note) = &resolved.note {
        eprintln!("crabctl: {note}");
    }
    Ok(resolved.id)
}

async fn ctl(g: &Global) -> Result<Ctl> {
    let client = Client::connect(&g.address, &g.namespace).await?;
    Ok(Ctl::new(client, g.config.clone()).with_docker_host(std::env::var("DOCKER_HOST").ok()))
}

async fn turn_end(g: &Global, container: &str, turn: Option<String>) -> Result<()> {
    let turn = turn.unwrap_or_else(|| {
        format!(
            "crabctl-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis()
        )
    });
    ctl(g).await?.client.end_turn(container, &turn).await?;
    println!("turn {turn} of {container} ended");
    Ok(())
}

/// The directory of `container`'s store and turn answers. With --config no containerd is
/// needed; without, the container's runtime options say which config its shim used.
async fn sandbox_dir(g: &Global, container: &str) -> Result<PathBuf> {
    match &g.config {
        Some(path) => {
            let config = Config::load(path)?;
            Ok(crab_shim::sandbox::sandbox_dir(
                &config.store.state_dir,
                &g.namespace,
                container,
            ))
        }
        None => ctl(g).await?.sandbox_dir(container).await,
    }
}

async fn export(
    g: &Global,
    container: &str,
    reference: &str,
    options: &ExportOptions,
) -> Result<()> {
    let exported = ctl(g).await?.export(container, reference, options).await?;
    println!("exported {}", exported.summary());
    Ok(())
}

async fn fork(g: &Global, container: &str, at: &str, count: usize) -> Result<()> {
    let forked = ctl(g).await?.fork(container, at, count).await?;
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
async fn rollback(g: &Global, container: &str, to: Option<&str>) -> Result<()> {
    let r = ctl(g).await?.rollback(container, to).await?;
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

fn engine(g: &Global, json: bool) -> Result<()> {
    let (config, _) = Config::load_or_default(g.config.as_deref())?;
    let snapshot = crab_shim::engine::Engine::new(&config.engine).snapshot()?;
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(&snapshot).expect("a snapshot serializes")
        ),
        false => println!("{snapshot}"),
    }
    Ok(())
}

async fn prune(g: &Global, dry_run: bool) -> Result<()> {
    let pruned = ctl(g).await?.prune(g.all_namespaces, dry_run).await?;
    println!("{pruned}");
    match pruned.failures() {
        0 => Ok(()),
        failures => Err(CtlError::PruneFailures { failures }),
    }
}

/// `container`'s turn answers, in the order they were written.
async fn answers(g: &Global, container: &str) -> Result<Vec<Value>> {
    let dir = sandbox_dir(g, container).await?.join("turns");
    let entries = std::fs::read_dir(&dir).map_err(|source| CtlError::NoTurns {
        container: container.to_string(),
        dir: dir.clone(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
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
            let bad = |reason: String| CtlError::BadAnswer {
                path: f.clone(),
                reason,
            };
            let data = std::fs::read(f).map_err(|e| bad(e.to_string()))?;
            serde_json::from_slice(&data).map_err(|e| bad(e.to_string()))
        })
        .collect()
}

fn count(v: &Value) -> usize {
    v.as_array().map(Vec::len).unwrap_or(0)
}

async fn turns(g: &Global, container: &str) -> Result<()> {
    let answers = answers(g, container).await?;
    println!(
        "{:>5}  {:<20} {:<5} {:>9}  WHY",
        "SEQ", "TURN", "KIND", "TOOK(us)"
    );
    for a in answers {
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

async fn show(g: &Global, container: &str, turn: &str) -> Result<()> {
    let all = answers(g, container).await?;
    let found = all
        .iter()
        .find(|a| {
            a["turn_id"].as_str() == Some(turn)
                || a["seq"].as_u64().map(|s| s.to_string()).as_deref() == Some(turn)
        })
        .ok_or_else(|| CtlError::NoTurn {
            container: container.to_string(),
            turn: turn.to_string(),
        })?;
    println!(
        "{}",
        serde_json::to_string_pretty(found).expect("a JSON value serializes")
    );
    Ok(())
}

async fn checkpoints(g: &Global, container: &str) -> Result<()> {
    let root = sandbox_dir(g, container).await?;
    if !root.join("checkpoints").is_dir() {
        return Err(CtlError::NoStore {
            container: container.to_string(),
            path: root,
        });
    }
    let store = crab_shim::checkpoint::store::Store::open(&root)?;
    println!(
        "{:>5} {:>6}  {:<20} {:<6} {:>6} {:>12} {:>9} {:>9}  CREATED",
        "SEQ", "PARENT", "TURN", "KIND", "LAYERS", "PROC(bytes)", "FREEZE", "TOTAL"
    );
    for m in store.list()? {
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
