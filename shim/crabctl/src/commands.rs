//! The commands: each runs one [`Request`] against containerd and crab's store and prints its
//! output (stdout for results, stderr for notes).

use std::path::PathBuf;

use crab_runtime_config::Config;
use crab_shim::checkpoint::store::StoreError;

use crate::{
    answer::{self, Stored},
    cli::{Global, Request, Target},
    export::ExportOptions,
    lifecycle::{RollbackHow, RollbackWay},
    output::{print_json, CheckpointRow, ForkReport, Format, PruneReport, RollbackReport},
    progress::Progress,
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
        Request::Turns { format, .. } => turns(g, container, format).await,
        Request::Show { turn, format, .. } => show(g, container, &turn, format).await,
        Request::Checkpoints { format, .. } => checkpoints(g, container, format).await,
        Request::Diff {
            from, to, format, ..
        } => diff(g, container, &from, to.as_deref(), format).await,
        Request::Export {
            turn,
            reference,
            base_image,
            output,
            files_only,
            progress,
            ..
        } => {
            let options = ExportOptions {
                turn,
                base_image,
                output,
                files_only,
            };
            let progress = Progress::for_stderr(progress, false);
            export(g, container, &reference, &options, progress).await
        }
        Request::Fork {
            at,
            count,
            merge_memory,
            format,
            progress,
            ..
        } => {
            let progress = Progress::for_stderr(progress, format == Format::Json);
            fork(g, container, &at, count, merge_memory, format, progress).await
        }
        Request::Rollback {
            to,
            recreate,
            format,
            ..
        } => {
            let how = match recreate {
                true => RollbackHow::Recreate,
                false => RollbackHow::InPlaceFirst,
            };
            rollback(g, container, Some(&to), how, format).await
        }
        Request::Recover { .. } => {
            rollback(g, container, None, RollbackHow::Recreate, Format::Text).await
        }
        Request::Engine { format } => engine(g, format),
        Request::Lineages { lineage, format } => lineages(g, lineage.as_deref(), format).await,
        Request::Replication { lineage, format } => {
            let rows = ctl(g).await?.lineages(lineage.as_deref()).await?;
            match format {
                Format::Json => print_json(&rows),
                Format::Text => crate::lineages::print_replication(&rows),
            }
            Ok(())
        }
        Request::Prune { dry_run, format } => prune(g, dry_run, format).await,
        Request::Metrics(args) => crate::metrics::run(g.config.as_deref(), &args).await,
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
    progress: Progress,
) -> Result<()> {
    let exported = ctl(g)
        .await?
        .with_progress(progress)
        .export(container, reference, options)
        .await?;
    println!("exported {}", exported.summary());
    Ok(())
}

async fn fork(
    g: &Global,
    container: &str,
    at: &str,
    count: usize,
    merge_memory: bool,
    format: Format,
    progress: Progress,
) -> Result<()> {
    let forked = ctl(g)
        .await?
        .with_progress(progress)
        .fork(container, at, count, merge_memory)
        .await?;
    match format {
        Format::Json => print_json(&ForkReport::of(container, &forked)),
        Format::Text => {
            for f in &forked.forks {
                println!("{}", f.id);
            }
        }
    }
    let s = &forked.exported.source;
    let (min, p50, max) = forked.per_sandbox_ms();
    eprintln!(
        "crabctl: started {} forks of {} from checkpoint {} (turn {:?}) in {}; per sandbox \
         {min:.0} / {p50:.0} / {max:.0} ms (min / p50 / max)",
        forked.forks.len(),
        container,
        s.seq,
        s.turn_id,
        forked.phases
    );
    if let Some(note) = forked.merge_note() {
        eprintln!("crabctl: {note}");
    }
    Ok(())
}

