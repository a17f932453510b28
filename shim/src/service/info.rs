//! `containerd-shim-crab-v1 -info`: what containerd's introspection service asks a shim binary
//! for (`RuntimeInfo` protobuf on stdout, the handler's runtime options `Any` on stdin). The CRI
//! plugin derives each runtime handler's features from it (`StatusResponse.runtime_handlers`:
//! recursive read-only mounts, user namespaces); a shim that cannot answer gets none, so the
//! kubelet refuses pods that need them on that handler while runc's handler takes them.
//!
//! The features are runc's own (`runc features`), as containerd's runc shim reports them, since
//! crab runs every container with runc.

use std::{path::PathBuf, process::Command};

use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::{self, Message, MessageField};
use containerd_shim::protos::types::introspection::{RuntimeInfo, RuntimeVersion};

use crate::error::Error;
use crate::RUNTIME_ID;

/// Why the shim cannot say what it supports.
#[derive(Debug, thiserror::Error)]
pub enum InfoError {
    /// The runtime options or crab's config they name, or running runc.
    #[error(transparent)]
    Shim(#[from] Error),
    #[error("{} features: {status}: {stderr}", runc.display())]
    Features {
        runc: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{} features is not JSON: {source}", runc.display())]
    NotJson {
        runc: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("read runtime options from stdin: {0}")]
    Stdin(#[source] std::io::Error),
    #[error("encode RuntimeInfo: {0}")]
    Encode(#[source] protobuf::Error),
}

/// The type URL containerd registers for the runtime-spec `Features` JSON.
const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// The shim's `RuntimeInfo` for the runtime options containerd wrote to stdin (`options`: the
/// marshalled `Any`, empty when the handler has none). The options are echoed back, as
/// containerd's runc shim does.
pub fn runtime_info(options: &[u8]) -> Result<RuntimeInfo, InfoError> {
    let any = (!options.is_empty())
        .then(|| Any::parse_from_bytes(options))
        .transpose()
        .map_err(|e| Error::InvalidArgument(format!("runtime options: {e}")))?;
    let options = any.as_ref().map(|a| (a.type_url.clone(), a.value.clone()));
    let (config, _, _) = crate::containers::Containers::load_config(&options)?;
    let runc = config.resolve_runc_binary().map_err(Error::from)?;
    let out = Command::new(&runc)
        .arg("features")
        .output()
        .map_err(Error::io(format!("{} features", runc.display())))?;
    if !out.status.success() {
        return Err(InfoError::Features {
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            runc,
        });
    }
    // containerd decodes the value as JSON; garbage would only fail there, with less context.
    if let Err(source) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
        return Err(InfoError::NotJson { runc, source });
    }
    Ok(RuntimeInfo {
        name: RUNTIME_ID.into(),
        version: MessageField::some(RuntimeVersion {
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        }),
        options: any.map(MessageField::some).unwrap_or_default(),
        features: MessageField::some(Any {
            type_url: FEATURES_TYPE_URL.into(),
            value: out.stdout,
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Handles `-info`: reads the options from stdin, writes the `RuntimeInfo` to stdout. The exit
/// code for the process.
pub fn print() -> i32 {
    use std::io::{Read, Write};
    let mut options = Vec::new();
    let info = std::io::stdin()
        .read_to_end(&mut options)
        .map_err(InfoError::Stdin)
        .and_then(|_| runtime_info(&options))
        .and_then(|info| info.write_to_bytes().map_err(InfoError::Encode));
    match info {
        Ok(bytes) => match std::io::stdout().write_all(&bytes) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{RUNTIME_ID}: write RuntimeInfo: {e}");
                1
            }
        },
        Err(e) => {
            eprintln!("{RUNTIME_ID}: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// runc answers `features` on every machine crab runs on.
    #[test]
    fn features_are_runcs() {
        let info = runtime_info(&[]).unwrap();
        assert_eq!(info.name, RUNTIME_ID);
        let features = info.features.as_ref().unwrap();
        assert_eq!(features.type_url, FEATURES_TYPE_URL);
        let json: serde_json::Value = serde_json::from_slice(&features.value).unwrap();
        assert!(
            json["mountOptions"]
                .as_array()
                .is_some_and(|o| !o.is_empty()),
            "{json}"
        );
    }

    #[test]
    fn options_of_another_runtime_are_refused() {
        let any = Any {
            type_url: "io.containerd.runsc.v1.options".into(),
            value: vec![0x08, 0x01],
            ..Default::default()
        };
        let err = runtime_info(&any.write_to_bytes().unwrap()).unwrap_err();
        assert!(err.to_string().contains("neither crab's"), "{err}");
    }

    /// Registered with runc's runtime type, crab gets runc's options on `-info` too (containerd
    /// validates every runc-type handler this way before its first container): it answers, with
    /// runc's features, and echoes them.
    #[test]
    fn runc_options_are_answered() {
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: vec![0x32, 0x04, b'r', b'u', b'n', b'c'], // binary_name = "runc"
            ..Default::default()
        };
        let info = runtime_info(&any.write_to_bytes().unwrap()).unwrap();
        assert_eq!(info.options.as_ref().unwrap().type_url, any.type_url);
        assert_eq!(info.features.as_ref().unwrap().type_url, FEATURES_TYPE_URL);
        // A BinaryName that is no executable fails -info with runc's name in the message.
        let bad = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: [vec![0x32, 0x0e], b"/no/such/runc1".to_vec()].concat(),
            ..Default::default()
        };
        let err = runtime_info(&bad.write_to_bytes().unwrap()).unwrap_err();
        assert!(err.to_string().contains("/no/such/runc1"), "{err}");
    }
}
