use std::{
    collections::{BTreeMap, BTreeSet},
    os::unix::fs::FileExt,
};

use super::*;
use crate::checkpoint::store::{sha256_reader, Store, MEDIA_TYPE_LAYER_TAR};
use crate::rollback::{
    tar::{Damage, TarError},
    LayerProblem,
};

#[test]
fn plans_keep_layers_alone_while_they_fit_then_aligned_runs() {
    assert!(plan(0, 5).is_empty());
    assert_eq!(plan(3, 5), vec![0..1, 1..2, 2..3]);
    assert_eq!(plan(5, 5).len(), 5);
    assert_eq!(plan(6, 5), vec![0..2, 2..4, 4..6]);
    assert_eq!(plan(7, 3), vec![0..4, 4..7]);
    // Room 0 is room 1: everything in one layer.
    assert_eq!(plan(9, 0), vec![0..9]);
    for n in 0..300 {
        for room in 1..40 {
            let p = plan(n, room);
            assert!(p.len() <= room, "{n} {room}: {p:?}");
            // A partition of 0..n into runs aligned at multiples of one power of two.
            let b = p.first().map_or(1, |r| r.len());
            assert!(p.len() < 2 || b.is_power_of_two(), "{n} {room}: {p:?}");
            let mut at = 0;
            for r in &p {
                assert_eq!(r.start, at);
                assert_eq!(r.start % b, 0);
                assert!(!r.is_empty() && r.len() <= b);
                at = r.end;
            }
            assert_eq!(at, n);
            // The full runs of a chain one layer longer are the same (shared by the export).
            let longer = plan(n + 1, room);
            if p.len() > 1 && longer.first().map_or(1, |r| r.len()) == b {
                for r in p.iter().filter(|r| r.len() == b) {
                    assert!(longer.contains(r), "{n} {room}: {r:?} in {longer:?}");
                }
            }
        }
    }
}

/// One entry of a test layer.
#[derive(Debug, Clone)]
enum Op {
    File(Vec<u8>, u32),
    /// Sparse: real size, extents (offset, byte).
    Sparse(u64, Vec<(u64, u8)>),
    Dir(u32),
    Symlink(&'static str),
    /// A hard link to this (earlier) path of the layer.
    Hardlink(String),
    Fifo,
    Whiteout,
    /// A directory entry with the opaque marker.
    OpaqueDir,
    /// A file with an xattr.
    Xattr(Vec<u8>),
}

/// Writes a layer (entries in the order given) as an uncompressed tar; returns its path and
/// descriptor.
fn layer(dir: &Path, n: usize, ops: &[(String, Op)]) -> (PathBuf, Descriptor) {
    let path = dir.join(format!("layer-{n}.tar"));
    let file = File::create(&path).unwrap();
    let mut w = TarWriter::new(BufWriter::new(file), path.clone());
    fn entry_of(name: &[u8], kind: u8, mode: u32, n: usize) -> TarEntry<'_> {
        TarEntry {
            name,
            kind,
            mode,
            uid: 1000 + n as u32,
            gid: 100,
            size: 0,
            mtime: (1_700_000_000 + n as i64, 250 * n as i64),
            link: b"",
            dev: (0, 0),
            xattrs: &[],
            sparse_size: None,
        }
    }
    for (p, op) in ops {
        let rel = Path::new(p);
        match op {
            Op::File(data, mode) => {
                let name = tar_name(rel, false);
                w.append(&TarEntry {
                    size: data.len() as u64,
                    ..entry_of(&name, b'0', *mode, n)
                })
                .unwrap();
                w.write_raw(data).unwrap();
                w.pad(data.len() as u64).unwrap();
            }
            Op::Xattr(data) => {
                let name = tar_name(rel, false);
                let xattrs = vec![(b"user.crab".to_vec(), data.clone())];
                w.append(&TarEntry {
                    size: data.len() as u64,
                    xattrs: &xattrs,
                    ..entry_of(&name, b'0', 0o600, n)
                })
                .unwrap();
                w.write_raw(data).unwrap();
                w.pad(data.len() as u64).unwrap();
            }
            Op::Sparse(real, extents) => {
                let name = tar_name(rel, false);
                let map: Vec<(u64, u64)> = extents.iter().map(|&(o, _)| (o, 3)).collect();
                let m = sparse_map(&map);
                let stored = m.len() as u64 + 3 * extents.len() as u64;
                w.append(&TarEntry {
                    size: stored,
                    sparse_size: Some(*real),
                    ..entry_of(&name, b'0', 0o644, n)
                })
                .unwrap();
                w.write_raw(&m).unwrap();
                for (_, b) in extents {
                    w.write_raw(&[*b; 3]).unwrap();
                }
                w.pad(stored).unwrap();
            }
            Op::Dir(mode) => {
                let name = tar_name(rel, true);
                w.append(&entry_of(&name, b'5', *mode, n)).unwrap();
            }
            Op::OpaqueDir => {
                let name = tar_name(rel, true);
                w.append(&entry_of(&name, b'5', 0o755, n)).unwrap();
                w.append(&TarEntry::whiteout(&child_name(rel, OPAQUE_MARKER)))
                    .unwrap();
            }
            Op::Symlink(to) => {
                let name = tar_name(rel, false);
                w.append(&TarEntry {
                    link: to.as_bytes(),
                    ..entry_of(&name, b'2', 0o777, n)
                })
                .unwrap();
            }
            Op::Hardlink(to) => {
                let (name, link) = (tar_name(rel, false), tar_name(Path::new(to), false));
                w.append(&TarEntry {
                    link: &link,
                    ..entry_of(&name, b'1', 0o644, n)
                })
                .unwrap();
            }
            Op::Fifo => {
                let name = tar_name(rel, false);
                w.append(&entry_of(&name, b'6', 0o600, n)).unwrap();
            }
            Op::Whiteout => w.whiteout(rel).unwrap(),
        }
    }
    w.finish().unwrap();
    let (digest, size) = sha256_reader(File::open(&path).unwrap()).unwrap();
    let d = Descriptor {
        digest: digest.clone(),
        diff_id: digest,
        size,
        media_type: MEDIA_TYPE_LAYER_TAR.to_string(),
    };
    (path, d)
}

