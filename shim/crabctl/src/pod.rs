//! Addressing a Kubernetes pod's container by name (`--pod P [--pod-namespace NS] --container C`).
//!
//! Under the CRI, containerd names containers by long random ids. What names them for people is
//! on the container record: the CRI plugin writes the pod's and the container's names from the
//! CRI metadata into the spec annotations (`io.kubernetes.cri.sandbox-name`, `...-namespace`,
//! `io.kubernetes.cri.container-name`, `io.kubernetes.cri.container-type`), and the kubelet adds
//! labels (`io.kubernetes.pod.name`, `io.kubernetes.pod.namespace`,
//! `io.kubernetes.container.name`). The annotations are there whatever the CRI client (kubelet,
//! crictl, a test harness); the labels only where the client set them. So a record is read
//! through both, annotations first. [`resolve`] picks one app container from plain [`Member`]s
//! (no I/O, unit-tested); [`Ctl::resolve_pod_container`] feeds it from containerd.

use std::{
    collections::{BTreeSet, HashMap},
    time::SystemTime,
};

use containerd_client::services::v1::Container;

use super::{Ctl, Result};
use crab_shim::checkpoint::store::rfc3339;

/// The pod's (sandbox's) name and namespace, the container's name and kind, as the CRI plugin
/// writes them into the spec annotations.
const ANN_POD_NAME: &str = "io.kubernetes.cri.sandbox-name";
const ANN_POD_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
const ANN_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
const ANN_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
const ANN_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The kubelet's labels, and the CRI plugin's own label for the kind.
const LABEL_POD_NAME: &str = "io.kubernetes.pod.name";
const LABEL_POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
const LABEL_CONTAINER_NAME: &str = "io.kubernetes.container.name";
const LABEL_KIND: &str = "io.cri-containerd.kind";
/// The name kubelets give the infrastructure container (`k8s_POD_...` under dockershim).
const INFRA_NAME: &str = "POD";
/// The Kubernetes namespace `--pod-namespace` defaults to.
pub const DEFAULT_POD_NAMESPACE: &str = "default";
/// How many pods a "no such pod" error lists.
const MAX_LISTED: usize = 20;

/// What `--pod`, `--pod-namespace` and `--container` name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodContainer {
    pub pod: String,
    pub pod_namespace: String,
    pub container: String,
}

impl std::fmt::Display for PodContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "container {} of pod {}/{}",
            self.container, self.pod_namespace, self.pod
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The pod's infrastructure (pause) container: crab neither inspects nor checkpoints it.
    Sandbox,
    /// One of the pod's app containers.
    App,
}

/// A container record as a member of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    pub pod: String,
    pub pod_namespace: String,
    /// The container's name in the pod (none for the sandbox).
    pub name: Option<String>,
    pub kind: Kind,
    /// The id of the pod's sandbox container (a sandbox's own id), telling apart a pod and an
    /// older one of the same name whose records are still there.
    pub sandbox_id: String,
    pub created_at: Option<SystemTime>,
    /// Whether its task is alive (running or paused).
    pub live: bool,
}

impl Member {
    /// `record` as a pod member, or `None` if it is not a CRI container.
    pub fn of(record: &Container, live: bool) -> Option<Member> {
        let annotations = spec_annotations(record);
        let get = |annotation: &str, label: &str| {
            annotations
                .get(annotation)
                .or_else(|| record.labels.get(label))
                .filter(|v| !v.is_empty())
                .cloned()
        };
        let pod = get(ANN_POD_NAME, LABEL_POD_NAME)?;
        let name = get(ANN_CONTAINER_NAME, LABEL_CONTAINER_NAME);
        let kind = match get(ANN_CONTAINER_TYPE, LABEL_KIND).as_deref() {
            Some("sandbox") => Kind::Sandbox,
            Some(_) => Kind::App,
            None if name.is_some() => Kind::App,
            None => Kind::Sandbox,
        };
        let sandbox_id = match kind {
            Kind::Sandbox => record.id.clone(),
            Kind::App => annotations.get(ANN_SANDBOX_ID).cloned().unwrap_or_default(),
        };
        Some(Member {
            id: record.id.clone(),
            pod,
            pod_namespace: get(ANN_POD_NAMESPACE, LABEL_POD_NAMESPACE).unwrap_or_default(),
            name: name.filter(|_| kind == Kind::App),
            kind,
            sandbox_id,
            created_at: record.created_at.as_ref().and_then(|t| {
                let since =
                    std::time::Duration::new(t.seconds.try_into().ok()?, t.nanos.try_into().ok()?);
                SystemTime::UNIX_EPOCH.checked_add(since)
            }),
            live,
        })
    }