/// rollback (`to` given) and recover (the newest recovery point).
async fn rollback(
    g: &Global,
    container: &str,
    to: Option<&str>,
    how: RollbackHow,
    format: Format,
) -> Result<()> {
    let r = ctl(g).await?.rollback(container, to, how).await?;
    if format == Format::Json {
        print_json(&RollbackReport::of(container, &r));
        return Ok(());
    }
    let verb = if to.is_some() {
        "rolled back"
    } else {
        "recovered"
    };
    let kind = format!("{:?}", r.kind).to_lowercase();
    match &r.way {
        RollbackWay::InPlace(p) => println!(
            "{verb} {container} to checkpoint {} (turn {:?}, {kind}) in place in {:.0} ms: {} \
             paths reset, processes kept (pid {}), frozen {:.1} ms",
            r.seq, r.turn_id, r.phases.total_ms, p.paths, r.pid, p.freeze_ms
        ),
        RollbackWay::Recreated {
            exported,
            had_task,
            execs_ended,
        } => {
            println!(
                "{verb} {container} to checkpoint {} (turn {:?}, {kind}) by recreating it in {}: \
                 pid {}, image {}",
                r.seq, r.turn_id, r.phases, r.pid, exported.reference
            );
            if let Some(why) = &r.not_in_place {
                println!("not in place: {why}");
            }
            if !had_task {
                println!("{container} had no task (its shim or processes were gone)");
            }
            if !execs_ended.is_empty() {
                println!(
                    "ended {} running execs with the old task (killed): {}",
                    execs_ended.len(),
                    execs_ended.join(", ")
                );
            }
        }
    }
    Ok(())
}

async fn lineages(g: &Global, lineage: Option<&str>, format: Format) -> Result<()> {
    let rows = ctl(g).await?.lineages(lineage).await?;
    match format {
        Format::Json => print_json(&rows),
        Format::Text => crate::lineages::print_text(&rows),
    }
    Ok(())
}

fn engine(g: &Global, format: Format) -> Result<()> {
    let (config, _) = Config::load_or_default(g.config.as_deref())?;
    let snapshot = crab_shim::engine::Engine::new(&config.engine).snapshot()?;
    match format {
        Format::Json => print_json(&snapshot),
        Format::Text => println!("{snapshot}"),
    }
    Ok(())
}

async fn prune(g: &Global, dry_run: bool, format: Format) -> Result<()> {
    let pruned = ctl(g).await?.prune(g.all_namespaces, dry_run).await?;
    match format {
        Format::Json => print_json(&PruneReport::from(&pruned)),
        Format::Text => println!("{pruned}"),
    }
    match pruned.failures() {
        0 => Ok(()),
        failures => Err(CtlError::PruneFailures { failures }),
    }
}

/// `container`'s turn answers, in the order of their numbers.
async fn answers(g: &Global, container: &str) -> Result<Vec<Stored>> {
    let dir = sandbox_dir(g, container).await?.join("turns");
    answer::read_dir(&dir)?.ok_or_else(|| CtlError::NoTurns {
        container: container.to_string(),
        dir: dir.clone(),
        source: std::io::ErrorKind::NotFound.into(),
    })
}

async fn turns(g: &Global, container: &str, format: Format) -> Result<()> {
    let answers = answers(g, container).await?;
    if format == Format::Json {
        let all: Vec<&answer::TurnRecord> = answers.iter().map(|s| &s.record).collect();
        print_json(&all);
        return Ok(());
    }
    println!(
        "{:>5}  {:<20} {:<5} {:>9}  WHY",
        "SEQ", "TURN", "KIND", "TOOK(us)"
    );
    for s in answers {
        let (t, a) = (&s.record, &s.record.answer);
        println!(
            "{:>5}  {:<20} {:<5} {:>9}  {}",
            a.seq,
            t.turn_id,
            format!("{:?}", a.kind).to_lowercase(),
            a.elapsed_us,
            answer::why(a)
        );
    }
    Ok(())
}

