//! The protocol edge: containerd's shim lifecycle (`start`/`delete` commands) and the ttrpc
//! Task service. Requests are converted to plain values for [`crate::containers`]; the core's
//! events go out as containerd's ([`events`]); errors go back as ttrpc status codes
//! ([`status`]). The only part of crab that speaks containerd's protocol: [`info`] answers
//! `-info`, [`metrics`] formats a task's cgroup statistics as containerd reports them.

mod convert;
pub mod events;
pub mod info;
pub mod metrics;
pub mod snapshots;
pub mod status;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use async_trait::async_trait;
use containerd_shim::{
    api,
    protos::{
        protobuf::{well_known_types::any::Any, Message},
        shim::oci::{CheckpointOptions, ProcessDetails},
        types::task::ProcessInfo,
    },
    publisher::RemotePublisher,
    ExitSignal, Flags, StartOpts, TtrpcContext, TtrpcResult,
};
use containerd_shim_protos::types::empty::Empty;
use crab_runtime_config::Config;

use self::convert::{api_status, rootfs_mount, timestamp};
use crate::{
    bundle,
    containers::{Containers, CreateParams, TaskCheckpointOptions},
    error::{Error, Result},
    events::EventSender,
    reaper::ExitSubscription,
    runc::{OciRuntime as _, Runc},
    stdio::StdioSpec,
};

pub struct Service {
    id: String,
    namespace: String,
    /// containerd's gRPC address (`-address`): where a restore asks which layers it unpacked.
    address: String,
    exit: Arc<ExitSignal>,
}

