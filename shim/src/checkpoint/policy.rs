//! Checkpoint policies: which checkpoint a turn end takes, given the inspector's answer.
//!
//! `minimal` (the default) is crab itself: the answer's kind as it is. The other policies are
//! baselines crab is measured against ([`CheckpointPolicy`] says what each keeps); they change
//! only the kind the coordinator acts on. The stored turn answer stays the inspector's, so
//! `crabctl show` still says what the turn really left behind.
//!
//! Under `fs-every-turn` an unchanged turn still takes an fs checkpoint: a layer of the turn's
//! net change, which is then empty. Under either baseline the layer holds exactly the net
//! change the inspector found, as under `minimal`; only whether and what is taken differs.

use std::borrow::Cow;

use oci_spec::runtime::Spec;

pub use crab_runtime_config::{CheckpointPolicy, SelfContainedChanges};

use crate::{
    error::{Error, Result},
    inspector::{Answer, Kind},
};

/// Container spec annotation choosing the policy; overrides `[checkpoint] policy`.
pub const POLICY_ANNOTATION: &str = "io.crab/checkpoint-policy";

/// The checkpoint a turn end takes under `policy` when the inspector answered `inspected`.
pub fn kind_for(policy: CheckpointPolicy, inspected: Kind) -> Kind {
    match policy {
        CheckpointPolicy::Minimal => inspected,
        // Files only: a process change is what this baseline gives up.
        CheckpointPolicy::FsEveryTurn => Kind::Fs,
        CheckpointPolicy::FullEveryTurn => Kind::Full,
    }
}

/// The answer the coordinator acts on: the inspector's, with the kind `policy` asks for
/// (borrowed when that is the inspector's own).
pub fn apply(policy: CheckpointPolicy, answer: &Answer) -> Cow<'_, Answer> {
    let kind = kind_for(policy, answer.kind);
    if kind == answer.kind {
        return Cow::Borrowed(answer);
    }
    log::info!(
        "turn {} of {}: policy {policy} takes {kind:?} (the inspector answered {:?})",
        answer.seq,
        answer.container_id,
        answer.kind
    );
    let mut a = answer.clone();
    a.kind = kind;
    Cow::Owned(a)
}

/// The policy of one container: its spec annotation [`POLICY_ANNOTATION`] if set, else the
/// configured one. An unknown name is an error (the container is not created).
pub fn for_container(spec: &Spec, configured: CheckpointPolicy) -> Result<CheckpointPolicy> {
    parse_annotation(
        crate::bundle::annotation(spec, &[POLICY_ANNOTATION]),
        configured,
    )
}

fn parse_annotation(value: Option<&str>, configured: CheckpointPolicy) -> Result<CheckpointPolicy> {
    let Some(name) = value else {
        return Ok(configured);
    };
    CheckpointPolicy::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = CheckpointPolicy::ALL.iter().map(|p| p.name()).collect();
        Error::InvalidArgument(format!(
            "spec annotation {POLICY_ANNOTATION} must be one of {}, got {name:?}",
            known.join(", ")
        ))
    })
}

/// Container spec annotation choosing what a turn end does with self-contained changes;
/// overrides `[checkpoint] self_contained_changes`.
pub const SELF_CONTAINED_ANNOTATION: &str = "io.crab/self-contained-changes";

