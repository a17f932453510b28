//! The files of a checkpoint: its fs layers applied in order over the container's image.
//!
//! [`LayerState`] is what the checkpoint's own layers (those in the store, not in the image)
//! say, path by path: an entry, a deletion (whiteout), or nothing (then the image decides,
//! unless an opaque directory or a deletion above hides it). Layers are applied oldest first
//! with OCI semantics: a layer's whiteouts and opaque markers hide what the layers *below* it
//! hold, never the layer's own entries.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    io::Read,
    path::{Path, PathBuf},
};

use super::tar::{self, DataAt, Header, Item, Kind, TarError};

/// A file's data: in layer `layer` (index into the layers read) at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataRef {
    pub layer: usize,
    pub at: DataAt,
}

/// A path as the checkpoint's layers leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// An entry; a regular file with where its data is. A hard link of the layer is the entry
    /// it links to (same header and data), with `linked` naming that entry.
    Entry {
        header: Header,
        data: Option<DataRef>,
        linked: Option<PathBuf>,
    },
    /// Deleted.
    Gone,
}

/// What a path is in the checkpoint according to its layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<'a> {
    Entry(&'a Node),
    /// Not there (deleted, or hidden by an opaque directory or a non-directory above it).
    Absent,
    /// The layers say nothing: the image's lower layers decide.
    Lower,
}

/// The state of the layers read so far.
#[derive(Debug, Default)]
pub struct LayerState {
    nodes: BTreeMap<PathBuf, Node>,
    /// Directories below which the lower layers (the image) are hidden.
    hiding: HashSet<PathBuf>,
    /// Layers read.
    layers: usize,
    entries: u64,
}

/// The paths a layer names (entries, deleted paths, opaque directories), for the layers after
/// the checkpoint: what changed since it.
#[derive(Debug, Default, Clone)]
pub struct Named {
    pub paths: BTreeSet<PathBuf>,
    /// Directories made opaque: their whole content may differ.
    pub opaque: BTreeSet<PathBuf>,
}

impl LayerState {
    /// Applies the next (newer) layer, an uncompressed tar. At most `max_entries` entries in all.
    pub fn apply(&mut self, r: impl Read, max_entries: u64) -> Result<(), TarError> {
        let layer = self.layers;
        self.layers += 1;
        let mut hides: Vec<Item> = Vec::new();
        let mut entries: Vec<(Header, Option<DataAt>)> = Vec::new();
        let room = max_entries.saturating_sub(self.entries);
        tar::read(r, room, |item, data| {
            match item {
                Item::Entry(h) => entries.push((h, data)),
                other => hides.push(other),
            }
            Ok(())
        })?;
        self.entries += (hides.len() + entries.len()) as u64;
        for h in hides {
            match h {
                Item::Whiteout(p) => {
                    self.remove_below(&p);
                    self.hiding.retain(|d| !d.starts_with(&p));
                    self.nodes.insert(p, Node::Gone);
                }
                Item::Opaque(d) => {
                    self.remove_below(&d);
                    self.hiding.insert(d);
                }
                Item::Entry(_) => unreachable!("entries are kept apart"),
            }
        }
        for (h, data) in entries {
            let path = h.path.clone();
            let replaced = self.nodes.get(&path).cloned();
            let node = match h.kind {
                Kind::Hardlink => match self.nodes.get(&h.link) {
                    Some(Node::Entry {
                        header,
                        data,
                        linked,
                    }) if header.kind == Kind::File => Node::Entry {
                        header: Header {
                            path: path.clone(),
                            ..header.clone()
                        },
                        data: *data,
                        linked: Some(linked.clone().unwrap_or_else(|| h.link.clone())),
                    },
                    _ => {
                        return Err(TarError::Bad {
                            offset: 0,
                            why: tar::Damage::DanglingLink {
                                path,
                                link: h.link.clone(),
                            },
                        })
                    }
                },
                _ => Node::Entry {
                    data: data.map(|at| DataRef { layer, at }),
                    header: h,
                    linked: None,
                },
            };
            let is_dir = matches!(&node, Node::Entry { header, .. } if header.kind == Kind::Dir);
            let was_dir =
                matches!(&replaced, Some(Node::Entry { header, .. }) if header.kind == Kind::Dir);
            if !is_dir {
                self.remove_below(&path);
            } else if !was_dir && replaced.is_some() {
                // A directory over a deleted path or a file starts empty.
                self.hiding.insert(path.clone());
            }
            self.nodes.insert(path, node);
        }
        Ok(())
    }