    fn describe(&self) -> String {
        let created = self.created_at.map(rfc3339).unwrap_or_else(|| "?".into());
        let state = if self.live { "running" } else { "not running" };
        format!("{} ({state}, created {created})", self.id)
    }
}

/// The annotations of a record's OCI spec (JSON in the `Any`); none if it has no readable spec.
fn spec_annotations(record: &Container) -> HashMap<String, String> {
    #[derive(serde::Deserialize)]
    struct Spec {
        #[serde(default)]
        annotations: HashMap<String, String>,
    }
    record
        .spec
        .as_ref()
        .and_then(|any| serde_json::from_slice::<Spec>(&any.value).ok())
        .map(|s| s.annotations)
        .unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error("no pod {pod_namespace}/{pod} in containerd namespace {namespace}; {}", pods_there(.namespace, .pods))]
    NoPod {
        namespace: String,
        pod: String,
        pod_namespace: String,
        /// `namespace/name` of the pods there are.
        pods: Vec<String>,
    },
    #[error("pod {pod_namespace}/{pod} has no container {container}; its containers: {}", or_none(.containers))]
    NoContainer {
        pod: String,
        pod_namespace: String,
        container: String,
        containers: Vec<String>,
    },
    #[error("{container} is pod {pod_namespace}/{pod}'s sandbox (pause) container, which crab neither inspects nor checkpoints; its containers: {}", or_none(.containers))]
    Sandbox {
        pod: String,
        pod_namespace: String,
        container: String,
        containers: Vec<String>,
    },
    #[error("{container} belongs to pod {pod_namespace}/{pod}, run by Kubernetes through the CRI: a {op} behind the CRI's back is undone by it (it deletes the task it did not start); export the checkpoint instead (crabctl export CONTAINER --turn T REF) and run a pod from image REF with the crab runtime class: crab restores it on create")]
    CriManaged {
        container: String,
        pod: String,
        pod_namespace: String,
        op: String,
    },
    #[error("no task of container {container} of pod {pod_namespace}/{pod} is running; name one of its {} records by id (newest first): {}", .records.len(), .records.join(", "))]
    NoneRunning {
        pod: String,
        pod_namespace: String,
        container: String,
        records: Vec<String>,
    },
}

fn pods_there(namespace: &str, pods: &[String]) -> String {
    if pods.is_empty() {
        return "it has no CRI pods at all (the CRI plugin's namespace is k8s.io unless configured \
                otherwise: --namespace k8s.io)"
            .into();
    }
    let more = pods.len().saturating_sub(MAX_LISTED);
    let mut list = pods
        .iter()
        .take(MAX_LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if more > 0 {
        list.push_str(&format!(" and {more} more"));
    }
    format!("pods in {namespace}: {list}")
}

fn or_none(names: &[String]) -> String {
    match names.is_empty() {
        true => "none but the sandbox".into(),
        false => names.join(", "),
    }
}

/// The container [`resolve`] chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub id: String,
    /// Said to the user when the choice was not the only possible one.
    pub note: Option<String>,
}