/// Whether the turn ends of a container keep the image of a process whose memory changed by
/// its own doing alone: its spec annotation [`SELF_CONTAINED_ANNOTATION`] if set, else the
/// configured value. An unknown value is an error (the container is not created).
pub fn keeps_self_contained(spec: &Spec, configured: SelfContainedChanges) -> Result<bool> {
    let value = match crate::bundle::annotation(spec, &[SELF_CONTAINED_ANNOTATION]) {
        None => configured,
        Some(name) => SelfContainedChanges::from_name(name).ok_or_else(|| {
            let known: Vec<&str> = SelfContainedChanges::ALL.iter().map(|p| p.name()).collect();
            Error::InvalidArgument(format!(
                "spec annotation {SELF_CONTAINED_ANNOTATION} must be one of {}, got {name:?}",
                known.join(", ")
            ))
        })?,
    };
    Ok(value == SelfContainedChanges::Keep)
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::PathBuf};

    use super::*;
    use crate::inspector::{FsFinding, ProcFinding};

    const KINDS: [Kind; 4] = [Kind::None, Kind::Fs, Kind::Proc, Kind::Full];

    fn answer(kind: Kind) -> Answer {
        Answer {
            container_id: "c".into(),
            seq: 3,
            kind,
            fs: FsFinding {
                changed: kind == Kind::Fs || kind == Kind::Full,
                added: vec![PathBuf::from("app/x")],
                ..Default::default()
            },
            procs: ProcFinding::default(),
            degraded: Vec::new(),
            elapsed_us: 7,
        }
    }

    #[test]
    fn minimal_is_the_inspectors_answer() {
        for k in KINDS {
            assert_eq!(kind_for(CheckpointPolicy::Minimal, k), k);
            assert!(matches!(
                apply(CheckpointPolicy::Minimal, &answer(k)),
                Cow::Borrowed(_)
            ));
        }
    }

    #[test]
    fn fs_every_turn_takes_files_only_every_turn() {
        for k in KINDS {
            assert_eq!(
                kind_for(CheckpointPolicy::FsEveryTurn, k),
                Kind::Fs,
                "{k:?}"
            );
        }
    }

    #[test]
    fn full_every_turn_takes_everything_every_turn() {
        for k in KINDS {
            assert_eq!(
                kind_for(CheckpointPolicy::FullEveryTurn, k),
                Kind::Full,
                "{k:?}"
            );
        }
    }

    #[test]
    fn apply_changes_only_the_kind() {
        let a = answer(Kind::None);
        let b = apply(CheckpointPolicy::FullEveryTurn, &a);
        assert_eq!(b.kind, Kind::Full);
        assert_eq!(
            (b.seq, b.elapsed_us, &b.fs.added),
            (a.seq, a.elapsed_us, &a.fs.added)
        );
        let a = answer(Kind::Fs);
        assert!(matches!(
            apply(CheckpointPolicy::FsEveryTurn, &a),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn annotation_overrides_the_config() {
        use CheckpointPolicy::*;
        assert_eq!(parse_annotation(None, FsEveryTurn).unwrap(), FsEveryTurn);
        for p in CheckpointPolicy::ALL {
            assert_eq!(parse_annotation(Some(p.name()), Minimal).unwrap(), p);
        }
        for bad in ["", "none", "Minimal", "fs_every_turn"] {
            let e = parse_annotation(Some(bad), Minimal)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(POLICY_ANNOTATION) && e.contains("full-every-turn"),
                "{e}"
            );
        }
    }

    #[test]
    fn annotation_is_read_from_the_spec() {
        let mut spec = Spec::default();
        assert_eq!(
            for_container(&spec, CheckpointPolicy::Minimal).unwrap(),
            CheckpointPolicy::Minimal
        );
        spec.set_annotations(Some(HashMap::from([(
            POLICY_ANNOTATION.to_string(),
            "fs-every-turn".to_string(),
        )])));
        assert_eq!(
            for_container(&spec, CheckpointPolicy::Minimal).unwrap(),
            CheckpointPolicy::FsEveryTurn
        );
    }

    #[test]
    fn self_contained_changes_from_the_annotation_or_the_config() {
        let mut spec = Spec::default();
        assert!(!keeps_self_contained(&spec, SelfContainedChanges::Checkpoint).unwrap());
        assert!(keeps_self_contained(&spec, SelfContainedChanges::Keep).unwrap());
        for (value, keeps) in [("keep", true), ("checkpoint", false)] {
            spec.set_annotations(Some(HashMap::from([(
                SELF_CONTAINED_ANNOTATION.to_string(),
                value.to_string(),
            )])));
            assert_eq!(
                keeps_self_contained(&spec, SelfContainedChanges::Checkpoint).unwrap(),
                keeps
            );
            assert_eq!(
                keeps_self_contained(&spec, SelfContainedChanges::Keep).unwrap(),
                keeps
            );
        }
        for hostile in ["Keep", "keep ", "", "yes", "keep\0", "none"] {
            spec.set_annotations(Some(HashMap::from([(
                SELF_CONTAINED_ANNOTATION.to_string(),
                hostile.to_string(),
            )])));
            let e = keeps_self_contained(&spec, SelfContainedChanges::Keep)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(SELF_CONTAINED_ANNOTATION) && e.contains("checkpoint, keep"),
                "{e}"
            );
        }
    }
}
