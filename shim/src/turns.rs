//! Turn boundaries: the annotations that end a turn, and the spec annotations that say how a
//! container's turns end and which checkpoints they take. (What a turn end then does is the
//! sandbox's: [`crate::sandbox`].)
//!
//! A harness ends a turn by calling containerd's `Tasks.Update` with the annotation
//! [`TURN_END`] set to its turn id (`resources` may be empty). The answer is logged and
//! stored as `<state_dir>/<namespace>/<container>/turns/<seq>.json`.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// `Tasks.Update` annotation ending a turn; its value is the harness's turn id.
pub const TURN_END: &str = "io.crab/turn-end";
/// Container spec annotation choosing what ends a turn (`annotation` or `exec`); overrides
/// `[checkpoint] turn_boundary`.
pub const TURN_BOUNDARY: &str = "io.crab/turn-boundary";
/// Every annotation crab interprets starts with this; other keys are kept untouched.
pub const ANNOTATION_PREFIX: &str = "io.crab/";
const MAX_TURN_ID: usize = 256;

/// The spec annotation CRI sets on a pod's infrastructure (pause) container.
const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// At most this many annotations in one `Tasks.Update`, of at most [`MAX_UPDATE_BYTES`] in
/// all: what a harness sends is a handful of short keys.
const MAX_UPDATE_ANNOTATIONS: usize = 64;
const MAX_UPDATE_BYTES: usize = 64 << 10;

/// The crab annotations a container's spec may carry; any other `io.crab/` key is a typo that
/// must not silently change nothing.
pub const SPEC_ANNOTATIONS: [&str; 2] =
    [TURN_BOUNDARY, crate::checkpoint::policy::POLICY_ANNOTATION];

/// Refuses a spec with an `io.crab/` annotation crab does not know.
pub fn check_spec_annotations(spec: &oci_spec::runtime::Spec) -> Result<()> {
    let unknown = spec
        .annotations()
        .iter()
        .flatten()
        .map(|(k, _)| k)
        .find(|k| k.starts_with(ANNOTATION_PREFIX) && !SPEC_ANNOTATIONS.contains(&k.as_str()));
    match unknown {
        Some(key) => Err(Error::InvalidArgument(format!(
            "unknown crab annotation `{key}` in the container's spec (known: {})",
            SPEC_ANNOTATIONS.join(", ")
        ))),
        None => Ok(()),
    }
}

/// The turn id requested by `annotations`, if any; malformed crab annotations are errors
/// (and nothing is done).
pub fn requested_turn_end(annotations: &HashMap<String, String>) -> Result<Option<String>> {
    let bytes: usize = annotations.iter().map(|(k, v)| k.len() + v.len()).sum();
    if annotations.len() > MAX_UPDATE_ANNOTATIONS || bytes > MAX_UPDATE_BYTES {
        return Err(Error::InvalidArgument(format!(
            "{} annotations of {bytes} bytes in one update: at most {MAX_UPDATE_ANNOTATIONS} of \
             {MAX_UPDATE_BYTES} bytes in all",
            annotations.len()
        )));
    }
    for key in annotations
        .keys()
        .filter(|k| k.starts_with(ANNOTATION_PREFIX))
    {
        if key != TURN_END {
            return Err(Error::InvalidArgument(format!(
                "unknown crab annotation `{key}` (known: {TURN_END})"
            )));
        }
    }
    let Some(id) = annotations.get(TURN_END) else {
        return Ok(None);
    };
    if id.is_empty() || id.len() > MAX_TURN_ID || id.chars().any(|c| c.is_control()) {
        return Err(Error::InvalidArgument(format!(
            "annotation {TURN_END} must be a turn id of 1 to {MAX_TURN_ID} printable characters, got {id:?}"
        )));
    }
    Ok(Some(id.clone()))
}

/// Whether each finished exec ends a turn (zero-integration mode) for this container.
pub fn exec_boundary(
    spec: &oci_spec::runtime::Spec,
    configured: crab_runtime_config::TurnBoundary,
) -> Result<bool> {
    use crab_runtime_config::TurnBoundary;
    match crate::bundle::annotation(spec, &[TURN_BOUNDARY]) {
        None => Ok(configured == TurnBoundary::Exec),
        Some("exec") => Ok(true),
        Some("annotation") => Ok(false),
        Some(other) => Err(Error::InvalidArgument(format!(
            "spec annotation {TURN_BOUNDARY} must be `exec` or `annotation`, got {other:?}"
        ))),
    }
}

/// Whether a container is watched: not CRI's pause containers (pure infrastructure).
pub fn is_inspected(spec: &oci_spec::runtime::Spec) -> bool {
    crate::bundle::annotation(spec, &[CRI_CONTAINER_TYPE]) != Some("sandbox")
}

#[cfg(test)]
mod tests {
    #[test]
    fn unknown_crab_spec_annotations_are_refused() {
        let spec = |key: &str| -> oci_spec::runtime::Spec {
            serde_json::from_value(serde_json::json!({
                "ociVersion": "1.0.2",
                "annotations": {key: "x", "io.other/anything": "y"}
            }))
            .unwrap()
        };
        for known in SPEC_ANNOTATIONS {
            check_spec_annotations(&spec(known)).unwrap();
        }
        check_spec_annotations(&spec("io.kubernetes.cri.sandbox-id")).unwrap();
        for typo in ["io.crab/checkpoint-polcy", "io.crab/turn-end", "io.crab/"] {
            let e = check_spec_annotations(&spec(typo)).unwrap_err().to_string();
            assert!(
                e.contains(typo) && e.contains("io.crab/checkpoint-policy"),
                "{e}"
            );
        }
    }

    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn turn_end_annotations() {
        assert_eq!(requested_turn_end(&ann(&[])).unwrap(), None);
        assert_eq!(
            requested_turn_end(&ann(&[("other/key", "x")])).unwrap(),
            None
        );
        assert_eq!(
            requested_turn_end(&ann(&[(TURN_END, "turn-7")]))
                .unwrap()
                .as_deref(),
            Some("turn-7")
        );
        let e = requested_turn_end(&ann(&[(TURN_END, "")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(TURN_END), "{e}");
        assert!(requested_turn_end(&ann(&[(TURN_END, "a\nb")])).is_err());
        assert!(requested_turn_end(&ann(&[(TURN_END, &"x".repeat(300))])).is_err());
        let e = requested_turn_end(&ann(&[("io.crab/turn-ned", "1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("io.crab/turn-ned"), "{e}");
        // Bounded: many keys, or a few huge ones.
        let many: Vec<(String, String)> =
            (0..65).map(|i| (format!("k{i}"), String::new())).collect();
        let many: HashMap<String, String> = many.into_iter().collect();
        assert!(requested_turn_end(&many)
            .unwrap_err()
            .to_string()
            .contains("at most 64"));
        let huge: HashMap<String, String> = [("k".to_string(), "x".repeat(70_000))].into();
        assert!(requested_turn_end(&huge).is_err());
    }
}
