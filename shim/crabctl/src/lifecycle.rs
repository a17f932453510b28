//! Containers from a checkpoint image: `fork` (new ids), `rollback` and `recover` (the same
//! id). The checkpoint is exported under an internal name and unpacked first; only then is
//! anything started or stopped. A new container is the source's record (spec, runtime name
//! and options, labels, snapshotter) with the checkpoint image as its image, on a fresh
//! snapshot of it, and its task gets no stdio: its processes see /dev/null, like a detached
//! `ctr run -d` without a log. The crab shim recognises the checkpoint in the rootfs.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use containerd_client::services::v1::Container;
use serde_json::Value;
use tokio::task::JoinSet;

use super::{client::Lease, export::INTERNAL_PREFIX, Client, Ctl, CtlError, Exported, Result};

/// A container started from a checkpoint image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restarted {
    pub id: String,
    pub pid: u32,
}

/// Where the time of a fork or rollback went, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    /// Exporting the checkpoint and unpacking it (both mostly skipped when done before).
    pub checkpoint_ms: f64,
    /// Killing and deleting the old task and container (rollback only).
    pub stop_ms: f64,
    /// Creating and starting the new container(s).
    pub start_ms: f64,
    pub total_ms: f64,
}

impl Phases {
    fn since(start: Instant) -> f64 {
        start.elapsed().as_secs_f64() * 1000.0
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0} ms (checkpoint {:.0} ms",
            self.total_ms, self.checkpoint_ms
        )?;
        if self.stop_ms > 0.0 {
            write!(f, ", stop {:.0} ms", self.stop_ms)?;
        }
        write!(f, ", start {:.0} ms)", self.start_ms)
    }
}

/// Where one fork's start went, in milliseconds from the moment the forks were launched.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ForkTimes {
    /// Snapshots.Prepare and Containers.Create.
    pub container_ms: f64,
    /// Tasks.Create: the shim starts, mounts the rootfs and takes the checkpoint out of it
    /// (verifies the CRIU image, or links its verified copy).
    pub task_create_ms: f64,
    /// Tasks.Start: `runc restore` (or `runc start` for a checkpoint without processes) and
    /// the start of checkpointing.
    pub task_start_ms: f64,
    /// All three: this sandbox's own time.
    pub total_ms: f64,
    /// From the launch of all forks until this one ran: its own time plus what it waited for.
    pub done_at_ms: f64,
}

/// One container `fork` started.
#[derive(Debug, Clone, PartialEq)]
pub struct Fork {
    pub id: String,
    pub pid: u32,
    pub times: ForkTimes,
}

/// What `fork` did.
#[derive(Debug)]
pub struct Forked {
    pub exported: Exported,
    /// In id order.
    pub forks: Vec<Fork>,
    pub phases: Phases,
    /// The forks' processes are marked for same-page merging (`--merge-memory`).
    pub merge_memory: bool,
    /// Whether the host's ksmd runs (`None`: no KSM in this kernel), read when they started.
    pub ksmd_running: Option<bool>,
}

impl Forked {
    /// What a user who asked for merged memory should know: nothing merges while ksmd does
    /// not run.
    pub fn merge_note(&self) -> Option<String> {
        if !self.merge_memory {
            return None;
        }
        match self.ksmd_running {
            Some(true) => None,
            Some(false) => Some(format!(
                "the forks' memory is mergeable, but the host's ksmd does not run: nothing is                  merged until it does (echo 1 > {}/run)",
                crab_shim::sys::ksm::KSM_SYSFS
            )),
            None => Some(
                "the forks' memory is marked mergeable, but this kernel has no KSM: nothing is                  merged"
                    .to_string(),
            ),
        }
    }

    /// The forks' own times (`total_ms`): (min, p50, max), nearest rank.
    pub fn per_sandbox_ms(&self) -> (f64, f64, f64) {
        let mut t: Vec<f64> = self.forks.iter().map(|f| f.times.total_ms).collect();
        if t.is_empty() {
            return (f64::NAN, f64::NAN, f64::NAN);
        }
        t.sort_by(f64::total_cmp);
        (t[0], t[(t.len() - 1) / 2], t[t.len() - 1])
    }
}