/// `show` prints the answer as JSON in either format (its text form is that document).
async fn show(g: &Global, container: &str, turn: &str, _format: Format) -> Result<()> {
    let all = answers(g, container).await?;
    // The newest answer of a turn id (turns are numbered again after a rollback).
    let found = all
        .iter()
        .rev()
        .find(|s| s.record.turn_id == turn || s.record.answer.seq.to_string() == turn)
        .ok_or_else(|| CtlError::NoTurn {
            container: container.to_string(),
            turn: turn.to_string(),
        })?;
    print_json(&found.record);
    Ok(())
}

/// The manifests of `container`'s store, oldest first.
fn manifests(
    container: &str,
    root: &std::path::Path,
) -> Result<Vec<crab_shim::checkpoint::store::Manifest>> {
    if !root.join("checkpoints").is_dir() {
        return Err(CtlError::NoStore {
            container: container.to_string(),
            path: root.to_path_buf(),
        });
    }
    let store = crab_shim::checkpoint::store::Store::open(root)?;
    store.list().map_err(|e| match e {
        // Not a checkpoint crab wrote: say how to read the others.
        e @ StoreError::Corrupt { .. } => CtlError::Failed(format!(
            "{e} (it is no recovery point: move it out of the way to read the others)"
        )),
        e => e.into(),
    })
}

async fn checkpoints(g: &Global, container: &str, format: Format) -> Result<()> {
    let root = sandbox_dir(g, container).await?;
    let manifests = manifests(container, &root)?;
    let lineage = crab_shim::checkpoint::lineage::read(&root).map(|r| r.lineage);
    if format == Format::Json {
        let rows: Vec<CheckpointRow> = manifests
            .iter()
            .map(|m| CheckpointRow {
                lineage: lineage.clone(),
                ..CheckpointRow::from(m)
            })
            .collect();
        print_json(&rows);
        return Ok(());
    }
    if let Some(l) = &lineage {
        println!("lineage {l}");
    }
    println!(
        "{:>5} {:>6}  {:<20} {:<6} {:>6} {:>12} {:>9} {:>9}  CREATED",
        "SEQ", "PARENT", "TURN", "KIND", "LAYERS", "PROC(bytes)", "FREEZE", "TOTAL"
    );
    for m in manifests {
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

async fn diff(
    g: &Global,
    container: &str,
    from: &str,
    to: Option<&str>,
    format: Format,
) -> Result<()> {
    let root = sandbox_dir(g, container).await?;
    let answers = answer::read_dir(&root.join("turns"))?.unwrap_or_default();
    // A container whose turns were never checkpointed has answers and no store.
    let manifests = match root.join("checkpoints").is_dir() {
        true => manifests(container, &root)?,
        false if !answers.is_empty() => Vec::new(),
        false => {
            return Err(CtlError::NoStore {
                container: container.to_string(),
                path: root,
            })
        }
    };
    let d = crate::diff::diff(container, &manifests, &answers, from, to)?;
    match format {
        Format::Json => print_json(&d),
        Format::Text => print!("{d}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_corrupt_or_newer_manifest_is_an_error_naming_the_file() {
        let root = tempfile::tempdir().unwrap();
        let e = manifests("c1", root.path()).unwrap_err();
        assert_eq!(e.exit_code(), 3, "no store: {e}");
        let dir = root.path().join("checkpoints");
        std::fs::create_dir_all(&dir).unwrap();
        assert!(manifests("c1", root.path()).unwrap().is_empty());
        for (data, needle) in [
            ("{", "out of the way"),
            (
                "{\"format\": 1, \"seq\": 1, \"kind\": \"everything\"}",
                "is corrupt",
            ),
            ("[]", "is corrupt"),
            ("{\"format\": 99, \"seq\": 1}", "upgrade crab"),
        ] {
            std::fs::write(dir.join("000001.json"), data).unwrap();
            let e = manifests("c1", root.path()).unwrap_err();
            assert_eq!(e.exit_code(), 1, "{data}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("checkpoints/000001.json") && msg.contains(needle),
                "{data}: {msg}"
            );
            // Nothing was lost: the file is still there for a person to look at.
            assert_eq!(
                std::fs::read_to_string(dir.join("000001.json")).unwrap(),
                data
            );
        }
    }
}