#[async_trait]
impl containerd_shim::Shim for Service {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, config: &mut containerd_shim::Config) -> Self {
        // The shim-wide log level comes from the default config file; per-container config
        // (runtime options) arrives only with Create, after logging is set up.
        if let Ok((c, _)) = Config::load_or_default(None) {
            config.default_log_level = c.log.level.to_string().to_lowercase();
        }
        // The daemon (no action) logs to the bundle's `log` FIFO, one write per record
        // (crate::shimlog); the framework's logger, which tears records, is not set up.
        if args.action.is_empty() {
            config.no_setup_logger = true;
            if let Err(e) = crate::shimlog::init(args.debug, &config.default_log_level) {
                eprintln!("crab shim: no log: {e}");
            }
        }
        Service {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            address: args.address.clone(),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        let grouping = crate::grouping::grouping(
            bundle::read_spec(Path::new(".")).ok().as_ref(),
            &opts.id,
            &self.namespace,
        )
        .map_err(|e| containerd_shim::Error::InvalidArgument(e.to_string()))?;
        // containerd writes the runtime options to the start command's stdin, and the
        // framework's spawn() parses whatever it finds there as *runc's* options (field 3 of
        // which is `shim_cgroup`): crab's options (`runtimeoptions.v1.Options`, whose field 3 is
        // the inline config) would be taken for a cgroup path. Consume them first; crab reads
        // its options from the Create request instead.
        // A `shim_cgroup` among runc-typed options is honoured: the daemon joins it.
        let mut options = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut options);
        let shim_cgroup = crab_runtime_config::shim_cgroup_of_start_options(&options);
        let vars = match &shim_cgroup {
            Some(path) => vec![(crate::placement::SHIM_CGROUP_ENV, path.as_str())],
            None => Vec::new(),
        };
        let address = containerd_shim::spawn(opts, &grouping, vars).await?;
        std::fs::write("address", &address).map_err(|e| {
            containerd_shim::Error::Other(format!("cannot write address file: {e}"))
        })?;
        Ok(address)
    }

    /// Cleans up after a shim that died: containerd runs this in the task's bundle.
    async fn delete_shim(&mut self) -> containerd_shim::Result<api::DeleteResponse> {
        let bundle =
            std::env::current_dir().map_err(|e| containerd_shim::Error::Other(e.to_string()))?;
        let runc = match bundle::load_runc(&bundle) {
            Ok(Some(runc)) => Some(runc),
            Ok(None) => default_runc(&self.namespace, &bundle),
            Err(e) => {
                log::warn!("{e}");
                default_runc(&self.namespace, &bundle)
            }
        };
        if let Some(runc) = runc {
            if let Err(e) = runc.delete(&self.id, true).await {
                log::warn!("delete {}: {e}", self.id);
            }
        }
        bundle::unmount_rootfs(&bundle);
        // Its restore copy, if it was restored (the next restore on the host would sweep it).
        crate::restore::scratch::remove_recorded(&bundle);
        Ok(api::DeleteResponse {
            pid: bundle::read_init_pid(&bundle).unwrap_or_default(),
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: Some(timestamp(SystemTime::now())).into(),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        crate::placement::place_daemon();
        let exits = ExitSubscription::new()
            .await
            .expect("subscribe to process exits");
        let (events, to_publish) = EventSender::channel();
        events::forward(publisher, self.namespace.clone(), to_publish);
        let containers = Containers::new(
            self.namespace.clone(),
            Arc::new(snapshots::ContainerdSnapshots::new(self.address.clone())),
            events,
            self.exit.clone(),
        );
        containers.spawn_exit_loop(exits);
        TaskService { containers }
    }
}

fn default_runc(namespace: &str, bundle: &Path) -> Option<Runc> {
    let config = Config::load_or_default(None).ok()?.0;
    Runc::from_config(&config, None, namespace, bundle).ok()
}

pub struct TaskService {
    containers: Arc<Containers>,
}

fn log_err<T>(rpc: &str, id: &str, r: Result<T>) -> TtrpcResult<T> {
    r.map_err(|e| {
        log::info!("{rpc} {id}: {e}");
        status::to_ttrpc(e)
    })
}

/// The ttrpc status for an error the RPC does not log.
fn unlogged<T>(r: Result<T>) -> TtrpcResult<T> {
    r.map_err(status::to_ttrpc)
}

#[async_trait]
impl containerd_shim::Task for TaskService {
    async fn create(
        &self,
        _: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let params = CreateParams {
            id: req.id.clone(),
            bundle: PathBuf::from(&req.bundle),
            rootfs: req.rootfs.iter().map(rootfs_mount).collect(),
            stdio: StdioSpec {
                stdin: req.stdin,
                stdout: req.stdout,
                stderr: req.stderr,
                terminal: req.terminal,
            },
            options: req
                .options
                .as_ref()
                .map(|a| (a.type_url.clone(), a.value.clone())),
            checkpoint: req.checkpoint,
        };
        let pid = log_err("create", &req.id, self.containers.create(params).await)?;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    async fn start(
        &self,
        _: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        let pid = log_err(
            "start",
            &req.id,
            self.containers.start(&req.id, &req.exec_id).await,
        )?;
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    async fn state(
        &self,
        _: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let s = unlogged(self.containers.state(&req.id, &req.exec_id))?;
        let exit = s.snapshot.exit;
        Ok(api::StateResponse {
            id: if s.exec_id.is_empty() {
                s.container_id
            } else {
                s.exec_id.clone()
            },
            bundle: s.bundle.display().to_string(),
            pid: s.snapshot.pid,
            status: api_status(s.snapshot.status).into(),
            stdin: s.stdio.stdin,
            stdout: s.stdio.stdout,
            stderr: s.stdio.stderr,
            terminal: s.stdio.terminal,
            exit_status: exit.map(|e| e.status).unwrap_or_default(),
            exited_at: exit.map(|e| timestamp(e.at)).into(),
            exec_id: s.exec_id,
            ..Default::default()
        })
    }

    async fn delete(
        &self,
        _: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        let exit = log_err(
            "delete",
            &req.id,
            self.containers.delete(&req.id, &req.exec_id).await,
        )?;
        Ok(api::DeleteResponse {
            pid: exit.pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn pids(
        &self,
        _: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        let pids = log_err("pids", &req.id, self.containers.pids(&req.id).await)?;
        let processes = pids
            .into_iter()
            .map(|(pid, exec_id)| {
                let info = exec_id.and_then(|exec_id| {
                    let details = ProcessDetails {
                        exec_id,
                        ..Default::default()
                    };
                    Some(Any {
                        type_url: "containerd.runc.v1.ProcessDetails".into(),
                        value: details.write_to_bytes().ok()?,
                        ..Default::default()
                    })
                });
                ProcessInfo {
                    pid,
                    info: info.into(),
                    ..Default::default()
                }
            })
            .collect();
        Ok(api::PidsResponse {
            processes,
            ..Default::default()
        })
    }

    async fn pause(&self, _: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<Empty> {
        log_err("pause", &req.id, self.containers.pause(&req.id).await)?;
        Ok(Empty::new())
    }

    async fn resume(&self, _: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<Empty> {
        log_err("resume", &req.id, self.containers.resume(&req.id).await)?;
        Ok(Empty::new())
    }

    async fn checkpoint(
        &self,
        _: &TtrpcContext,
        req: api::CheckpointTaskRequest,
    ) -> TtrpcResult<Empty> {
        let o = match req.options.as_ref().filter(|a| !a.value.is_empty()) {
            Some(any) => unlogged(
                CheckpointOptions::parse_from_bytes(&any.value)
                    .map_err(|e| Error::InvalidArgument(format!("checkpoint options: {e}"))),
            )?,
            None => CheckpointOptions::default(),
        };
        let path = if o.image_path.is_empty() {
            req.path.clone()
        } else {
            o.image_path.clone()
        };
        if path.is_empty() {
            return unlogged(Err(Error::InvalidArgument(
                "checkpoint needs an image path".into(),
            )));
        }
        let opts = TaskCheckpointOptions {
            exit: o.exit,
            open_tcp: o.open_tcp,
            external_unix_sockets: o.external_unix_sockets,
            terminal: o.terminal,
            file_locks: o.file_locks,
            cgroups_mode: (!o.cgroups_mode.is_empty()).then(|| o.cgroups_mode.clone()),
            work_path: (!o.work_path.is_empty()).then(|| PathBuf::from(&o.work_path)),
            work_path_was_default: o.work_path.is_empty(),
        };
        log_err(
            "checkpoint",
            &req.id,
            self.containers
                .checkpoint_task(&req.id, Path::new(&path), opts)
                .await,
        )?;
        Ok(Empty::new())
    }

    async fn kill(&self, _: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<Empty> {
        log_err(
            "kill",
            &req.id,
            self.containers
                .kill(&req.id, &req.exec_id, req.signal, req.all)
                .await,
        )?;
        Ok(Empty::new())
    }

    async fn exec(&self, _: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<Empty> {
        let stdio = StdioSpec {
            stdin: req.stdin,
            stdout: req.stdout,
            stderr: req.stderr,
            terminal: req.terminal,
        };
        let spec = req
            .spec
            .as_ref()
            .map(|a| a.value.clone())
            .unwrap_or_default();
        log_err(
            "exec",
            &req.id,
            self.containers
                .add_exec(&req.id, &req.exec_id, stdio, spec)
                .await,
        )?;
        Ok(Empty::new())
    }

    async fn resize_pty(&self, _: &TtrpcContext, req: api::ResizePtyRequest) -> TtrpcResult<Empty> {
        unlogged(
            self.containers
                .resize_pty(&req.id, &req.exec_id, req.width, req.height)
                .await,
        )?;
        Ok(Empty::new())
    }

    async fn close_io(&self, _: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<Empty> {
        if req.stdin {
            unlogged(self.containers.close_stdin(&req.id, &req.exec_id).await)?;
        }
        Ok(Empty::new())
    }

    async fn update(&self, _: &TtrpcContext, req: api::UpdateTaskRequest) -> TtrpcResult<Empty> {
        let resources = req.resources.as_ref().map(|a| a.value.clone());
        log_err(
            "update",
            &req.id,
            self.containers
                .update(&req.id, resources, req.annotations)
                .await,
        )?;
        Ok(Empty::new())
    }

    async fn wait(
        &self,
        _: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        let exit = unlogged(self.containers.wait(&req.id, &req.exec_id).await)?;
        Ok(api::WaitResponse {
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn stats(
        &self,
        _: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let pid = unlogged(self.containers.init_pid(&req.id))?;
        let stats = metrics::collect(pid).map_err(|e| status::stats_failed(&req.id, e))?;
        Ok(api::StatsResponse {
            stats: Some(stats).into(),
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        _: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let task_pid = self.containers.init_pid(&req.id).unwrap_or_default();
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _: &TtrpcContext, req: api::ShutdownRequest) -> TtrpcResult<Empty> {
        self.containers.shutdown(req.now);
        Ok(Empty::new())
    }
}
