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
/// `Tasks.Update` annotation asking for an in-place rollback ([`crate::rollback`]); its value
/// is the sequence number of the checkpoint to return to (crabctl resolves turn ids to it).
pub const ROLLBACK: &str = "io.crab/rollback";
/// Container spec annotation choosing what ends a turn (`annotation` or `exec`); overrides
/// `[checkpoint] turn_boundary`.
pub const TURN_BOUNDARY: &str = "io.crab/turn-boundary";
/// Container spec annotation naming the commands that are not agent actions (the kubelet's exec
/// probes): a JSON array of argv prefixes, e.g. `[["cat", "/tmp/healthy"], ["/bin/check"]]`. An
/// exec whose argv begins with one of them neither waits for the last turn's checkpoint nor ends
/// a turn ([`probe_commands`]).
pub const PROBE_COMMANDS: &str = "io.crab/probe-commands";
/// At most this many probe commands, of at most [`MAX_PROBE_BYTES`] of annotation value.
const MAX_PROBES: usize = 16;
const MAX_PROBE_BYTES: usize = 4096;
/// Every annotation crab interprets starts with this; other keys are kept untouched.
pub const ANNOTATION_PREFIX: &str = "io.crab/";
const MAX_TURN_ID: usize = 256;

/// The spec annotation CRI sets on a pod's infrastructure (pause) container.
const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// At most this many annotations in one `Tasks.Update`, of at most [`MAX_UPDATE_BYTES`] in
/// all: what a harness sends is a handful of short keys.
const MAX_UPDATE_ANNOTATIONS: usize = 64;
const MAX_UPDATE_BYTES: usize = 64 << 10;

/// Container spec annotation naming the container's lineage ([`lineage`]): the name its
/// checkpoints are found by when a later container of the same lineage resumes ([`RESUME`]).
pub const LINEAGE: &str = "io.crab/lineage";
/// Container spec annotation: `newest` starts the container from the newest durable checkpoint
/// of its lineage on this node instead of fresh (`containers::resume`).
pub const RESUME: &str = "io.crab/resume";
/// At most this long, a lineage name (the annotation's value, before a pod's namespace is put
/// in front of it).
const MAX_LINEAGE: usize = 253;

/// Container spec annotation: `true` marks every process of the container for the kernel's
/// same-page merging ([`crate::sys::ksm`]), so that forks restored from one image share their
/// identical pages while the host's `ksmd` runs (`crabctl fork --merge-memory` sets it). It
/// belongs to the container: it does not travel with its checkpoints.
pub const MERGE_MEMORY: &str = "io.crab/merge-memory";

/// The container's [`MERGE_MEMORY`] request: `true` or `false` (or absent: `false`); any other
/// value is an error.
pub fn merge_memory(spec: &oci_spec::runtime::Spec) -> Result<bool> {
    match crate::bundle::annotation(spec, &[MERGE_MEMORY]) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(v) => Err(Error::InvalidArgument(format!(
            "annotation {MERGE_MEMORY}: {:?} is neither true nor false",
            truncated(v)
        ))),
    }
}

/// The CRI's annotations of a container's spec naming its pod and itself.
const CRI_SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
const CRI_SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
const CRI_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";

/// The crab annotations that travel with a container's checkpoint images ([`inherit`]).
pub const SPEC_ANNOTATIONS: [&str; 4] = [
    TURN_BOUNDARY,
    crate::checkpoint::policy::POLICY_ANNOTATION,
    crate::checkpoint::policy::SELF_CONTAINED_ANNOTATION,
    PROBE_COMMANDS,
];

/// Every crab annotation a container's spec may carry; any other `io.crab/` key is a typo that
/// must not silently change nothing. The lineage, the resume request and memory merging belong
/// to the container, never to an image: they do not travel.
pub const KNOWN_SPEC_ANNOTATIONS: [&str; 7] = [
    TURN_BOUNDARY,
    crate::checkpoint::policy::POLICY_ANNOTATION,
    crate::checkpoint::policy::SELF_CONTAINED_ANNOTATION,
    PROBE_COMMANDS,
    LINEAGE,
    RESUME,
    MERGE_MEMORY,
];

/// What a container asks of its lineage at Create ([`RESUME`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Start as the image says (no annotation).
    Fresh,
    /// Start from the newest durable checkpoint of the lineage, if there is one.
    Newest,
}