/// How `rollback` may return a container to a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackHow {
    /// In place if its shim can (the checkpoint shares the current process epoch), else by
    /// recreating the container.
    InPlaceFirst,
    /// By recreating the container.
    Recreate,
}

/// What an in-place rollback did, as the shim recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct InPlaceReset {
    /// The `restored` checkpoint recording it (none if the shim could not record it).
    pub recorded: Option<u64>,
    pub paths: u64,
    pub freeze_ms: f64,
    pub apply_ms: f64,
}

/// How a rollback was done.
#[derive(Debug)]
// One per rollback: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum RollbackWay {
    /// The files were reset in place: same task, same processes.
    InPlace(InPlaceReset),
    /// The task was killed and the container started again from the exported checkpoint.
    Recreated {
        exported: Exported,
        /// Whether the container still had a task (a recovery after its shim died may find
        /// none).
        had_task: bool,
        /// Execs that were running and were ended with the old task.
        execs_ended: Vec<String>,
    },
}

/// What `rollback` / `recover` did.
#[derive(Debug)]
pub struct RolledBack {
    /// The checkpoint returned to.
    pub seq: u64,
    pub turn_id: String,
    pub kind: crab_shim::checkpoint::store::CheckpointKind,
    /// The init's pid now.
    pub pid: u32,
    pub way: RollbackWay,
    /// Why it was not done in place, when that was tried.
    pub not_in_place: Option<String>,
    pub phases: Phases,
}

/// A fork's tracked volumes are its own: each bind mount the shim would track gets a new, empty
/// host directory under `dir` (the fork's store, so `crabctl prune` removes it with the
/// store), which the shim fills with the checkpoint's contents at Create. Forks sharing the
/// original's host directory would see (and overwrite) each other's files.
pub fn own_volumes(mut record: Container, tracked: &[PathBuf], dir: &Path) -> Result<Container> {
    let Some(spec) = record.spec.as_mut() else {
        return Ok(record);
    };
    let mut value: Value = serde_json::from_slice(&spec.value).map_err(|e| {
        CtlError::Refused(format!(
            "container {}'s runtime spec is not JSON: {e}",
            record.id
        ))
    })?;
    let volumes = match serde_json::from_value(value.clone()) {
        Ok(parsed) => crab_shim::sandbox::tracked_volumes(&parsed, tracked),
        Err(e) => {
            return Err(CtlError::Refused(format!(
                "container {}'s runtime spec is not an OCI spec: {e}",
                record.id
            )))
        }
    };
    if volumes.is_empty() {
        return Ok(record);
    }
    let Some(mounts) = value["mounts"].as_array_mut() else {
        return Ok(record);
    };
    for (i, (at, _)) in volumes.iter().enumerate() {
        let own = dir.join(i.to_string());
        std::fs::create_dir_all(&own).map_err(|e| CtlError::Io {
            what: format!("creating {}", own.display()),
            source: e,
        })?;
        // The last mount at that path is the one the container sees.
        if let Some(m) = mounts
            .iter_mut()
            .rev()
            .find(|m| m["destination"].as_str() == at.to_str())
        {
            m["source"] = Value::String(own.display().to_string());
        }
    }
    spec.value = serde_json::to_vec(&value).expect("a JSON value serializes");
    Ok(record)
}

/// The runtime spec of a container started from `from`'s record as `to`: a new id gets its
/// own hostname (if it was the id) and cgroup (the path's last element, which containerd's
/// clients make the id). A terminal stays: the processes of a checkpoint taken with one hold a
/// tty, which CRIU can only recreate on a new terminal.
pub fn clone_spec(spec: &Value, from: &str, to: &str) -> Result<Value> {
    let mut s = spec.clone();
    if from == to {
        return Ok(s);
    }
    if s["hostname"].as_str() == Some(from) {
        s["hostname"] = Value::String(to.to_string());
    }
    if let Some(path) = s["linux"]["cgroupsPath"].as_str().filter(|p| !p.is_empty()) {
        let cut = path.rfind(['/', ':']).map_or(0, |i| i + 1);
        if &path[cut..] != from {
            return Err(CtlError::Refused(format!(
                "cannot give {to} a cgroup of its own: {from}'s cgroup path {path:?} does not end in its id"
            )));
        }
        s["linux"]["cgroupsPath"] = Value::String(format!("{}{to}", &path[..cut]));
    }
    Ok(s)
}

