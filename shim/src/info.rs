//! `containerd-shim-crab-v1 -info`: what containerd's introspection service asks a shim binary
//! for (`RuntimeInfo` protobuf on stdout, the handler's runtime options `Any` on stdin). The CRI
//! plugin derives each runtime handler's features from it (`StatusResponse.runtime_handlers`:
//! recursive read-only mounts, user namespaces); a shim that cannot answer gets none, so the
//! kubelet refuses pods that need them on that handler while runc's handler takes them.
//!
//! The features are runc's own (`runc features`), as containerd's runc shim reports them, since
//! crab runs every container with runc.

use std::process::Command;

use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::{Message, MessageField};
use containerd_shim::protos::types::introspection::{RuntimeInfo, RuntimeVersion};

use crate::error::{Error, Result};
use crate::RUNTIME_ID;

/// The type URL containerd registers for the runtime-spec `Features` JSON.
const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// The shim's `RuntimeInfo` for the runtime options containerd wrote to stdin (`options`: the
/// marshalled `Any`, empty when the handler has none). The options are echoed back, as
/// containerd's runc shim does.
pub fn runtime_info(options: &[u8]) -> Result<RuntimeInfo> {
    let any = (!options.is_empty())
        .then(|| Any::parse_from_bytes(options))
        .transpose()
        .map_err(|e| Error::InvalidArgument(format!("runtime options: {e}")))?;
    let options = any.as_ref().map(|a| (a.type_url.clone(), a.value.clone()));
    let (config, _) = crate::containers::Containers::load_config(&options)?;
    let runc = config.resolve_runc_binary()?;
    let out = Command::new(&runc)
        .arg("features")
        .output()
        .map_err(|e| Error::Other(format!("{} features: {e}", runc.display())))?;
    if !out.status.success() {
        return Err(Error::Other(format!(
            "{} features: {}: {}",
            runc.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // containerd decodes the value as JSON; garbage would only fail there, with less context.
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .map_err(|e| Error::Other(format!("{} features is not JSON: {e}", runc.display())))?;
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
        .map_err(|e| Error::Other(format!("read runtime options from stdin: {e}")))
        .and_then(|_| runtime_info(&options))
        .and_then(|info| {
            info.write_to_bytes()
                .map_err(|e| Error::Other(format!("encode RuntimeInfo: {e}")))
        });
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
            type_url: "containerd.runc.v1.Options".into(),
            value: vec![0x08, 0x01],
            ..Default::default()
        };
        let err = runtime_info(&any.write_to_bytes().unwrap()).unwrap_err();
        assert!(err.to_string().contains("not crab's"), "{err}");
    }
}