/// The one app container `target` names among `members` (the pod members of containerd
/// namespace `namespace`). A name can have several records: the kubelet keeps a restarted
/// container's exited attempts, and a pod deleted and created again under the same name may
/// leave the old pod's records for a while. Then the newest one with a live task is taken; if
/// none is live, the user has to name one by id. A single record is taken live or not (its
/// store and turns can still be read).
pub fn resolve(
    target: &PodContainer,
    members: &[Member],
    namespace: &str,
) -> Result<Resolved, PodError> {
    let in_pod: Vec<&Member> = members
        .iter()
        .filter(|m| m.pod == target.pod && m.pod_namespace == target.pod_namespace)
        .collect();
    if in_pod.is_empty() {
        let pods: BTreeSet<String> = members
            .iter()
            .map(|m| format!("{}/{}", m.pod_namespace, m.pod))
            .collect();
        return Err(PodError::NoPod {
            namespace: namespace.to_string(),
            pod: target.pod.clone(),
            pod_namespace: target.pod_namespace.clone(),
            pods: pods.into_iter().collect(),
        });
    }
    let mut named: Vec<&Member> = in_pod
        .iter()
        .copied()
        .filter(|m| m.kind == Kind::App && m.name.as_deref() == Some(target.container.as_str()))
        .collect();
    if named.is_empty() {
        let containers: BTreeSet<String> = in_pod.iter().filter_map(|m| m.name.clone()).collect();
        let containers = containers.into_iter().collect();
        let (pod, pod_namespace, container) = (
            target.pod.clone(),
            target.pod_namespace.clone(),
            target.container.clone(),
        );
        let is_sandbox = target.container == INFRA_NAME
            || in_pod
                .iter()
                .any(|m| m.kind == Kind::Sandbox && m.id == target.container);
        return Err(match is_sandbox {
            true => PodError::Sandbox {
                pod,
                pod_namespace,
                container,
                containers,
            },
            false => PodError::NoContainer {
                pod,
                pod_namespace,
                container,
                containers,
            },
        });
    }
    if let [only] = named.as_slice() {
        return Ok(Resolved {
            id: only.id.clone(),
            note: None,
        });
    }
    // Newest first; ties (no creation time) by id, so the choice is stable.
    named.sort_by(|a, b| {
        b.created_at
            .cmp(&a.created_at)
            .then_with(|| a.id.cmp(&b.id))
    });
    let live: Vec<&Member> = named.iter().copied().filter(|m| m.live).collect();
    let Some(chosen) = live.first() else {
        return Err(PodError::NoneRunning {
            pod: target.pod.clone(),
            pod_namespace: target.pod_namespace.clone(),
            container: target.container.clone(),
            records: named.iter().map(|m| m.describe()).collect(),
        });
    };
    let note = (live.len() > 1).then(|| {
        format!(
            "{target} has {} running records: using the newest, {}; the others: {}",
            live.len(),
            chosen.describe(),
            live[1..]
                .iter()
                .map(|m| m.describe())
                .collect::<Vec<_>>()
                .join(", ")
        )
    });
    Ok(Resolved {
        id: chosen.id.clone(),
        note,
    })
}

/// Refuses operations that replace a Kubernetes container's task behind the CRI: the CRI
/// plugin handles the old task's exit by deleting the container's task, which by then is the
/// new one (seen: a rolled-back task killed 2 s after it started), and a fork's record would
/// carry the pod's CRI metadata without the CRI knowing it. A checkpoint image run as a pod
/// with the crab runtime class restores through the CRI instead.
pub fn refuse_cri(record: &Container, op: &str) -> Result<(), PodError> {
    match Member::of(record, false) {
        Some(m) => Err(PodError::CriManaged {
            container: record.id.clone(),
            pod: m.pod,
            pod_namespace: m.pod_namespace,
            op: op.to_string(),
        }),
        None => Ok(()),
    }
}

/// A containerd filter matching records whose label `key` is `value` exactly.
fn label_filter(key: &str, value: &str) -> String {
    let quoted = value.replace('\\', "\\\\").replace('"', "\\\"");
    format!("labels.\"{key}\"==\"{quoted}\"")
}