/// `template`'s record for a container `id` of image `image` on a snapshot of its own.
pub fn clone_record(template: &Container, id: &str, image: &str) -> Result<Container> {
    if template.snapshotter.is_empty() {
        return Err(CtlError::Refused(format!(
            "container {} has no snapshotter: crabctl starts containers on snapshots",
            template.id
        )));
    }
    let mut c = template.clone();
    let spec = c.spec.as_mut().ok_or_else(|| {
        CtlError::Refused(format!("container {} has no runtime spec", template.id))
    })?;
    let value: Value = serde_json::from_slice(&spec.value).map_err(|e| {
        CtlError::Refused(format!(
            "container {}'s runtime spec is not JSON: {e}",
            template.id
        ))
    })?;
    spec.value = serde_json::to_vec(&clone_spec(&value, &template.id, id)?)
        .expect("a JSON value serializes");
    c.snapshot_key = if id == template.id && !template.snapshot_key.is_empty() {
        template.snapshot_key.clone()
    } else {
        id.to_string()
    };
    c.id = id.to_string();
    c.image = image.to_string();
    c.created_at = None;
    c.updated_at = None;
    Ok(c)
}

/// `record` with annotation `key` set to `value` in its runtime spec.
pub fn annotated(mut record: Container, key: &str, value: &str) -> Result<Container> {
    let spec = record
        .spec
        .as_mut()
        .ok_or_else(|| CtlError::Refused(format!("container {} has no runtime spec", record.id)))?;
    let mut v: Value = serde_json::from_slice(&spec.value).map_err(|e| {
        CtlError::Refused(format!(
            "container {}'s runtime spec is not JSON: {e}",
            record.id
        ))
    })?;
    let Some(obj) = v.as_object_mut() else {
        return Err(CtlError::Refused(format!(
            "container {}'s runtime spec is not a JSON object",
            record.id
        )));
    };
    let annotations = obj
        .entry("annotations")
        .or_insert_with(|| Value::Object(Default::default()));
    if annotations.is_null() {
        *annotations = Value::Object(Default::default());
    }
    let Some(map) = annotations.as_object_mut() else {
        return Err(CtlError::Refused(format!(
            "container {}'s runtime spec has annotations that are not an object",
            record.id
        )));
    };
    map.insert(key.to_string(), Value::String(value.to_string()));
    spec.value = serde_json::to_vec(&v).expect("a JSON value serializes");
    Ok(record)
}

/// `count` fork ids after the highest existing `<container>-fork-<i>`.
pub fn fork_ids(existing: &[String], container: &str, count: usize) -> Vec<String> {
    let prefix = format!("{container}-fork-");
    let next = existing
        .iter()
        .filter_map(|id| id.strip_prefix(&prefix)?.parse::<usize>().ok())
        .max()
        .unwrap_or(0)
        + 1;
    (next..next + count)
        .map(|i| format!("{prefix}{i}"))
        .collect()
}

/// Creates `record`'s container on `parent` and starts its task, timing each step from
/// `launched` on; on failure removes what it made.
async fn start_from(
    client: &Client,
    lease: &Lease,
    record: Container,
    parent: &str,
    launched: Instant,
) -> Result<Fork> {
    let t0 = Instant::now();
    client
        .create_container(lease, record.clone(), parent)
        .await?;
    let t1 = Instant::now();
    match client.start_task_timed(&record).await {
        Ok((pid, created)) => {
            let t3 = Instant::now();
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
            Ok(Fork {
                id: record.id,
                pid,
                times: ForkTimes {
                    container_ms: ms(t1 - t0),
                    task_create_ms: ms(created - t1),
                    task_start_ms: ms(t3 - created),
                    total_ms: ms(t3 - t0),
                    done_at_ms: ms(t3 - launched),
                },
            })
        }
        Err(e) => {
            if let Err(d) = client.delete_container(&record).await {
                log::warn!("cleanup of {}: {d}", record.id);
            }
            Err(e)
        }
    }
}

