//! Squashing a run of fs layers (`crabctl export` of a long chain): whatever the layers hold,
//! the squash either refuses them with an error or writes a layer that crab's reader takes
//! back and that means what the run meant, path by path.
//!
//! Input: a count byte (1-3 layers), then for each layer but the last a 2-byte little-endian
//! length, then the layers' bytes (the last takes the rest).
#![no_main]

use std::io::Write;

use crab_shim::checkpoint::store::{digest_string, Descriptor, MEDIA_TYPE_LAYER_TAR};
use crab_shim::rollback::{
    squash,
    state::{LayerState, Lookup, Node},
};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fn split(data: &[u8]) -> Option<Vec<&[u8]>> {
    let (&count, mut rest) = data.split_first()?;
    let count = 1 + usize::from(count % 3);
    let mut layers = Vec::with_capacity(count);
    for _ in 1..count {
        let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
        rest = &rest[2..];
        let n = len.min(rest.len());
        layers.push(&rest[..n]);
        rest = &rest[n..];
    }
    layers.push(rest);
    Some(layers)
}

fn state_of(files: &[(std::path::PathBuf, Descriptor)]) -> LayerState {
    let mut s = LayerState::default();
    for (p, _) in files {
        let bytes = std::fs::read(p).unwrap();
        s.apply(&bytes[..], 10_000).unwrap();
    }
    s
}

fn kind(l: Lookup<'_>) -> String {
    match l {
        Lookup::Absent | Lookup::Entry(Node::Gone) => "absent".into(),
        Lookup::Lower => "lower".into(),
        Lookup::Entry(Node::Entry { header, .. }) => format!(
            "{:?} {:o} {}:{} {:?} {:?} {}",
            header.kind, header.mode, header.uid, header.gid, header.mtime, header.xattrs, header.size
        ),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some(layers) = split(data) else { return };
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("blobs")).unwrap();
    let mut files = Vec::new();
    for (i, bytes) in layers.iter().enumerate() {
        let path = dir.path().join(format!("layer-{i}"));
        std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
        let digest = digest_string(Sha256::new_with_prefix(bytes));
        files.push((
            path,
            Descriptor {
                digest: digest.clone(),
                diff_id: digest,
                size: bytes.len() as u64,
                media_type: MEDIA_TYPE_LAYER_TAR.to_string(),
            },
        ));
    }
    let out = dir.path().join("squashed");
    let result = squash::squash(
        dir.path(),
        &files,
        std::fs::File::create(&out).unwrap(),
        &out,
        (10_000, 1 << 20),
    );
    if result.is_err() {
        return;
    }
    // What the run meant, and what the squashed layer means, at every path the run names.
    let before = state_of(&files);
    let squashed = std::fs::read(&out).unwrap();
    let mut after = LayerState::default();
    after
        .apply(&squashed[..], 10_000)
        .unwrap_or_else(|e| panic!("the squashed layer does not read back: {e}"));
    for (p, _) in before.nodes() {
        for q in [p.to_path_buf(), p.join("probe")] {
            assert_eq!(kind(after.lookup(&q)), kind(before.lookup(&q)), "{}", q.display());
        }
    }
});
