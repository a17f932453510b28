//! Which shim a container joins: its pod's (the CRI's containers), an explicit group's (only
//! groups the config lists), else its own. Annotations are chosen by whoever creates the
//! container, so neither can name another workload's shim.

use crate::bundle;

/// The spec annotation the CRI sets on every container of a pod: a pod's containers share one
/// shim. Honoured only for containers the CRI made ([`CRI_TYPE_ANNOTATION`] present, in
/// [`CRI_NAMESPACE`]); it then wins over [`GROUP_ANNOTATION`].
const SANDBOX_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";
/// What the CRI marks each of its containers with (`sandbox` or `container`).
const CRI_TYPE_ANNOTATION: &str = "io.kubernetes.cri.container-type";
/// The namespace containerd's CRI plugin works in. Any client may set annotations (`docker run
/// --annotation`, `ctr run --annotation`): elsewhere a sandbox id would let a workload join a
/// pod's shim, and with it that pod's processes' reaper and I/O.
const CRI_NAMESPACE: &str = "k8s.io";
/// A spec annotation that puts containers created outside the CRI in one shim. Its value lives
/// in a name space of its own (`crab-group-<value>`), so it can never name another container's
/// or pod's shim, whose grouping ids are container and sandbox ids.
const GROUP_ANNOTATION: &str = "io.containerd.crab.v1.group";

/// Why a container's group annotation is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    #[error("spec annotation {a} must be 1 to 64 of [A-Za-z0-9._-], got {0:?}", a = GROUP_ANNOTATION)]
    BadName(String),
    #[error(
        "spec annotation {a} names the shim group {0:?}, which the config does not allow \
         (containers of one group share a shim; list it in [shim] groups)",
        a = GROUP_ANNOTATION
    )]
    NotAllowed(String),
}

/// The id of the shim a container joins: its pod's, its explicit group's, else its own.
pub fn grouping(
    spec: Option<&oci_spec::runtime::Spec>,
    id: &str,
    namespace: &str,
) -> Result<String, GroupError> {
    let Some(spec) = spec else {
        return Ok(id.to_string());
    };
    if let Some(sandbox) = bundle::annotation(spec, &[SANDBOX_ANNOTATION]) {
        let cri_made = namespace == CRI_NAMESPACE
            && matches!(
                bundle::annotation(spec, &[CRI_TYPE_ANNOTATION]),
                Some("sandbox" | "container")
            );
        if cri_made {
            return Ok(sandbox.to_string());
        }
        log::warn!(
            "container {id}: {SANDBOX_ANNOTATION} ignored: only containers the CRI makes \
             ({CRI_TYPE_ANNOTATION}, namespace {CRI_NAMESPACE}) join a pod's shim"
        );
    }
    match bundle::annotation(spec, &[GROUP_ANNOTATION]) {
        None => Ok(id.to_string()),
        Some(g) if crab_runtime_config::is_group_name(g) => Ok(format!("crab-group-{g}")),
        Some(g) => Err(GroupError::BadName(g.to_string())),
    }
}

/// The explicit group a container joins a shim by ([`GROUP_ANNOTATION`]; not for the CRI's
/// containers, which join their pod's): Create refuses one the config does not list.
pub fn check_group(
    spec: &oci_spec::runtime::Spec,
    namespace: &str,
    allowed: &[String],
) -> Result<(), GroupError> {
    let cri_made = namespace == CRI_NAMESPACE
        && bundle::annotation(spec, &[SANDBOX_ANNOTATION]).is_some()
        && matches!(
            bundle::annotation(spec, &[CRI_TYPE_ANNOTATION]),
            Some("sandbox" | "container")
        );
    match bundle::annotation(spec, &[GROUP_ANNOTATION]) {
        Some(g) if !cri_made && !allowed.iter().any(|a| a == g) => {
            Err(GroupError::NotAllowed(g.to_string()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(annotations: &[(&str, &str)]) -> oci_spec::runtime::Spec {
        let map: std::collections::HashMap<&str, &str> = annotations.iter().copied().collect();
        serde_json::from_value(serde_json::json!({"ociVersion": "1.0.2", "annotations": map}))
            .unwrap()
    }

    #[test]
    fn a_group_can_never_name_another_workloads_shim() {
        const NS: &str = "k8s.io";
        assert_eq!(grouping(None, "c1", NS).unwrap(), "c1");
        assert_eq!(grouping(Some(&spec(&[])), "c1", NS).unwrap(), "c1");
        // A pod's containers share the pod's shim, whatever else they say.
        let pod = spec(&[
            (SANDBOX_ANNOTATION, "abc123"),
            (CRI_TYPE_ANNOTATION, "container"),
            (GROUP_ANNOTATION, "other"),
        ]);
        assert_eq!(grouping(Some(&pod), "c1", NS).unwrap(), "abc123");
        // A sandbox id from anyone but the CRI (no container type, or another namespace:
        // `docker run --annotation`) joins no pod's shim.
        let forged = spec(&[(SANDBOX_ANNOTATION, "abc123")]);
        assert_eq!(grouping(Some(&forged), "c1", NS).unwrap(), "c1");
        assert_eq!(
            grouping(Some(&pod), "c1", "moby").unwrap(),
            "crab-group-other"
        );
        let forged = spec(&[(SANDBOX_ANNOTATION, "abc123"), (CRI_TYPE_ANNOTATION, "x")]);
        assert_eq!(grouping(Some(&forged), "c1", NS).unwrap(), "c1");
        // An explicit group is a name of its own: naming another container's id (or a pod's)
        // does not reach that container's shim.
        assert_eq!(
            grouping(Some(&spec(&[(GROUP_ANNOTATION, "victim")])), "c1", NS).unwrap(),
            "crab-group-victim"
        );
        for bad in ["", "../x", "a b", &"x".repeat(65)] {
            let e = grouping(Some(&spec(&[(GROUP_ANNOTATION, bad)])), "c1", NS).unwrap_err();
            assert_eq!(e, GroupError::BadName(bad.to_string()));
            assert!(e.to_string().contains(GROUP_ANNOTATION), "{e}");
        }
    }

    #[test]
    fn only_the_groups_the_config_lists_may_be_joined() {
        const NS: &str = "k8s.io";
        let allowed = vec!["agents".to_string()];
        check_group(&spec(&[]), NS, &[]).unwrap();
        check_group(&spec(&[(GROUP_ANNOTATION, "agents")]), NS, &allowed).unwrap();
        for (s, allowed) in [
            (spec(&[(GROUP_ANNOTATION, "agents")]), &[][..]),
            (spec(&[(GROUP_ANNOTATION, "victims")]), &allowed[..]),
            // A forged sandbox id does not make a container the CRI's.
            (
                spec(&[(GROUP_ANNOTATION, "x"), (SANDBOX_ANNOTATION, "abc")]),
                &allowed[..],
            ),
        ] {
            let e = check_group(&s, NS, allowed).unwrap_err();
            assert!(matches!(e, GroupError::NotAllowed(_)), "{e}");
            let e = e.to_string();
            assert!(
                e.contains("does not allow") && e.contains("[shim] groups"),
                "{e}"
            );
        }
        // The CRI's containers join their pod's shim; their group annotation is not used.
        let pod = spec(&[
            (SANDBOX_ANNOTATION, "abc123"),
            (CRI_TYPE_ANNOTATION, "container"),
            (GROUP_ANNOTATION, "other"),
        ]);
        check_group(&pod, NS, &[]).unwrap();
        assert!(check_group(&pod, "moby", &[]).is_err());
    }
}