impl Ctl {
    /// Refuses `op` (fork, rollback, recovery) of a container another manager owns and would
    /// fight over: a Kubernetes pod's ([`super::pod::refuse_cri`]) or dockerd's
    /// ([`super::docker::refusal`]).
    fn refuse_managed(&self, record: &Container, op: &str) -> Result<()> {
        super::pod::refuse_cri(record, op)?;
        self.refuse_docker(&record.id, Some(record), op)
    }

    /// Refuses `op` of a container dockerd owns ([`super::docker::refusal`]); in namespace
    /// `moby` also one that has no record (dockerd removed it when its task ended).
    fn refuse_docker(&self, id: &str, record: Option<&Container>, op: &str) -> Result<()> {
        if record.is_some_and(|r| super::docker::is_docker_owned(r, self.namespace()))
            || self.namespace() == super::docker::NAMESPACE
        {
            return Err(CtlError::Refused(super::docker::refusal(
                id,
                self.namespace(),
                op,
            )));
        }
        Ok(())
    }

    /// Exports checkpoint `turn` of `container` under its internal name and unpacks it;
    /// returns it with the snapshot to start containers on.
    async fn prepare_checkpoint(
        &self,
        lease: &Lease,
        container: &str,
        turn: Option<&str>,
    ) -> Result<(Exported, String)> {
        let options = super::export::ExportOptions {
            turn: turn.map(str::to_string),
            ..Default::default()
        };
        let exported = self.export_leased(lease, container, None, &options).await?;
        let top = self
            .client
            .unpack(lease, &exported.container.snapshotter, &exported.image)
            .await?;
        Ok((exported, top))
    }

    /// Starts `count` new containers `<container>-fork-<i>` from checkpoint `at`, concurrently.
    /// If one fails, the others are removed again.
    pub async fn fork(
        &self,
        container: &str,
        at: &str,
        count: usize,
        merge_memory: bool,
    ) -> Result<Forked> {
        if count == 0 {
            return Err(CtlError::Refused(
                "a fork needs a count of at least 1".into(),
            ));
        }
        let start = Instant::now();
        self.refuse_docker(container, None, "fork")?;
        self.refuse_managed(&self.container(container).await?, "fork")?;
        let lease = self.client.create_lease().await?;
        let r = async {
            let (exported, top) = self.prepare_checkpoint(&lease, container, Some(at)).await?;
            let mut phases = Phases {
                checkpoint_ms: Phases::since(start),
                ..Phases::default()
            };
            let started = Instant::now();
            let mut existing: Vec<String> = self
                .client
                .containers()
                .await?
                .into_iter()
                .map(|c| c.id)
                .collect();
            // A removed fork's store stays (recover needs stores to outlive containers): a new
            // fork must not take its id and inherit its history.
            let stores = self
                .config_for(&exported.container)?
                .store
                .state_dir
                .join(self.namespace());
            if let Ok(dir) = std::fs::read_dir(&stores) {
                existing.extend(
                    dir.flatten()
                        .filter_map(|e| e.file_name().into_string().ok()),
                );
            }
            let tracked = self
                .config_for(&exported.container)?
                .checkpoint
                .tracked_volumes;
            let records = fork_ids(&existing, container, count)
                .iter()
                .map(|id| {
                    let mut record = clone_record(&exported.container, id, &exported.reference)?;
                    if merge_memory {
                        record = annotated(record, crab_shim::turns::MERGE_MEMORY, "true")?;
                    }
                    own_volumes(record, &tracked, &stores.join(id).join("volumes"))
                })
                .collect::<Result<Vec<_>>>()?;
            let mut set = JoinSet::new();
            let launched = Instant::now();
            for record in records {
                let (client, lease, top) = (self.client.clone(), lease.clone(), top.clone());
                set.spawn(async move {
                    let id = record.id.clone();
                    (
                        id,
                        start_from(&client, &lease, record, &top, launched).await,
                    )
                });
            }
            let mut forks = Vec::new();
            let mut failure = None;
            self.progress.forks(0, count);
            while let Some(joined) = set.join_next().await {
                match joined {
                    Ok((_, Ok(f))) => {
                        forks.push(f);
                        self.progress.forks(forks.len(), count);
                    }
                    Ok((id, Err(e))) => {
                        failure.get_or_insert(CtlError::Fork {
                            id,
                            source: Box::new(e),
                        });
                    }
                    Err(e) => {
                        failure.get_or_insert(CtlError::Failed(format!("a fork task: {e}")));
                    }
                }
            }
            if let Some(e) = failure {
                self.progress.interrupted();
                for f in &forks {
                    self.remove_started(&f.id).await;
                }
                self.drop_unused_internal_image(&exported.reference).await;
                return Err(e);
            }
            forks.sort_by(|a, b| natural_key(&a.id).cmp(&natural_key(&b.id)));
            phases.start_ms = Phases::since(started);
            phases.total_ms = Phases::since(start);
            Ok(Forked {
                exported,
                forks,
                phases,
                merge_memory,
                ksmd_running: crab_shim::sys::ksm::ksmd_running(),
            })
        }
        .await;
        self.client.delete_lease(lease).await;
        r
    }

