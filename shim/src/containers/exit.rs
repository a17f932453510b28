//! Exits: the reaper's exits matched to their processes, a turn ended at an exec's exit, and
//! init's exit published after its execs'.

use std::{sync::Arc, time::Duration};

use super::{Container, Containers};
use crate::{
    events::TaskEvent,
    process::{ExitInfo, Process},
};

/// How long an exit waits for the process's output to be copied out before it is published.
/// Output held open by a process left behind is not waited for beyond this.
const OUTPUT_DRAIN_BOUND: Duration = Duration::from_millis(500);

impl Containers {
    /// Process `pid` exited with `code`: handled, off the reaper loop, if it is one of ours.
    pub(super) fn on_exit(self: &Arc<Self>, pid: u32, code: i32) {
        let owner = self.pids.lock().unwrap().exited(pid, code);
        let Some((cid, exec_id)) = owner else { return };
        let Ok(c) = self.get(&cid) else { return };
        let Ok(p) = c.process(&exec_id) else { return };
        let this = self.clone();
        // Exits are handled off the reaper loop: draining output may take a moment.
        tokio::spawn(async move { this.handle_exit(c, p, code).await });
    }

    /// Process `p` of container `c` exited with `code`: its output drained, its exit recorded
    /// and published (init's after its execs').
    pub(super) async fn handle_exit(&self, c: Arc<Container>, p: Arc<Process>, code: i32) {
        drop(p.start_lock.lock().await);
        p.drain_output(OUTPUT_DRAIN_BOUND).await;
        let Some(info) = p.record_exit(code as u32) else {
            return;
        };
        log::debug!(
            "container {} process {} (pid {}) exited with {}",
            c.id,
            p.display_id(),
            info.pid,
            info.status
        );
        if p.exec_id.is_empty() {
            if c.kill_all_on_exit {
                if let Err(e) = c.runc.kill(&c.id, libc::SIGKILL as u32, true).await {
                    log::debug!("kill --all after init exit of {}: {e}", c.id);
                }
            }
            if c.running_execs() > 0 {
                *c.init_exit_pending.lock().unwrap() = Some(info);
                return;
            }
            self.publish_exit(&c, &p, info).await;
        } else {
            // In exec-boundary mode the turn ends before the exit is published: the client can
            // start its next action only after the answer exists (and that action then waits
            // for the checkpoint).
            if !p.probe && c.sandbox.ends_turns_at_exec_exit() && c.running_execs() == 0 {
                let turn_id = format!("exec-{}", p.exec_id);
                if let Err(e) = c.sandbox.end_turn(&turn_id, || c.running_exec_pids()).await {
                    log::error!("turn end after exec {} of {}: {e}", p.exec_id, c.id);
                }
            }
            self.publish_exit(&c, &p, info).await;
            if c.running_execs() == 0 {
                let pending = c.init_exit_pending.lock().unwrap().take();
                if let Some(init_info) = pending {
                    self.publish_exit(&c, &c.init, init_info).await;
                }
            }
        }
    }

    async fn publish_exit(&self, c: &Container, p: &Process, info: ExitInfo) {
        let id = if p.exec_id.is_empty() {
            c.id.clone()
        } else {
            p.exec_id.clone()
        };
        self.events
            .publish(TaskEvent::Exit {
                container_id: c.id.clone(),
                id,
                pid: info.pid,
                exit_status: info.status,
                exited_at: info.at,
            })
            .await;
        p.announce_exit(info);
    }
}