    fn remove_below(&mut self, p: &Path) {
        let below: Vec<PathBuf> = self
            .nodes
            .range::<Path, _>((std::ops::Bound::Excluded(p), std::ops::Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(p))
            .map(|(k, _)| k.clone())
            .collect();
        for k in below {
            self.nodes.remove(&k);
        }
    }

    /// Every path the layers name and what they leave there, in path order (a directory
    /// right before what is below it).
    pub fn nodes(&self) -> impl Iterator<Item = (&Path, &Node)> {
        self.nodes.iter().map(|(k, n)| (k.as_path(), n))
    }

    /// The directories whose older content (the image's, below the layers) is hidden: opaque
    /// ones and those made over a deleted path or a non-directory; in path order.
    pub fn hidden_dirs(&self) -> Vec<&Path> {
        let mut out: Vec<&Path> = self.hiding.iter().map(PathBuf::as_path).collect();
        out.sort();
        out
    }

    /// What the layers say of `p`.
    pub fn lookup(&self, p: &Path) -> Lookup<'_> {
        if let Some(n) = self.nodes.get(p) {
            return match n {
                Node::Gone => Lookup::Absent,
                n => Lookup::Entry(n),
            };
        }
        if self.hides_lower(p) {
            return Lookup::Absent;
        }
        Lookup::Lower
    }

    /// Whether the image's content at `p` is hidden (by an ancestor that is deleted, not a
    /// directory, or opaque). `p` itself being opaque hides only what is below it.
    fn hides_lower(&self, p: &Path) -> bool {
        let mut a = p.parent();
        while let Some(dir) = a {
            if self.hiding.contains(dir) {
                return true;
            }
            match self.nodes.get(dir) {
                Some(Node::Gone) => return true,
                Some(Node::Entry { header, .. }) if header.kind != Kind::Dir => return true,
                _ => {}
            }
            a = dir.parent();
        }
        false
    }

    /// Whether the image's content below directory `d` shows in the checkpoint.
    pub fn lower_below(&self, d: &Path) -> bool {
        !self.hiding.contains(d)
            && !self.hides_lower(d)
            && !matches!(self.nodes.get(d), Some(Node::Gone))
    }

    /// The names the layers give directly below `d`: (name, present).
    pub fn children(&self, d: &Path) -> Vec<(PathBuf, bool)> {
        let mut out = Vec::new();
        for (k, n) in self
            .nodes
            .range::<Path, _>((std::ops::Bound::Excluded(d), std::ops::Bound::Unbounded))
        {
            if !k.starts_with(d) {
                break;
            }
            if k.parent() == Some(d) {
                out.push((k.clone(), !matches!(n, Node::Gone)));
            }
        }
        out
    }
}