    /// Deletes `image` if crabctl made it (a checkpoint an earlier rollback or fork started
    /// from) and no container uses it any more. Images of other origins are never touched.
    async fn drop_unused_internal_image(&self, image: &str) {
        if !image.starts_with(INTERNAL_PREFIX) {
            return;
        }
        let dropped = async {
            if self
                .client
                .containers()
                .await?
                .iter()
                .any(|c| c.image == image)
            {
                return Ok(());
            }
            self.client.delete_image(image).await
        };
        if let Err(e) = dropped.await {
            log::warn!("cannot delete the unused checkpoint image {image}: {e}");
        }
    }

    async fn remove_started(&self, id: &str) {
        let removed = async {
            self.client.remove_task(id).await?;
            if let Some(c) = self.client.container(id).await? {
                self.client.delete_container(&c).await?;
            }
            Ok::<_, CtlError>(())
        };
        if let Err(e) = removed.await {
            log::warn!("cleanup of {id}: {e}");
        }
    }

    /// Returns `container` to checkpoint `to` (default: its newest recovery point) keeping its
    /// id. With [`RollbackHow::InPlaceFirst`] and a checkpoint named, its shim is asked to
    /// reset the files in place ([`Ctl::rollback_in_place`]); if it refuses (the processes
    /// changed since, an older shim, ...), or otherwise, the container is recreated: the
    /// checkpoint is exported and unpacked, then the task is killed and deleted (its running
    /// execs end), the container record and snapshot are replaced, and the new task starts from
    /// the checkpoint.
    pub async fn rollback(
        &self,
        container: &str,
        to: Option<&str>,
        how: RollbackHow,
    ) -> Result<RolledBack> {
        let start = Instant::now();
        let op = if to.is_some() { "rollback" } else { "recovery" };
        self.refuse_docker(container, None, op)?;
        let record = self.container(container).await?;
        self.refuse_managed(&record, op)?;
        let mut not_in_place = None;
        if let (Some(to), RollbackHow::InPlaceFirst) = (to, how) {
            match self.rollback_in_place(&record, to, start).await {
                Ok(r) => return Ok(r),
                Err(e) => {
                    log::info!("{container}: not rolled back in place: {e}");
                    not_in_place = Some(e.to_string());
                }
            }
        }
        let mut r = self.rollback_recreate(container, to, start).await?;
        r.not_in_place = not_in_place;
        Ok(r)
    }

    /// Asks the shim of `record`'s container to reset its files to checkpoint `to` in place
    /// (see the shim's `rollback` module); an error says why it did not.
    async fn rollback_in_place(
        &self,
        record: &Container,
        to: &str,
        start: Instant,
    ) -> Result<RolledBack> {
        use crab_shim::checkpoint::store::{CheckpointKind, Store};
        let store = Store::open(&self.store_root(record)?)?;
        let manifests = store.list()?;
        let m = super::export::select_checkpoint(&record.id, &manifests, Some(to))?.clone();
        let newest = manifests.last().map_or(0, |m| m.seq);
        let pid = self.client.task_pid(&record.id).await?.ok_or_else(|| {
            CtlError::Refused(format!("{} has no task to roll back in place", record.id))
        })?;
        let mut phases = Phases {
            checkpoint_ms: Phases::since(start),
            ..Phases::default()
        };
        let asked = Instant::now();
        self.client.rollback_in_place(&record.id, m.seq).await?;
        phases.start_ms = Phases::since(asked);
        // What the shim recorded: a `restored` checkpoint of `m`, newer than those listed.
        let recorded = store.latest()?.filter(|l| {
            l.kind == CheckpointKind::Restored && l.parent == Some(m.seq) && l.seq > newest
        });
        phases.total_ms = Phases::since(start);
        let paths = recorded
            .as_ref()
            .and_then(|l| l.in_place.as_ref())
            .map_or(0, |p| p.paths);
        Ok(RolledBack {
            seq: m.seq,
            turn_id: m.turn_id.clone(),
            kind: m.kind,
            pid,
            way: RollbackWay::InPlace(InPlaceReset {
                recorded: recorded.as_ref().map(|l| l.seq),
                paths,
                freeze_ms: recorded.as_ref().map_or(0.0, |l| l.timings.freeze_ms),
                apply_ms: recorded.as_ref().map_or(0.0, |l| l.timings.capture_ms),
            }),
            not_in_place: None,
            phases,
        })
    }