fn state_of(layers: &[(PathBuf, Descriptor)]) -> LayerState {
    let mut s = LayerState::default();
    for (p, d) in layers {
        read_layer_at(p, d, |r| s.apply(r, 100_000)).unwrap();
    }
    s
}

/// What `probes` are in `state` (layers `files`): per path its kind, metadata and data, and
/// which other probe carries the same data (hard links), comparable across representations.
fn view(
    state: &LayerState,
    files: &[(PathBuf, Descriptor)],
    probes: &BTreeSet<PathBuf>,
) -> BTreeMap<PathBuf, String> {
    // Uncompressed test layers: data offsets are offsets in the files.
    let opened: Vec<File> = files.iter().map(|(p, _)| File::open(p).unwrap()).collect();
    let mut first_of: BTreeMap<DataRef, PathBuf> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for p in probes {
        let v = match state.lookup(p) {
            Lookup::Absent => "absent".to_string(),
            Lookup::Lower => "lower".to_string(),
            Lookup::Entry(Node::Gone) => "gone".to_string(),
            Lookup::Entry(Node::Entry { header, data, .. }) => {
                let mut s = format!(
                    "{:?} {:o} {}:{} {:?} {:?} {:?} {:?} size {} sparse {:?}",
                    header.kind,
                    header.mode,
                    header.uid,
                    header.gid,
                    header.mtime,
                    header.link,
                    header.dev,
                    header.xattrs,
                    header.size,
                    header.sparse
                );
                if let Some(d) = data {
                    let mut bytes = vec![0u8; d.at.len as usize];
                    opened[d.layer]
                        .read_exact_at(&mut bytes, d.at.offset)
                        .unwrap();
                    let first = first_of.entry(*d).or_insert_with(|| p.clone());
                    s += &format!(" data {bytes:?} shared with {}", first.display());
                }
                if header.kind == Kind::Dir {
                    s += &format!(" lower below {}", state.lower_below(p));
                }
                s
            }
        };
        out.insert(p.clone(), v);
    }
    out
}

impl PartialOrd for DataRef {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for DataRef {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.layer, self.at.offset).cmp(&(other.layer, other.at.offset))
    }
}

