//! Conversions between containerd's protocol types and the plain values of crab's core.

use std::time::SystemTime;

use containerd_shim::protos::{
    api::Status as ApiStatus, protobuf::well_known_types::timestamp::Timestamp, types::mount::Mount,
};

use crate::{bundle::RootfsMount, process::Status};

/// A rootfs mount of a Create request, as crab's core takes it.
pub fn rootfs_mount(m: &Mount) -> RootfsMount {
    RootfsMount {
        kind: m.type_.clone(),
        source: m.source.clone(),
        target: m.target.clone(),
        options: m.options.clone(),
    }
}

/// A rootfs mount as containerd's events carry it.
pub fn containerd_mount(m: &RootfsMount) -> Mount {
    Mount {
        type_: m.kind.clone(),
        source: m.source.clone(),
        target: m.target.clone(),
        options: m.options.clone(),
        ..Default::default()
    }
}

/// A time as protobuf's `Timestamp` (seconds and nanoseconds since the epoch).
pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

/// A process status as the Task API names it.
pub fn api_status(s: Status) -> ApiStatus {
    match s {
        Status::Created => ApiStatus::CREATED,
        Status::Running => ApiStatus::RUNNING,
        Status::Paused => ApiStatus::PAUSED,
        Status::Stopped => ApiStatus::STOPPED,
    }
}