    /// The recreating rollback (see [`Ctl::rollback`]).
    async fn rollback_recreate(
        &self,
        container: &str,
        to: Option<&str>,
        start: Instant,
    ) -> Result<RolledBack> {
        let lease = self.client.create_lease().await?;
        let r = async {
            let (exported, top) = self.prepare_checkpoint(&lease, container, to).await?;
            let mut phases = Phases {
                checkpoint_ms: Phases::since(start),
                ..Phases::default()
            };
            let stopping = Instant::now();
            let execs = self.client.task_execs(container).await?;
            self.client.remove_task(container).await?;
            self.client.delete_container(&exported.container).await?;
            phases.stop_ms = Phases::since(stopping);
            let starting = Instant::now();
            let record = clone_record(&exported.container, container, &exported.reference)?;
            self.client
                .create_container(&lease, record.clone(), &top)
                .await
                .map_err(|e| {
                    CtlError::Failed(format!(
                        "{container} was removed but could not be created again from {}: {e}",
                        exported.reference
                    ))
                })?;
            // The record stays if the start fails, so `crabctl recover` can try again.
            let pid = self
                .client
                .start_task(&record)
                .await
                .map_err(|e| CtlError::Restart {
                    container: container.to_string(),
                    source: Box::new(e),
                })?;
            phases.start_ms = Phases::since(starting);
            self.drop_unused_internal_image(&exported.container.image)
                .await;
            phases.total_ms = Phases::since(start);
            Ok(RolledBack {
                seq: exported.source.seq,
                turn_id: exported.source.turn_id.clone(),
                kind: exported.kind,
                pid,
                way: RollbackWay::Recreated {
                    had_task: execs.is_some(),
                    execs_ended: execs.unwrap_or_default(),
                    exported,
                },
                not_in_place: None,
                phases,
            })
        }
        .await;
        self.client.delete_lease(lease).await;
        r
    }
}

