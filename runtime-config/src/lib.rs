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
//! - The CRI plugin sends the `[...runtimes.crab.options]` table of
//!   containerd's config: `ConfigPath = "/etc/crab/config.toml"` as
//!   `config_path`, or `ConfigBody = '''...'''` (the TOML itself) as
//!   `config_body`. `examples/containerd-config.toml` registers the `crab`
//!   handler; `examples/runtimeclass.yaml` is the matching Kubernetes
//!   RuntimeClass.
//! - With neither, the shim reads [`DEFAULT_CONFIG_PATH`] if it exists, and
//!   otherwise runs on the built-in defaults ([`Config::load_or_default`]).
//!
//! The shim uses `config_body` when present, else `config_path`. A path that
//! is given must exist: a typo should fail the container, not silently fall
//! back to defaults.
//!
//! `examples/crab.toml` lists every key with its default. Every key is
//! optional; unknown keys are errors, and errors name the key (`runc.root`),
//! the file and, where the TOML parser knows it, the line and column.
//!
//! containerd's runc options (`containerd.runc.v1.Options`) belong to its runc
//! shims and are not read by crab; runc settings live in the `[runc]` table.

mod config;
mod error;
pub mod runtime_options;

pub use config::{
    CheckpointConfig, CheckpointPolicy, Config, ConfigSource, EngineConfig, LimitsConfig,
    LogConfig, RestoreConfig, RuncConfig, StoreConfig, TurnBoundary, UnsignedImages,
    DEFAULT_CONFIG_PATH,
};
pub use error::{ConfigError, Location};
pub use runtime_options::{
    decode_runtime_options, shim_cgroup_of_start_options, RuntimeOptions, RUNTIME_OPTIONS_TYPE_URL,
};
