//! CONTAINER as the user spells it: a container id, a unique prefix of one (as `docker`
//! takes short ids), or in Docker's namespace a Docker container name.
//!
//! An id that names a record is taken as it is. Otherwise, among the ids made of lowercase hex
//! digits only (Docker's 64-digit ids, generated ids), the one that the argument begins stands
//! for its record; several are an error listing them. Ids spelled otherwise are never matched
//! by a prefix: `c1` must not silently become `c1-fork-1` once `c1` is gone. In namespace
//! [`docker::NAMESPACE`] dockerd is asked last (a name, or a prefix it knows). What matches
//! nothing is passed on unchanged: a store outlives its container, and the commands say what
//! is missing.

use crate::{
    docker::{self, Lookup},
    Ctl, CtlError, Result,
};

/// Most candidates an ambiguity error lists.
const MAX_LISTED: usize = 10;

/// The container an argument stands for, and a note when it was not spelled out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedId {
    pub id: String,
    pub note: Option<String>,
}

/// Whether `s` is spelled like a Docker id or a prefix of one (lowercase hex digits only).
pub fn is_hex_id(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The one id among `ids` that `arg` names: itself, else the only hex id ([`is_hex_id`]) it
/// is a prefix of; `None` when none matches.
pub fn match_id<'a>(
    ids: impl IntoIterator<Item = &'a str>,
    arg: &str,
    namespace: &str,
) -> Result<Option<String>> {
    let mut candidates: Vec<&str> = Vec::new();
    for id in ids {
        if id == arg {
            return Ok(Some(id.to_string()));
        }
        if is_hex_id(arg) && is_hex_id(id) && id.starts_with(arg) {
            candidates.push(id);
        }
    }
    match candidates.len() {
        0 => Ok(None),
        1 => Ok(Some(candidates[0].to_string())),
        n => {
            candidates.sort_unstable();
            let mut listed: Vec<String> = candidates
                .iter()
                .take(MAX_LISTED)
                .map(|s| s.to_string())
                .collect();
            if n > MAX_LISTED {
                listed.push(format!("and {} more", n - MAX_LISTED));
            }
            Err(CtlError::Ambiguous {
                namespace: namespace.to_string(),
                prefix: arg.to_string(),
                candidates: listed,
            })
        }
    }
}

impl Ctl {
    /// The container id `arg` stands for (see the module docs).
    pub async fn resolve_id(&self, arg: &str) -> Result<ResolvedId> {
        let as_given = || ResolvedId {
            id: arg.to_string(),
            note: None,
        };
        if self.client.container(arg).await?.is_some() {
            return Ok(as_given());
        }
        let records = self.client.containers().await?;
        if let Some(id) = match_id(records.iter().map(|c| c.id.as_str()), arg, self.namespace())? {
            return Ok(ResolvedId {
                note: Some(format!("{arg} is container {id}")),
                id,
            });
        }
        if self.namespace() != docker::NAMESPACE {
            return Ok(as_given());
        }
        let (name, host) = (arg.to_string(), self.docker_host.clone());
        let looked_up = docker::lookup(host.as_deref(), &name).await;
        match looked_up {
            Ok(Lookup::Found { id, name, .. }) => Ok(ResolvedId {
                note: Some(format!("Docker container {name} is {id}")),
                id,
            }),
            Ok(Lookup::NotFound) => Ok(as_given()),
            Err(e) => Ok(ResolvedId {
                id: arg.to_string(),
                note: Some(format!(
                    "{arg} is no container id here, and dockerd did not say which container \
                     it names: {e}"
                )),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: &str = "moby";

    fn ids() -> Vec<&'static str> {
        vec![
            "3f4e2b0c9d1a8e7f6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a",
            "3f4e99990000000000000000000000000000000000000000000000000000000",
            "a07b",
            "c1",
            "c1-fork-1",
            "deadbeef-1",
        ]
    }

    #[test]
    fn exact_ids_and_unique_hex_prefixes_match() {
        let m = |arg| match_id(ids(), arg, NS).unwrap();
        assert_eq!(m("c1").as_deref(), Some("c1"));
        assert_eq!(m("3f4e2").as_deref(), Some(ids()[0]));
        assert_eq!(m(ids()[0]).as_deref(), Some(ids()[0]));
        assert_eq!(m("3f4e9").as_deref(), Some(ids()[1]));
        assert_eq!(m("a0").as_deref(), Some("a07b"));
        assert_eq!(m("dead"), None, "deadbeef-1 is no hex id");
        // An exact id wins over being a prefix of others.
        assert_eq!(
            match_id(["ab", "abc"], "ab", NS).unwrap().as_deref(),
            Some("ab")
        );
        // Ids not all hex are never matched by prefix (c1 gone must not become c1-fork-1).
        assert_eq!(match_id(["c1-fork-1"], "c1", NS).unwrap(), None);
        assert_eq!(
            match_id(["c1-fork-1", "c1abc"], "c1", NS)
                .unwrap()
                .as_deref(),
            Some("c1abc")
        );
        assert_eq!(m("c1-"), None);
        assert_eq!(m("3F4E"), None, "docker's ids are lowercase");
        assert_eq!(m("ff"), None);
        assert_eq!(m(""), None);
    }

    #[test]
    fn an_ambiguous_prefix_lists_the_candidates_and_is_a_usage_error() {
        let e = match_id(ids(), "3f4e", NS).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(ids()[0]) && msg.contains(ids()[1]), "{msg}");
        assert!(msg.contains("3f4e") && msg.contains(NS), "{msg}");
        assert_eq!(e.exit_code(), crate::error::EXIT_USAGE);
        let many: Vec<String> = (0..25).map(|i| format!("ab{i:02}")).collect();
        let e = match_id(many.iter().map(String::as_str), "ab", NS).unwrap_err();
        assert!(e.to_string().contains("and 15 more"), "{e}");
        assert!(!e.to_string().contains("ab24"), "{e}");
    }
}
