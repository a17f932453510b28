//! Delete: an ended exec forgotten, or a container deleted (runc's state, its io, its
//! checkpointing and its rootfs), with the restore copy it may still hold.

use super::Containers;
use crate::{
    bundle,
    error::{Error, Result},
    events::TaskEvent,
    process::{ExitInfo, Status},
};

impl Containers {
    pub async fn delete(&self, id: &str, exec_id: &str) -> Result<ExitInfo> {
        let c = self.get(id)?;
        if !exec_id.is_empty() {
            let p = c.process(exec_id)?;
            let snap = p.snapshot();
            if matches!(snap.status, Status::Running | Status::Paused) {
                return Err(Error::FailedPrecondition(format!(
                    "cannot delete running exec {exec_id}"
                )));
            }
            c.execs.lock().unwrap().remove(exec_id);
            p.close_io().await;
            return Ok(snap.exit.unwrap_or(ExitInfo {
                pid: snap.pid,
                status: 0,
                at: std::time::SystemTime::now(),
            }));
        }
        let _guard = c.lifecycle.lock().await;
        let snap = c.init.snapshot();
        if matches!(snap.status, Status::Running | Status::Paused) && snap.exit.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete running container {id}"
            )));
        }
        // `--force` freezes and kills whatever is left, which takes ~100 ms on a cgroup v1
        // freezer even when nothing is: only a created-but-never-started init needs it.
        let force = snap.exit.is_none();
        // A container waiting to be restored does not exist for runc yet.
        let never_created = c.pending_restore.lock().unwrap().take().is_some();
        drop(c.restore_dir.lock().unwrap().take());
        let _ = std::fs::remove_file(c.bundle.join(crate::restore::scratch::BUNDLE_RECORD));
        if !never_created {
            if let Err(e) = c.runtime.delete(id, force).await {
                if force {
                    return Err(e.into());
                }
                log::info!("delete {id}: {e}; retrying with --force");
                c.runtime.delete(id, true).await?;
            }
        }
        let exit = snap.exit.unwrap_or(ExitInfo {
            pid: snap.pid,
            status: 128 + libc::SIGKILL as u32,
            at: std::time::SystemTime::now(),
        });
        self.pids
            .lock()
            .unwrap()
            .owners
            .retain(|_, (cid, _)| cid != id);
        c.init.close_io().await;
        let execs: Vec<_> = c.execs.lock().unwrap().drain().map(|(_, p)| p).collect();
        for p in execs {
            p.close_io().await;
        }
        c._oom.lock().unwrap().take();
        c.sandbox.stop().await;
        if c.rootfs_mounted {
            bundle::unmount_rootfs(&c.bundle);
        }
        self.map.lock().unwrap().remove(id);
        self.events
            .publish(TaskEvent::Delete {
                container_id: id.into(),
                pid: exit.pid,
                exit_status: exit.status,
                exited_at: exit.at,
            })
            .await;
        Ok(exit)
    }
}
