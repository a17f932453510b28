//! crab's configuration: a TOML file with built-in defaults and validation.
//!
//! # How the config reaches the shim
//!
//! containerd starts `containerd-shim-crab-v1` with no arguments that could
//! carry crab settings; they arrive as the task's runtime options, which the
//! shim reads on `Create` (see [`runtime_options`]):
//!
//! - `ctr run --runtime io.containerd.crab.v1 --runtime-config-path /path/crab.toml ...`
//!   sends the path as `config_path`.
//! - The CRI plugin sends the `[...runtimes.crab-v1.options]` table of a handler of
//!   crab's own runtime type: `ConfigPath = "/etc/crab/config.toml"` as
//!   `config_path`, or `ConfigBody = '''...'''` (the TOML itself) as
//!   `config_body`. For Kubernetes, `examples/containerd-config.toml` registers
//!   the `crab` handler with runc's runtime type instead (next item);
//!   `examples/runtimeclass.yaml` is the matching Kubernetes RuntimeClass.
//! - With neither (and when crab is registered with runc's runtime type, whose options cannot
//!   name a config), the shim reads the file `$CRAB_CONFIG` names ([`CONFIG_ENV`], which must
//!   exist), else [`DEFAULT_CONFIG_PATH`] if it exists, and otherwise runs on the built-in
//!   defaults ([`Config::load_or_default`]). runc's options (`BinaryName`, `Root`,
//!   `SystemdCgroup`) then override the `[runc]` table ([`RuncOptions`]).
//!
//! The shim uses `config_body` when present, else `config_path`. A path that
//! is given must exist: a typo should fail the container, not silently fall
//! back to defaults.
//!
//! `examples/crab.toml` lists every key with its default. Every key is
//! optional; unknown keys are errors, and errors name the key (`runc.root`),
//! the file and, where the TOML parser knows it, the line and column.
//!

mod config;
mod error;
pub mod runtime_options;

pub use config::{
    is_group_name, CheckpointConfig, CheckpointPolicy, Config, ConfigSource, EngineConfig,
    LimitsConfig, LogConfig, NetnsDump, ProcessDump, ReplicationConfig, RestoreConfig, RuncConfig,
    SelfContainedChanges, ShimConfig, StoreConfig, TurnBoundary, UnsignedImages, CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
};
pub use error::{ConfigError, Location};
pub use runtime_options::{
    decode_runc_options, decode_runtime_options, shim_cgroup_of_start_options, RuncOptions,
    RuntimeOptions, ShimOptions, RUNC_OPTIONS_TYPE_URL, RUNTIME_OPTIONS_TYPE_URL,
};
