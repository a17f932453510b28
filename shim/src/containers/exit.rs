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
                if let Err(e) = c.runtime.kill(&c.id, libc::SIGKILL as u32, true).await {
                    log::debug!("kill --all after init exit of {}: {e}", c.id);
                }
            }
            {
                // Checked and set under the lock that an exec takes after announcing its exit:
                // either it sees this pending exit, or this sees its exit announced.
                let mut pending = c.init_exit_pending.lock().unwrap();
                if c.unannounced_execs() > 0 {
                    *pending = Some(info);
                    return;
                }
            }
            self.publish_exit(&c, &p, info).await;
        } else {
            // In exec-boundary mode the turn ends before the exit is published: the client can
            // start its next action only after the answer exists (and that action then waits
            // for the checkpoint).
            if !p.probe && c.sandbox.ends_turns_at_exec_exit() && c.running_execs() == 0 {
                let turn_id = format!("exec-{}", p.exec_id);
                if init_is_exiting(&c.init) {
                    // Killed with its container (init died: the kernel kills the rest of the
                    // pid namespace before init's own exit): the turn was interrupted, and a
                    // recovery goes back to the last turn end, not to this half.
                    log::info!(
                        "exec {} of {} ended with its container's init: turn {turn_id} was \
                         interrupted, not ended",
                        p.exec_id,
                        c.id
                    );
                } else if let Err(e) = c.sandbox.end_turn(&turn_id, || c.running_exec_pids()).await
                {
                    log::error!("turn end after exec {} of {}: {e}", p.exec_id, c.id);
                }
            }
            self.publish_exit(&c, &p, info).await;
            let pending = {
                let mut pending = c.init_exit_pending.lock().unwrap();
                match c.unannounced_execs() {
                    0 => pending.take(),
                    _ => None,
                }
            };
            if let Some(init_info) = pending {
                self.publish_exit(&c, &c.init, init_info).await;
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

/// Whether the container's init has exited or is exiting: its exit recorded, or the kernel's
/// `PF_EXITING` on it (while init exits, the kernel kills the rest of its pid namespace and
/// waits for them: their exits come first), a zombie, or gone.
fn init_is_exiting(init: &Process) -> bool {
    if init.status() == crate::process::Status::Stopped {
        return true;
    }
    let pid = init.pid();
    if pid == 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat_says_exiting(&stat),
        Err(_) => true,
    }
}

/// `PF_EXITING` in a task's flags, or a dead state, in the text of `/proc/PID/stat` (fields
/// after the comm, which only the last ')' ends: state is field 3, flags field 9).
fn stat_says_exiting(stat: &str) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let rest: Vec<&str> = stat[close + 1..].split_ascii_whitespace().collect();
    let dead = matches!(rest.first(), Some(&("Z" | "X" | "x")));
    let flags = rest.get(6).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    dead || flags & PF_EXITING != 0
}

#[cfg(test)]
mod tests {
    use super::stat_says_exiting;

    #[test]
    fn an_exiting_or_dead_init_reads_so_in_its_stat() {
        // A sleeping init, its flags PF_FORKNOEXEC | PF_RANDOMIZE (a comm with ") S" inside).
        let alive = "306 (sle) S ep) S 280 306 306 0 -1 4194560 130 0 0 0 0 0 0 0 20 0 1 0 99 0";
        assert!(!stat_says_exiting(alive));
        // In do_exit (PF_EXITING), still sleeping while the kernel empties its pid namespace.
        let exiting = "306 (sleep) S 280 306 306 0 -1 4194564 130 0 0 0 0 0 0 0 20 0 1 0 99 0";
        assert!(stat_says_exiting(exiting));
        assert!(stat_says_exiting(
            "306 (sleep) Z 280 306 306 0 -1 4194560 0"
        ));
        assert!(!stat_says_exiting("garbage"));
    }
}
