//! `crabctl lineages [LINEAGE]`: the lineages whose checkpoints are on this node (in the
//! namespace), each with its stores and its newest durable checkpoint: the one a container of
//! that lineage created with `io.crab/resume: newest` starts from. The stores are looked for
//! under every state_dir a config in play names: `--config` (or the default config), and the
//! configs of the namespace's containers (a CRI handler's `ConfigPath`, Docker's).

use std::{collections::BTreeSet, path::PathBuf};

use crab_runtime_config::Config;
use crab_shim::checkpoint::lineage::{self, LineageStore};
use serde::Serialize;

use super::{Ctl, Result};

/// One lineage, as `lineages -o json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct LineageRow {
    pub lineage: String,
    /// The checkpoint a resume starts from (`null`: none durable).
    pub newest: Option<NewestRow>,
    pub stores: Vec<StoreRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NewestRow {
    pub container: String,
    pub seq: u64,
    pub turn_id: String,
    pub kind: String,
    pub created_at: String,
    /// The chain id of the image it was taken on, when its store recorded one.
    pub image: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StoreRow {
    pub container: String,
    pub path: PathBuf,
    /// Set aside: a later container with the same id has a store of its own.
    pub set_aside: bool,
    /// Its durable checkpoints (recovery points).
    pub checkpoints: usize,
    /// The newest of them.
    pub newest_seq: Option<u64>,
    /// What its replicator did (`null`: never replicated).
    pub replication: Option<crab_shim::replication::Status>,
}

/// The rows of `stores`, grouped by lineage (sorted by name).
pub fn rows(stores: Vec<LineageStore>) -> Vec<LineageRow> {
    let names: BTreeSet<String> = stores.iter().map(|s| s.record.lineage.clone()).collect();
    names
        .into_iter()
        .map(|name| {
            let mine: Vec<LineageStore> = stores
                .iter()
                .filter(|s| s.record.lineage == name)
                .cloned()
                .collect();
            let store_rows = mine
                .iter()
                .map(|s| StoreRow {
                    container: s.container.clone(),
                    path: s.store.clone(),
                    set_aside: s.set_aside,
                    checkpoints: s.durable,
                    newest_seq: s.newest.as_ref().map(|m| m.seq),
                    replication: crab_shim::replication::Status::read(&s.store),
                })
                .collect();
            let newest = lineage::newest_of(mine).map(|c| NewestRow {
                container: c.container,
                seq: c.manifest.seq,
                turn_id: c.manifest.turn_id,
                kind: format!("{:?}", c.manifest.kind).to_lowercase(),
                created_at: c.manifest.created_at,
                image: c.record.image,
            });
            LineageRow {
                lineage: name,
                newest,
                stores: store_rows,
            }
        })
        .collect()
}

impl Ctl {
    /// The lineages of the namespace (only `only`, when given).
    pub async fn lineages(&self, only: Option<&str>) -> Result<Vec<LineageRow>> {
        let mut dirs: BTreeSet<PathBuf> = BTreeSet::new();
        dirs.insert(
            Config::load_or_default(self.config.as_deref())?
                .0
                .store
                .state_dir,
        );
        for record in self.client.containers().await? {
            if let Ok(c) = self.config_for(&record) {
                dirs.insert(c.store.state_dir);
            }
        }
        let (namespace, only) = (self.namespace().to_string(), only.map(str::to_string));
        let stores = tokio::task::spawn_blocking(move || {
            dirs.iter()
                .flat_map(|d| lineage::stores(&d.join(&namespace), only.as_deref()))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| super::CtlError::Failed(format!("listing the stores: {e}")))?;
        Ok(rows(stores))
    }
}

/// `lineages` for people: one line per lineage, then its stores.
pub fn print_text(rows: &[LineageRow]) {
    if rows.is_empty() {
        println!("no lineage has a checkpoint store here");
        return;
    }
    println!(
        "{:<40} {:<20} {:>5}  {:<16} {:<8} CREATED",
        "LINEAGE", "NEWEST IN", "SEQ", "TURN", "KIND"
    );
    for r in rows {
        match &r.newest {
            Some(n) => println!(
                "{:<40} {:<20} {:>5}  {:<16} {:<8} {}",
                r.lineage,
                short(&n.container),
                n.seq,
                n.turn_id,
                n.kind,
                n.created_at
            ),
            None => println!("{:<40} (no recovery point)", r.lineage),
        }
        for s in &r.stores {
            println!(
                "  store of {}{}: {} recovery points ({})",
                s.container,
                if s.set_aside { " (set aside)" } else { "" },
                s.checkpoints,
                s.path.display()
            );
        }
    }
}

/// `replication` for people: per lineage, each store's replication (LAG: its newest push,
/// from the end of the oldest turn it covered, or from the checkpoint durable for one that did
/// not record its turn end).
pub fn print_replication(rows: &[LineageRow]) {
    let mut any = false;
    println!(
        "{:<40} {:<20} {:>6} {:>10} {:>9} {:>12} {:>12}  LAST ERROR",
        "LINEAGE", "CONTAINER", "NEWEST", "REPLICATED", "LAG", "SENT", "SKIPPED"
    );
    for r in rows {
        for s in &r.stores {
            let Some(st) = &s.replication else {
                continue;
            };
            any = true;
            println!(
                "{:<40} {:<20} {:>6} {:>10} {:>7.0}ms {:>12} {:>12}  {}",
                r.lineage,
                short(&s.container),
                s.newest_seq.map_or("-".into(), |n| n.to_string()),
                st.pushed_seq.map_or("-".into(), |n| n.to_string()),
                st.turn_lag_ms.or(st.lag_ms).unwrap_or(0.0),
                st.bytes_sent,
                st.bytes_skipped,
                st.last_error.as_deref().unwrap_or("-")
            );
        }
    }
    if !any {
        println!("(no store here was replicated: [replication] registry is not set, or no checkpoint yet)");
    }
}

fn short(id: &str) -> &str {
    match id.len() > 20 {
        true => &id[..20],
        false => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_shim::checkpoint::{
        lineage::LineageRecord,
        store::{CheckpointKind, Manifest},
    };

    fn store(container: &str, lineage: &str, created: Option<&str>) -> LineageStore {
        LineageStore {
            store: PathBuf::from(format!("/s/{container}")),
            container: container.into(),
            set_aside: false,
            record: LineageRecord::new(lineage, None),
            durable: usize::from(created.is_some()),
            newest: created.map(|at| {
                let mut m = Manifest::child_of(None, 3, "t3", CheckpointKind::Fs);
                m.created_at = at.into();
                m
            }),
        }
    }

    #[test]
    fn lineages_group_their_stores_and_name_the_newest_checkpoint() {
        let rows = rows(vec![
            store("b", "ns/p/c", Some("2026-12-06T02:00:00.000Z")),
            store("a", "ns/p/c", Some("2026-12-06T01:00:00.000Z")),
            store("z", "other", None),
        ]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].lineage, "ns/p/c");
        assert_eq!(rows[0].stores.len(), 2);
        let n = rows[0].newest.as_ref().unwrap();
        assert_eq!(
            (n.container.as_str(), n.seq, n.kind.as_str()),
            ("b", 3, "fs")
        );
        assert!(rows[1].newest.is_none());
    }
}