/// The container's [`RESUME`] request; any value but `newest` is an error.
pub fn resume(spec: &oci_spec::runtime::Spec) -> Result<Resume> {
    match crate::bundle::annotation(spec, &[RESUME]) {
        None => Ok(Resume::Fresh),
        Some("newest") => Ok(Resume::Newest),
        Some(v) => Err(Error::InvalidArgument(format!(
            "annotation {RESUME}: {:?} is not a resume request (the one there is: newest)",
            truncated(v)
        ))),
    }
}

fn truncated(v: &str) -> String {
    v.chars().take(64).collect()
}

/// Checks a lineage name (or one of the CRI's names it is made of): 1 to [`MAX_LINEAGE`]
/// bytes of letters, digits and `._-:/@`, no empty, `.` or `..` part between slashes.
fn check_lineage_name(what: &str, v: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "{what} {:?}: {why}",
            truncated(v)
        )))
    };
    if v.is_empty() || v.len() > MAX_LINEAGE {
        return bad(&format!("a lineage name has 1 to {MAX_LINEAGE} bytes"));
    }
    if let Some(c) = v
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "._-:/@".contains(*c)))
    {
        return bad(&format!(
            "{c:?} may not be in a lineage name (letters, digits and ._-:/@)"
        ));
    }
    if v.split('/').any(|part| matches!(part, "" | "." | "..")) {
        return bad("a lineage name has no empty, `.` or `..` part");
    }
    Ok(())
}

/// The lineage of container `id` of containerd namespace `namespace`: the name a later
/// container resumes it by ([`RESUME`]). It is
/// - [`LINEAGE`] if the spec sets it; for a CRI container, put after its pod's Kubernetes
///   namespace (`<namespace>/<value>`): a pod can never name another namespace's lineage;
/// - else, for a CRI container, `<kubernetes namespace>/<pod name>/<container name>`, the
///   same for every attempt of the container in its pod and for a StatefulSet's pod
///   rescheduled under its name;
/// - else `<containerd namespace>/<container id>` (Docker's restarts keep the id).
pub fn lineage(spec: &oci_spec::runtime::Spec, namespace: &str, id: &str) -> Result<String> {
    let get = |k: &str| crate::bundle::annotation(spec, &[k]);
    let pod_namespace = get(CRI_SANDBOX_NAMESPACE);
    if let Some(ns) = pod_namespace {
        check_lineage_name(CRI_SANDBOX_NAMESPACE, ns)?;
    }
    if let Some(v) = get(LINEAGE) {
        check_lineage_name(LINEAGE, v)?;
        return Ok(match pod_namespace {
            Some(ns) => format!("{ns}/{v}"),
            None => v.to_string(),
        });
    }
    if let (Some(ns), Some(pod), Some(name)) = (
        pod_namespace,
        get(CRI_SANDBOX_NAME),
        get(CRI_CONTAINER_NAME),
    ) {
        check_lineage_name(CRI_SANDBOX_NAME, pod)?;
        check_lineage_name(CRI_CONTAINER_NAME, name)?;
        return Ok(format!("{ns}/{pod}/{name}"));
    }
    Ok(format!("{namespace}/{id}"))
}

/// Gives `spec` the crab annotations of `image` (a checkpoint image's, from its source
/// container) that it does not set itself; returns their names. Only
/// [`SPEC_ANNOTATIONS`] are taken, and their values are checked where they are read, as the
/// spec's own are.
pub fn inherit(
    spec: &mut oci_spec::runtime::Spec,
    image: &std::collections::BTreeMap<String, String>,
) -> Vec<&'static str> {
    let mut annotations = spec.annotations().clone().unwrap_or_default();
    let mut taken = Vec::new();
    for key in SPEC_ANNOTATIONS {
        if annotations.contains_key(key) {
            continue;
        }
        if let Some(v) = image.get(key) {
            annotations.insert(key.to_string(), v.clone());
            taken.push(key);
        }
    }
    if !taken.is_empty() {
        spec.set_annotations(Some(annotations));
    }
    taken
}