/// Squashes `chain` and checks the squashed layer means what the chain means at every probe
/// (each path named, a child below it, and `extra`); returns the squashed layer.
fn check_squash(
    dir: &Path,
    chain: &[(PathBuf, Descriptor)],
    extra: &[&str],
) -> (PathBuf, Descriptor) {
    let store = Store::open(&dir.join("store")).unwrap();
    let out_path = dir.join(format!("squashed-{}.tar", chain.len()));
    let stats = squash(
        store.root(),
        chain,
        File::create(&out_path).unwrap(),
        &out_path,
        (100_000, 1 << 30),
    )
    .unwrap();
    let (digest, size) = sha256_reader(File::open(&out_path).unwrap()).unwrap();
    assert_eq!(size, stats.bytes);
    let squashed = (
        out_path,
        Descriptor {
            digest: digest.clone(),
            diff_id: digest,
            size,
            media_type: MEDIA_TYPE_LAYER_TAR.to_string(),
        },
    );
    let before = state_of(chain);
    let after = state_of(std::slice::from_ref(&squashed));
    let mut probes: BTreeSet<PathBuf> = extra.iter().map(PathBuf::from).collect();
    for (p, _) in before.nodes() {
        probes.insert(p.to_path_buf());
        probes.insert(p.join("probe"));
    }
    for (p, _) in after.nodes() {
        probes.insert(p.to_path_buf());
    }
    let want = view(&before, chain, &probes);
    let got = view(&after, std::slice::from_ref(&squashed), &probes);
    for p in &probes {
        assert_eq!(got[p], want[p], "{}: squashed vs chain", p.display());
    }
    // No temporary file left in the store.
    let left: Vec<_> = std::fs::read_dir(store.root().join("blobs"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    squashed
}

fn s(p: &str) -> String {
    p.to_string()
}

#[test]
fn a_squashed_chain_means_what_the_chain_means() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let chain = vec![
        layer(
            d,
            0,
            &[
                (s(""), Op::Dir(0o755)),
                (s("app"), Op::Dir(0o755)),
                (s("app/a"), Op::File(b"one".to_vec(), 0o644)),
                (s("app/gone"), Op::File(b"soon deleted".to_vec(), 0o600)),
                (s("app/h1"), Op::File(b"linked".to_vec(), 0o640)),
                (s("app/h2"), Op::Hardlink(s("app/h1"))),
                (s("app/h3"), Op::Hardlink(s("app/h1"))),
                (s("etc"), Op::Dir(0o755)),
                (s("etc/.wh.passwd"), Op::Whiteout),
                (s("tmp"), Op::Dir(0o1777)),
                (s("tmp/sock"), Op::Fifo),
                (s("usr"), Op::OpaqueDir),
                (s("usr/new"), Op::File(b"new".to_vec(), 0o755)),
                (
                    s("var"),
                    Op::File(b"a file over the image's directory".to_vec(), 0o644),
                ),
            ],
        ),
        layer(
            d,
            1,
            &[
                (s("app"), Op::Dir(0o700)),
                (s("app/a"), Op::File(b"two".to_vec(), 0o644)),
                (s("app/gone"), Op::Whiteout),
                // The hard link group's first path replaced: the others keep the data.
                (s("app/h1"), Op::Symlink("elsewhere")),
                (
                    s("app/sparse"),
                    Op::Sparse(1 << 30, vec![(0, b'x'), (1 << 20, b'y')]),
                ),
                (s("app/x"), Op::Xattr(b"value".to_vec())),
                (s("etc"), Op::Dir(0o755)),
                (s("etc/passwd"), Op::File(b"root:x:0:0".to_vec(), 0o644)),
                (s("lib"), Op::Whiteout),
                (s("var"), Op::Dir(0o755)),
                (s("var/log"), Op::File(b"log".to_vec(), 0o644)),
            ],
        ),
        layer(
            d,
            2,
            &[
                (s("app"), Op::Dir(0o755)),
                (s("app/a"), Op::Whiteout),
                (s("lib"), Op::Dir(0o755)),
                (
                    s("lib/only"),
                    Op::File(b"after the deletion".to_vec(), 0o644),
                ),
                (s("tmp"), Op::Dir(0o1777)),
                (s("tmp/sock"), Op::Whiteout),
                (s("usr"), Op::Dir(0o755)),
                (s("usr/more"), Op::File(b"more".to_vec(), 0o644)),
            ],
        ),
    ];
    let extra = [
        "etc/hosts",
        "usr/bin",
        "usr/bin/sh",
        "lib/x86_64",
        "var/cache",
        "opt",
        "app/h2",
        "app/h3",
    ];
    let (path, desc) = check_squash(d, &chain, &extra);
    let after = state_of(&[(path.clone(), desc.clone())]);
    // Spot checks of what the equivalence covers: the image's /usr stays hidden, the deleted
    // /lib came back empty with one file, the hard links kept each other.
    assert_eq!(after.lookup(Path::new("usr/bin")), Lookup::Absent);
    assert_eq!(after.lookup(Path::new("lib/x86_64")), Lookup::Absent);
    assert_eq!(after.lookup(Path::new("etc/hosts")), Lookup::Lower);
    assert_eq!(after.lookup(Path::new("app/a")), Lookup::Absent);
    let Lookup::Entry(Node::Entry { linked, .. }) = after.lookup(Path::new("app/h3")) else {
        panic!("app/h3")
    };
    assert_eq!(linked.as_deref(), Some(Path::new("app/h2")));
    // Deterministic: the same chain, the same bytes.
    let again = dir.path().join("again");
    std::fs::create_dir(&again).unwrap();
    let (path2, desc2) = check_squash(&again, &chain, &extra);
    assert_eq!(desc.digest, desc2.digest);
    assert_eq!(std::fs::read(path).unwrap(), std::fs::read(path2).unwrap());
}

#[test]
fn one_layer_squashes_to_its_own_meaning_and_damage_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let one = layer(
        d,
        0,
        &[
            (s("a"), Op::Dir(0o755)),
            (s("a/f"), Op::File(vec![7u8; 5000], 0o644)),
            (s("b"), Op::Whiteout),
        ],
    );
    check_squash(d, std::slice::from_ref(&one), &["b/c", "c"]);
    // A blob whose content is not its digest's: refused, nothing written counts.
    let mut bad = one.clone();
    let mut bytes = std::fs::read(&bad.0).unwrap();
    bytes[600] ^= 1;
    bad.0 = d.join("bad.tar");
    std::fs::write(&bad.0, &bytes).unwrap();
    let store = Store::open(&d.join("store2")).unwrap();
    let out = d.join("out.tar");
    let e = squash(
        store.root(),
        &[bad],
        File::create(&out).unwrap(),
        &out,
        (1000, 1 << 30),
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            RollbackError::Layer {
                source: LayerProblem::Digest(_) | LayerProblem::Tar(_),
                ..
            }
        ),
        "{e}"
    );
    let e = e.to_string();
    assert!(e.contains("damaged") || e.contains("digest"), "{e}");
    // More entries than allowed, more bytes than allowed.
    let e = squash(
        store.root(),
        std::slice::from_ref(&one),
        File::create(&out).unwrap(),
        &out,
        (2, 1 << 30),
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            RollbackError::Layer {
                source: LayerProblem::Tar(TarError::Bad {
                    why: Damage::TooManyEntries(2),
                    ..
                }),
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("more than 2 entries"), "{e}");
    let e = squash(
        store.root(),
        &[one],
        File::create(&out).unwrap(),
        &out,
        (1000, 4096),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("more than the bound"), "{e}");
}