impl Named {
    /// The paths an uncompressed layer names.
    pub fn read(r: impl Read, max_entries: u64) -> Result<Named, TarError> {
        let mut out = Named::default();
        tar::read(r, max_entries, |item, _| {
            match item {
                Item::Entry(h) => {
                    out.paths.insert(h.path);
                }
                Item::Whiteout(p) => {
                    out.paths.insert(p);
                }
                Item::Opaque(d) => {
                    out.paths.insert(d.clone());
                    out.opaque.insert(d);
                }
            }
            Ok(())
        })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer of `(name, kind)`: `w` whiteout, `o` opaque marker, `d` dir, `f` file, `l` link.
    fn layer(entries: &[(&str, char)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, k) in entries {
            let (name, typeflag, link) = match k {
                'w' | 'o' | 'f' => (name.to_string(), b'0', ""),
                'd' => (format!("{name}/"), b'5', ""),
                'l' => {
                    let (n, to) = name.split_once("->").unwrap();
                    (n.to_string(), b'1', to)
                }
                _ => unreachable!(),
            };
            let mut b = [0u8; 512];
            b[..name.len()].copy_from_slice(name.as_bytes());
            b[100..107].copy_from_slice(b"0000644");
            b[124..135].copy_from_slice(b"00000000000");
            b[136..147].copy_from_slice(b"00000000000");
            b[156] = typeflag;
            b[157..157 + link.len()].copy_from_slice(link.as_bytes());
            b[257..263].copy_from_slice(b"ustar\0");
            b[148..156].fill(b' ');
            let sum: u32 = b.iter().map(|&x| u32::from(x)).sum();
            b[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
            out.extend_from_slice(&b);
        }
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    fn state(layers: &[&[(&str, char)]]) -> LayerState {
        let mut s = LayerState::default();
        for l in layers {
            s.apply(&layer(l)[..], 1000).unwrap();
        }
        s
    }

    fn is_entry(s: &LayerState, p: &str) -> bool {
        matches!(s.lookup(Path::new(p)), Lookup::Entry(_))
    }

    #[test]
    fn oci_order_whiteouts_hide_older_layers_only() {
        let s = state(&[
            &[("a", 'd'), ("a/x", 'f'), ("a/y", 'f'), ("b", 'f')],
            // The same layer deletes a and creates a/z: a/z stays, a/x and a/y go.
            &[
                ("a/z", 'f'),
                ("a", 'd'),
                ("a/.wh..wh..opq", 'o'),
                (".wh.b", 'w'),
            ],
        ]);
        assert!(is_entry(&s, "a/z"));
        assert_eq!(s.lookup(Path::new("a/x")), Lookup::Absent);
        assert_eq!(s.lookup(Path::new("b")), Lookup::Absent);
        // Not named: the image decides, except below the opaque a.
        assert_eq!(s.lookup(Path::new("c")), Lookup::Lower);
        assert_eq!(s.lookup(Path::new("a/image-file")), Lookup::Absent);
        assert!(!s.lower_below(Path::new("a")));
        assert!(s.lower_below(Path::new("")));
        let names: Vec<_> = s
            .children(Path::new("a"))
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(names, vec![PathBuf::from("a/z")]);
    }

    #[test]
    fn a_directory_over_a_deleted_path_starts_empty_and_files_end_subtrees() {
        let s = state(&[
            &[(".wh.etc", 'w')],
            &[("etc", 'd'), ("etc/new", 'f')],
            &[("usr", 'f')],
        ]);
        assert!(is_entry(&s, "etc/new"));
        assert_eq!(s.lookup(Path::new("etc/passwd")), Lookup::Absent);
        assert_eq!(s.lookup(Path::new("usr/bin")), Lookup::Absent);
        assert_eq!(s.lookup(Path::new("var")), Lookup::Lower);
    }

    #[test]
    fn hard_links_take_their_targets_entry_and_must_point_at_a_file() {
        let s = state(&[&[("f", 'f'), ("g->f", 'l')]]);
        let Lookup::Entry(Node::Entry { linked, header, .. }) = s.lookup(Path::new("g")) else {
            panic!()
        };
        assert_eq!(linked.as_deref(), Some(Path::new("f")));
        assert_eq!(header.path, Path::new("g"));
        let mut bad = LayerState::default();
        assert!(bad.apply(&layer(&[("g->nowhere", 'l')])[..], 10).is_err());
    }
}