impl Ctl {
    /// The id of the app container `target` names in this containerd namespace (see
    /// [`resolve`]). The kubelet's pod-name label narrows the listing; pods made by CRI
    /// clients that set no labels are found by their spec annotations in the full listing
    /// (which a "no such pod" error lists anyway).
    pub async fn resolve_pod_container(&self, target: &PodContainer) -> Result<Resolved> {
        let live = self.client.live_tasks().await?;
        let members = |records: Vec<Container>| -> Vec<Member> {
            records
                .iter()
                .filter_map(|c| Member::of(c, live.contains(&c.id)))
                .collect()
        };
        let labelled = members(
            self.client
                .containers_matching(vec![label_filter(LABEL_POD_NAME, &target.pod)])
                .await?,
        );
        if let Ok(r) = resolve(target, &labelled, self.namespace()) {
            return Ok(r);
        }
        let all = members(self.client.containers_matching(Vec::new()).await?);
        Ok(resolve(target, &all, self.namespace())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_client::services::v1::Container;
    use prost_types::{Any, Timestamp};
    use serde_json::json;

    const NS: &str = "k8s.io";

    /// A record as the CRI plugin makes it: names in the spec annotations; `kubelet` adds the
    /// kubelet's labels too.
    fn cri_record(
        id: &str,
        pod: (&str, &str),
        container: Option<&str>,
        sandbox: &str,
        created: i64,
        kubelet: bool,
    ) -> Container {
        let (pod_namespace, pod_name) = pod;
        let mut annotations = json!({
            ANN_POD_NAME: pod_name,
            ANN_POD_NAMESPACE: pod_namespace,
            ANN_SANDBOX_ID: sandbox,
            ANN_CONTAINER_TYPE: if container.is_some() { "container" } else { "sandbox" },
        });
        let mut labels = HashMap::from([(
            LABEL_KIND.to_string(),
            if container.is_some() {
                "container"
            } else {
                "sandbox"
            }
            .to_string(),
        )]);
        if let Some(c) = container {
            annotations[ANN_CONTAINER_NAME] = json!(c);
        }
        if kubelet {
            labels.insert(LABEL_POD_NAME.into(), pod_name.into());
            labels.insert(LABEL_POD_NAMESPACE.into(), pod_namespace.into());
            if let Some(c) = container {
                labels.insert(LABEL_CONTAINER_NAME.into(), c.into());
            }
        }
        let spec = json!({"ociVersion": "1.2.0", "annotations": annotations});
        Container {
            id: id.into(),
            labels,
            spec: Some(Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Spec".into(),
                value: serde_json::to_vec(&spec).unwrap(),
            }),
            created_at: Some(Timestamp {
                seconds: 1_700_000_000 + created,
                nanos: 0,
            }),
            ..Default::default()
        }
    }

    fn target(pod: &str, container: &str) -> PodContainer {
        PodContainer {
            pod: pod.into(),
            pod_namespace: DEFAULT_POD_NAMESPACE.into(),
            container: container.into(),
        }
    }

    /// Pod default/agent (sandbox s1; app containers `app` and `sidecar`), pod tools/agent and a
    /// plain (non-CRI) container.
    fn node() -> Vec<Member> {
        let records = [
            (
                cri_record("s1", ("default", "agent"), None, "s1", 0, true),
                true,
            ),
            (
                cri_record("a1", ("default", "agent"), Some("app"), "s1", 1, true),
                true,
            ),
            (
                cri_record("c1", ("default", "agent"), Some("sidecar"), "s1", 2, false),
                true,
            ),
            (
                cri_record("s2", ("tools", "agent"), None, "s2", 3, true),
                true,
            ),
            (
                cri_record("a2", ("tools", "agent"), Some("app"), "s2", 4, true),
                true,
            ),
            (
                Container {
                    id: "plain".into(),
                    ..Default::default()
                },
                true,
            ),
        ];
        records
            .iter()
            .filter_map(|(c, live)| Member::of(c, *live))
            .collect()
    }

    #[test]
    fn a_record_is_read_through_annotations_then_labels() {
        let members = node();
        assert_eq!(members.len(), 5, "the plain container is no pod member");
        let sidecar = members.iter().find(|m| m.id == "c1").unwrap();
        assert_eq!(
            (sidecar.pod.as_str(), sidecar.pod_namespace.as_str()),
            ("agent", "default")
        );
        assert_eq!(
            (
                sidecar.name.as_deref(),
                sidecar.kind,
                sidecar.sandbox_id.as_str()
            ),
            (Some("sidecar"), Kind::App, "s1")
        );
        let sandbox = members.iter().find(|m| m.id == "s1").unwrap();
        assert_eq!(
            (sandbox.kind, sandbox.name.as_deref()),
            (Kind::Sandbox, None)
        );
        // Labels only (a record whose spec says nothing): still a member.
        let mut labelled = cri_record("x", ("default", "p"), Some("c"), "s", 0, true);
        labelled.spec = None;
        let m = Member::of(&labelled, false).unwrap();
        assert_eq!(
            (m.pod.as_str(), m.name.as_deref(), m.kind, m.live),
            ("p", Some("c"), Kind::App, false)
        );
        // The annotation wins over a label that disagrees.
        let mut relabelled = cri_record("y", ("default", "p"), Some("c"), "s", 0, true);
        relabelled
            .labels
            .insert(LABEL_CONTAINER_NAME.into(), "other".into());
        assert_eq!(
            Member::of(&relabelled, true).unwrap().name.as_deref(),
            Some("c")
        );
    }

    #[test]
    fn a_pod_and_container_name_resolve_to_the_app_container() {
        let members = node();
        assert_eq!(
            resolve(&target("agent", "app"), &members, NS).unwrap(),
            Resolved {
                id: "a1".into(),
                note: None
            }
        );
        // Without kubelet labels (annotations only).
        assert_eq!(
            resolve(&target("agent", "sidecar"), &members, NS)
                .unwrap()
                .id,
            "c1"
        );
        // The Kubernetes namespace tells pods of one name apart.
        let tools = PodContainer {
            pod_namespace: "tools".into(),
            ..target("agent", "app")
        };
        assert_eq!(resolve(&tools, &members, NS).unwrap().id, "a2");
    }

    #[test]
    fn unknown_pods_and_containers_are_clear_errors() {
        let members = node();
        let e = resolve(&target("agnet", "app"), &members, NS).unwrap_err();
        assert!(matches!(e, PodError::NoPod { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("no pod default/agnet in containerd namespace k8s.io"),
            "{text}"
        );
        assert!(text.contains("default/agent, tools/agent"), "{text}");
        // A namespace without CRI pods: probably the wrong containerd namespace.
        let e = resolve(&target("agent", "app"), &[], "default")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no CRI pods") && e.contains("--namespace k8s.io"),
            "{e}"
        );

        let e = resolve(&target("agent", "web"), &members, NS).unwrap_err();
        assert!(matches!(e, PodError::NoContainer { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("pod default/agent has no container web; its containers: app, sidecar"),
            "{e}"
        );
    }

    #[test]
    fn the_pause_container_is_refused() {
        let members = node();
        for name in ["POD", "s1"] {
            let e = resolve(&target("agent", name), &members, NS).unwrap_err();
            assert!(matches!(e, PodError::Sandbox { .. }), "{name}: {e}");
            let text = e.to_string();
            assert!(
                text.contains("sandbox (pause) container")
                    && text.contains("its containers: app, sidecar"),
                "{text}"
            );
        }
        // A pod whose app containers are all gone says so.
        let only_sandbox: Vec<Member> = members.into_iter().filter(|m| m.id == "s1").collect();
        let e = resolve(&target("agent", "app"), &only_sandbox, NS)
            .unwrap_err()
            .to_string();
        assert!(e.contains("none but the sandbox"), "{e}");
    }

    #[test]
    fn of_restarted_containers_the_newest_running_one_is_taken() {
        // Attempt 0 exited, attempt 1 runs, attempt 2 exited again (CrashLoopBackOff between
        // restarts): the running one, though not the newest.
        let attempts = [
            ("old", 10, false),
            ("running", 20, true),
            ("newest-exited", 30, false),
        ];
        let members: Vec<Member> = attempts
            .iter()
            .map(|(id, created, live)| {
                Member::of(
                    &cri_record(id, ("default", "agent"), Some("app"), "s1", *created, true),
                    *live,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(
            resolve(&target("agent", "app"), &members, NS).unwrap(),
            Resolved {
                id: "running".into(),
                note: None
            }
        );

        // Two running (an old pod of the same name not yet gone): the newest, with a note.
        let mut two = members.clone();
        two.push(
            Member::of(
                &cri_record(
                    "other-pod",
                    ("default", "agent"),
                    Some("app"),
                    "s9",
                    5,
                    true,
                ),
                true,
            )
            .unwrap(),
        );
        let r = resolve(&target("agent", "app"), &two, NS).unwrap();
        assert_eq!(r.id, "running");
        let note = r.note.unwrap();
        assert!(
            note.contains("2 running records") && note.contains("other-pod"),
            "{note}"
        );

        // None running: name one by id, newest first.
        let stopped: Vec<Member> = members
            .into_iter()
            .map(|m| Member { live: false, ..m })
            .collect();
        let e = resolve(&target("agent", "app"), &stopped, NS).unwrap_err();
        assert!(matches!(e, PodError::NoneRunning { .. }), "{e}");
        let text = e.to_string();
        let (newest, old) = (
            text.find("newest-exited (").unwrap(),
            text.find("old (").unwrap(),
        );
        assert!(
            newest < old && text.contains("3 records") && text.contains("not running"),
            "{text}"
        );

        // A single record is taken even when it is not running (its store can be read).
        let single = [Member::of(
            &cri_record("gone", ("default", "agent"), Some("app"), "s1", 1, true),
            false,
        )
        .unwrap()];
        assert_eq!(
            resolve(&target("agent", "app"), &single, NS).unwrap().id,
            "gone"
        );
    }

    #[test]
    fn kubernetes_containers_are_not_replaced_behind_the_cri() {
        let record = cri_record("a1", ("default", "agent"), Some("app"), "s1", 1, false);
        let e = refuse_cri(&record, "rollback").unwrap_err().to_string();
        assert!(
            e.contains("a1 belongs to pod default/agent")
                && e.contains("a rollback")
                && e.contains("crabctl export"),
            "{e}"
        );
        let plain = Container {
            id: "plain".into(),
            ..Default::default()
        };
        assert!(refuse_cri(&plain, "fork").is_ok());
    }

    #[test]
    fn label_filters_quote_their_value() {
        assert_eq!(
            label_filter(LABEL_POD_NAME, "agent"),
            r#"labels."io.kubernetes.pod.name"=="agent""#
        );
        assert_eq!(label_filter("k", r#"a"b\c"#), r#"labels."k"=="a\"b\\c""#);
    }
}