/// The crab annotations of `annotations` (a container's spec) that travel with its checkpoint
/// images ([`inherit`]).
pub fn travelling(
    annotations: &HashMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    SPEC_ANNOTATIONS
        .iter()
        .filter_map(|k| annotations.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect()
}

/// Refuses a spec with an `io.crab/` annotation crab does not know.
pub fn check_spec_annotations(spec: &oci_spec::runtime::Spec) -> Result<()> {
    let unknown = spec
        .annotations()
        .iter()
        .flatten()
        .map(|(k, _)| k)
        .find(|k| {
            k.starts_with(ANNOTATION_PREFIX) && !KNOWN_SPEC_ANNOTATIONS.contains(&k.as_str())
        });
    match unknown {
        Some(key) => Err(Error::InvalidArgument(format!(
            "unknown crab annotation `{key}` in the container's spec (known: {})",
            KNOWN_SPEC_ANNOTATIONS.join(", ")
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
        if key != TURN_END && key != ROLLBACK {
            return Err(Error::InvalidArgument(format!(
                "unknown crab annotation `{key}` (known: {TURN_END}, {ROLLBACK})"
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

/// The checkpoint an `Update` asks to roll back to in place ([`ROLLBACK`]), if any. It comes
/// alone: with a turn end or resources it is refused, as is a value that is not a sequence
/// number.
pub fn requested_rollback(
    annotations: &HashMap<String, String>,
    with_resources: bool,
) -> Result<Option<u64>> {
    let Some(v) = annotations.get(ROLLBACK) else {
        return Ok(None);
    };
    if annotations.contains_key(TURN_END) || with_resources {
        return Err(Error::InvalidArgument(format!(
            "annotation {ROLLBACK} comes alone: not with {TURN_END} or new resources"
        )));
    }
    match v.parse::<u64>() {
        Ok(seq) if seq > 0 && v.bytes().all(|b| b.is_ascii_digit()) => Ok(Some(seq)),
        _ => Err(Error::InvalidArgument(format!(
            "annotation {ROLLBACK} must be a checkpoint's sequence number, got {v:?}"
        ))),
    }
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

/// The argv prefixes the spec annotation [`PROBE_COMMANDS`] names (none without it). The
/// annotation comes from whoever wrote the pod spec: a malformed, empty or oversized value fails
/// the container's create with the reason, so that a typo never turns probes into agent actions
/// (or agent actions into probes) silently.
pub fn probe_commands(spec: &oci_spec::runtime::Spec) -> Result<Vec<Vec<String>>> {
    let Some(value) = crate::bundle::annotation(spec, &[PROBE_COMMANDS]) else {
        return Ok(Vec::new());
    };
    let bad = |why: String| {
        Error::InvalidArgument(format!(
            "spec annotation {PROBE_COMMANDS} must be a JSON array of at most {MAX_PROBES} \
             non-empty argv prefixes (arrays of strings), e.g. [[\"cat\", \"/tmp/healthy\"]], \
             in at most {MAX_PROBE_BYTES} bytes: {why}"
        ))
    };
    if value.len() > MAX_PROBE_BYTES {
        return Err(bad(format!("it has {} bytes", value.len())));
    }
    let probes: Vec<Vec<String>> = serde_json::from_str(value).map_err(|e| bad(format!("{e}")))?;
    if probes.len() > MAX_PROBES {
        return Err(bad(format!("it names {} commands", probes.len())));
    }
    if let Some(i) = probes.iter().position(|p| p.is_empty() || p[0].is_empty()) {
        return Err(bad(format!("command {i} is empty")));
    }
    Ok(probes)
}

/// Whether an exec running `args` is one of the `probes` (its argv begins with one of them).
pub fn is_probe(probes: &[Vec<String>], args: &[String]) -> bool {
    probes.iter().any(|p| args.starts_with(p))
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
    fn rollback_annotations_name_a_checkpoint_and_come_alone() {
        assert_eq!(requested_rollback(&ann(&[]), false).unwrap(), None);
        assert_eq!(
            requested_rollback(&ann(&[(ROLLBACK, "12")]), false).unwrap(),
            Some(12)
        );
        // Known to the turn-end parser (not an unknown crab annotation).
        assert_eq!(requested_turn_end(&ann(&[(ROLLBACK, "12")])).unwrap(), None);
        for bad in ["", "0", "-1", "+3", "t3", "1 ", "99999999999999999999999"] {
            let e = requested_rollback(&ann(&[(ROLLBACK, bad)]), false).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e:?}");
        }
        let both = ann(&[(ROLLBACK, "3"), (TURN_END, "t4")]);
        assert!(requested_rollback(&both, false).is_err());
        assert!(requested_rollback(&ann(&[(ROLLBACK, "3")]), true).is_err());
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

    /// A checkpoint image's crab annotations fill what the new spec leaves out, never what it
    /// sets, and nothing but crab's spec annotations travels.
    #[test]
    fn a_checkpoint_image_lends_its_annotations_to_a_spec_without_them() {
        let image: std::collections::BTreeMap<String, String> = [
            (super::TURN_BOUNDARY, "exec"),
            (super::PROBE_COMMANDS, r#"[["cat", "/ok"]]"#),
            ("io.crab/turn-end", "t9"),
            ("org.example/other", "x"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let mut spec = spec_with(r#"[["true"]]"#);
        let taken = super::inherit(&mut spec, &image);
        assert_eq!(taken, [super::TURN_BOUNDARY]);
        let a = spec.annotations().clone().unwrap();
        assert_eq!(a[super::TURN_BOUNDARY], "exec");
        assert_eq!(
            a[super::PROBE_COMMANDS],
            r#"[["true"]]"#,
            "the spec's own stays"
        );
        assert!(!a.contains_key("io.crab/turn-end") && !a.contains_key("org.example/other"));
        assert!(
            super::exec_boundary(&spec, crab_runtime_config::TurnBoundary::Annotation).unwrap()
        );
        // What an export records of a container's annotations.
        let own: std::collections::HashMap<String, String> = [
            (super::TURN_BOUNDARY.to_string(), "exec".to_string()),
            ("io.kubernetes.cri.sandbox-id".to_string(), "x".to_string()),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            super::travelling(&own).into_iter().collect::<Vec<_>>(),
            [(super::TURN_BOUNDARY.to_string(), "exec".to_string())]
        );
        // Nothing to lend: the spec is left as it was.
        let mut plain = spec_with(r#"[["true"]]"#);
        assert!(super::inherit(&mut plain, &Default::default()).is_empty());
    }

    fn spec_with(value: &str) -> oci_spec::runtime::Spec {
        serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "annotations": {super::PROBE_COMMANDS: value}
        }))
        .unwrap()
    }

    #[test]
    fn probe_commands_are_argv_prefixes() {
        let probes =
            super::probe_commands(&spec_with(r#"[["cat", "/tmp/healthy"], ["/bin/check"]]"#))
                .unwrap();
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(super::is_probe(&probes, &args(&["cat", "/tmp/healthy"])));
        assert!(super::is_probe(&probes, &args(&["/bin/check", "--deep"])));
        // Not a prefix of the argv: an agent action.
        assert!(!super::is_probe(
            &probes,
            &args(&["cat", "/tmp/healthy.bak"])
        ));
        assert!(!super::is_probe(&probes, &args(&["cat"])));
        assert!(!super::is_probe(
            &probes,
            &args(&["sh", "-c", "cat /tmp/healthy"])
        ));
        assert!(!super::is_probe(&probes, &[]));
        let none: oci_spec::runtime::Spec =
            serde_json::from_value(serde_json::json!({"ociVersion": "1.0.2"})).unwrap();
        assert!(super::probe_commands(&none).unwrap().is_empty());
        // The annotation is known: a spec carrying it is not refused as a typo.
        super::check_spec_annotations(&spec_with("[]")).unwrap();
    }

    #[test]
    fn hostile_probe_commands_are_refused_with_the_reason() {
        let big = format!("[[\"{}\"]]", "x".repeat(5000));
        let many = format!("[{}]", vec!["[\"a\"]"; 17].join(","));
        for (value, why) in [
            ("cat /tmp/healthy", "expected value"),
            ("[[]]", "command 0 is empty"),
            (r#"[[""]]"#, "command 0 is empty"),
            (r#"[["a"], 3]"#, "invalid type"),
            (r#"{"a": ["b"]}"#, "invalid type"),
            (r#"[["a", null]]"#, "invalid type"),
            (big.as_str(), "bytes"),
            (many.as_str(), "names 17 commands"),
        ] {
            let e = super::probe_commands(&spec_with(value))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(why) && e.contains(super::PROBE_COMMANDS),
                "{value}: {e}"
            );
        }
    }

    fn annotated(annotations: &[(&str, &str)]) -> oci_spec::runtime::Spec {
        let map: serde_json::Map<String, serde_json::Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        serde_json::from_value(serde_json::json!({"ociVersion": "1.0.2", "annotations": map}))
            .unwrap()
    }

    #[test]
    fn a_containers_lineage_is_its_annotation_its_pod_and_name_or_its_id() {
        use super::*;
        let cri = [
            (CRI_SANDBOX_NAMESPACE, "team-a"),
            (CRI_SANDBOX_NAME, "agent-0"),
            (CRI_CONTAINER_NAME, "sandbox"),
        ];
        assert_eq!(
            lineage(&annotated(&cri), "k8s.io", "abc123").unwrap(),
            "team-a/agent-0/sandbox"
        );
        // A pod's own lineage name stays inside its Kubernetes namespace.
        let mut named = cri.to_vec();
        named.push((LINEAGE, "team-b/agent-0/sandbox"));
        assert_eq!(
            lineage(&annotated(&named), "k8s.io", "abc123").unwrap(),
            "team-a/team-b/agent-0/sandbox"
        );
        assert_eq!(
            lineage(&annotated(&[(LINEAGE, "run-7")]), "default", "c1").unwrap(),
            "run-7"
        );
        assert_eq!(lineage(&annotated(&[]), "moby", "c1").unwrap(), "moby/c1");
        // Only part of the CRI's names: not a CRI container's lineage.
        assert_eq!(
            lineage(&annotated(&cri[..2]), "k8s.io", "c1").unwrap(),
            "k8s.io/c1"
        );
    }

    #[test]
    fn hostile_lineage_names_and_resume_requests_are_refused() {
        use super::*;
        let long = "a".repeat(MAX_LINEAGE + 1);
        for bad in [
            "",
            "../other",
            "a//b",
            "a/./b",
            "/abs",
            "trailing/",
            "sp ace",
            "new\nline",
            "nul\0",
            "caf\u{e9}",
            long.as_str(),
        ] {
            let e = lineage(&annotated(&[(LINEAGE, bad)]), "default", "c1");
            assert!(e.is_err(), "{bad:?} accepted");
        }
        // A hostile CRI name is refused too (the kubelet validates them; a CRI client may not).
        let e = lineage(
            &annotated(&[
                (CRI_SANDBOX_NAMESPACE, "../x"),
                (CRI_SANDBOX_NAME, "p"),
                (CRI_CONTAINER_NAME, "c"),
            ]),
            "k8s.io",
            "c1",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(CRI_SANDBOX_NAMESPACE), "{e}");
        lineage(&annotated(&[(LINEAGE, &"a".repeat(MAX_LINEAGE))]), "d", "c").unwrap();
        assert_eq!(resume(&annotated(&[])).unwrap(), Resume::Fresh);
        assert_eq!(
            resume(&annotated(&[(RESUME, "newest")])).unwrap(),
            Resume::Newest
        );
        for bad in ["", "Newest", "latest", "newest "] {
            let e = resume(&annotated(&[(RESUME, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(RESUME) && e.contains("newest"), "{e}");
        }
        check_spec_annotations(&annotated(&[(LINEAGE, "x"), (RESUME, "newest")])).unwrap();
    }

    #[test]
    fn merge_memory_is_true_false_or_an_error_and_does_not_travel() {
        use super::*;
        assert!(!merge_memory(&annotated(&[])).unwrap());
        assert!(!merge_memory(&annotated(&[(MERGE_MEMORY, "false")])).unwrap());
        assert!(merge_memory(&annotated(&[(MERGE_MEMORY, "true")])).unwrap());
        let long = "t".repeat(100_000);
        for bad in ["", "TRUE", "yes", "1", "true ", "nul\0", long.as_str()] {
            let e = merge_memory(&annotated(&[(MERGE_MEMORY, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(MERGE_MEMORY) && e.len() < 400, "{e}");
        }
        check_spec_annotations(&annotated(&[(MERGE_MEMORY, "true")])).unwrap();
        let travels = travelling(&[(MERGE_MEMORY.to_string(), "true".to_string())].into());
        assert!(travels.is_empty(), "{travels:?}");
    }
}