/// Sorts `x-fork-10` after `x-fork-9`.
fn natural_key(id: &str) -> (usize, &str) {
    let n = id
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (n, id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_cloned_spec_gets_its_own_cgroup_and_hostname_and_keeps_its_terminal() {
        let spec = json!({
            "process": {"terminal": true, "args": ["sleep", "infinity"]},
            "hostname": "c1",
            "linux": {"cgroupsPath": "/crab-test/c1"},
        });
        let f = clone_spec(&spec, "c1", "c1-fork-1").unwrap();
        assert_eq!(f["linux"]["cgroupsPath"], "/crab-test/c1-fork-1");
        assert_eq!(f["hostname"], "c1-fork-1");
        assert_eq!(f["process"]["terminal"], true);
        assert_eq!(f["process"]["args"], spec["process"]["args"]);
        // The same id keeps everything.
        let same = clone_spec(&spec, "c1", "c1").unwrap();
        assert_eq!(same, spec);
        assert_eq!(same["hostname"], "c1");
        // systemd-style paths end in the id after a colon.
        let sd = json!({"linux": {"cgroupsPath": "system.slice:cri-containerd:c1"}});
        assert_eq!(
            clone_spec(&sd, "c1", "c2").unwrap()["linux"]["cgroupsPath"],
            "system.slice:cri-containerd:c2"
        );
        // Another hostname is kept; a cgroup path that is not the id's cannot be derived.
        let other = json!({"hostname": "box", "linux": {"cgroupsPath": "/shared/pool"}});
        let e = clone_spec(&other, "c1", "c2").unwrap_err();
        assert!(e.to_string().contains("/shared/pool"), "{e}");
        let no_cgroup = json!({"hostname": "box", "linux": {}});
        assert_eq!(
            clone_spec(&no_cgroup, "c1", "c2").unwrap()["hostname"],
            "box"
        );
    }

    #[test]
    fn an_annotation_is_added_to_whatever_spec_the_record_holds() {
        let record = |spec: &[u8]| Container {
            id: "c1-fork-1".into(),
            spec: Some(prost_types::Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Spec".into(),
                value: spec.to_vec(),
            }),
            ..Default::default()
        };
        let annotations = |c: &Container| -> Value {
            serde_json::from_slice::<Value>(&c.spec.as_ref().unwrap().value).unwrap()["annotations"]
                .clone()
        };
        let key = crab_shim::turns::MERGE_MEMORY;
        for (spec, want) in [
            (&br#"{"hostname":"h"}"#[..], json!({key: "true"})),
            (br#"{"annotations":null}"#, json!({key: "true"})),
            (
                br#"{"annotations":{"a":"b","io.crab/merge-memory":"false"}}"#,
                json!({"a": "b", key: "true"}),
            ),
        ] {
            let c = annotated(record(spec), key, "true").unwrap();
            assert_eq!(annotations(&c), want, "{}", String::from_utf8_lossy(spec));
        }
        for hostile in [&b"[]"[..], b"{\"annotations\":[1]}", b"{", b""] {
            let e = annotated(record(hostile), key, "true").unwrap_err();
            assert!(e.to_string().contains("c1-fork-1"), "{e}");
        }
        let no_spec = Container {
            id: "c2".into(),
            ..Default::default()
        };
        assert!(annotated(no_spec, key, "true").is_err());
    }

    #[test]
    fn cloned_records_keep_runtime_labels_and_snapshotter() {
        use containerd_client::services::v1::container::Runtime;
        let template = Container {
            id: "c1".into(),
            labels: [("a".to_string(), "b".to_string())].into(),
            image: "base:latest".into(),
            runtime: Some(Runtime {
                name: "io.containerd.crab.v1".into(),
                options: Some(prost_types::Any {
                    type_url: "runtimeoptions.v1.Options".into(),
                    value: vec![1, 2, 3],
                }),
            }),
            spec: Some(prost_types::Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Spec".into(),
                value: br#"{"hostname":"c1","linux":{"cgroupsPath":"/ns/c1"}}"#.to_vec(),
            }),
            snapshotter: "overlayfs".into(),
            snapshot_key: "c1-snap".into(),
            ..Default::default()
        };
        let f = clone_record(&template, "c1-fork-2", "crab.local/checkpoint/ns/c1:3").unwrap();
        assert_eq!(
            (f.id.as_str(), f.snapshot_key.as_str()),
            ("c1-fork-2", "c1-fork-2")
        );
        assert_eq!(f.image, "crab.local/checkpoint/ns/c1:3");
        assert_eq!(
            (&f.runtime, &f.labels, &f.snapshotter),
            (&template.runtime, &template.labels, &template.snapshotter)
        );
        let spec: Value = serde_json::from_slice(&f.spec.unwrap().value).unwrap();
        assert_eq!(spec["linux"]["cgroupsPath"], "/ns/c1-fork-2");
        let same = clone_record(&template, "c1", "img").unwrap();
        assert_eq!(same.snapshot_key, "c1-snap");
        let mut bare = template.clone();
        bare.snapshotter.clear();
        assert!(clone_record(&bare, "x", "img").is_err());
    }

    #[test]
    fn fork_ids_continue_after_existing_forks() {
        let existing = vec![
            "c".to_string(),
            "c-fork-2".into(),
            "c-fork-x".into(),
            "cc-fork-9".into(),
        ];
        assert_eq!(fork_ids(&existing, "c", 2), ["c-fork-3", "c-fork-4"]);
        assert_eq!(fork_ids(&[], "c", 1), ["c-fork-1"]);
        let mut ids = vec!["c-fork-10".to_string(), "c-fork-9".into()];
        ids.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
        assert_eq!(ids, ["c-fork-9", "c-fork-10"]);
    }
}