/// The random chains' generator (xorshift64*, shared with the root tests).
use crate::test_rng::Rng;

const NAMES: [&str; 12] = [
    "a", "a/b", "a/b/c", "a/b/d", "a/e", "f", "g", "g/h", "g/h/i", "g/j", "k", "k/l",
];

/// A random but well-formed layer: distinct paths, every ancestor of an entry a directory
/// entry of the layer (as crab's layers carry them), hard links to earlier files.
fn random_layer(rng: &mut Rng) -> Vec<(String, Op)> {
    let mut chosen: BTreeMap<String, Op> = BTreeMap::new();
    for _ in 0..1 + rng.below(7) {
        let name = NAMES[rng.below(NAMES.len())].to_string();
        let op = match rng.below(9) {
            0 | 1 => Op::File(vec![b'a' + rng.below(26) as u8; rng.below(700)], 0o644),
            2 => Op::Dir([0o755, 0o700, 0o1777][rng.below(3)]),
            3 => Op::Whiteout,
            4 => Op::OpaqueDir,
            5 => Op::Symlink("target"),
            6 => Op::Fifo,
            7 => Op::Xattr(vec![b'x'; rng.below(40)]),
            _ => Op::Sparse(1 << 20, vec![(4096, b'q')]),
        };
        chosen.insert(name, op);
    }
    // Ancestors become directories (an entry below a file or a deletion is not a layer).
    let names: Vec<String> = chosen.keys().cloned().collect();
    for n in &names {
        for a in Path::new(n).ancestors().skip(1) {
            if a.as_os_str().is_empty() {
                break;
            }
            let a = a.to_string_lossy().to_string();
            if !matches!(chosen.get(&a), Some(Op::Dir(_) | Op::OpaqueDir)) {
                chosen.insert(a, Op::Dir(0o755));
            }
        }
    }
    // Hard links: now and then a file of the layer gets a second name.
    let files: Vec<String> = chosen
        .iter()
        .filter(|(_, o)| matches!(o, Op::File(..)))
        .map(|(n, _)| n.clone())
        .collect();
    let mut out: Vec<(String, Op)> = chosen.into_iter().collect();
    if let Some(f) = files.first() {
        if rng.below(2) == 0 && !out.iter().any(|(n, _)| n == "z") {
            out.push(("z".to_string(), Op::Hardlink(f.clone())));
        }
    }
    out
}

#[test]
fn random_chains_squash_to_what_they_mean() {
    let runs: u64 = std::env::var("CRAB_SQUASH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for seed in 1..=runs {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let dir = tempfile::tempdir().unwrap();
        let chain: Vec<(PathBuf, Descriptor)> = (0..1 + rng.below(5))
            .map(|n| layer(dir.path(), n, &random_layer(&mut rng)))
            .collect();
        let probes: Vec<&str> = NAMES.to_vec();
        let result = std::panic::catch_unwind(|| check_squash(dir.path(), &chain, &probes));
        if result.is_err() {
            panic!("seed {seed}: the squash of this chain differs (see above)");
        }
    }
}
