//! The container's image as overlayfs shows it: its lower layers (top first) merged, for the
//! paths an in-place rollback gives back their original content (`rollback`) and for what a
//! rw layer changes in its image (`restore::rw`).
//!
//! overlayfs' lookup, memoised per directory: a name is looked up only in the layers where its
//! parent is a merged directory; a whiteout or a non-directory ends the descent, as does an
//! opaque directory (after itself). The lower layers are containerd's read-only snapshots; a
//! name is still only looked up below directories found to be directories, and files are opened
//! without following a symlink and only if regular.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::{CString, OsStr},
    fs::File,
    io,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use crate::{inspector::fs::OverlayXattrs, sys::xattr};

/// What the image has at a path: `stat` of the topmost entry and the layer it is in.
#[derive(Clone, Copy)]
pub struct LowerEntry {
    pub layer: usize,
    pub st: libc::stat,
}

impl std::fmt::Debug for LowerEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LowerEntry(layer {}, mode {:o})",
            self.layer, self.st.st_mode
        )
    }
}

/// At most this many entries of a directory are looked at for another name of a hard-linked
/// image file.
const MAX_SIBLINGS: usize = 4096;

struct Resolved {
    top: Option<LowerEntry>,
    /// Layers whose directory at this path is merged into the view, top first.
    dirs: Vec<usize>,
}

pub struct Lowers<'a> {
    dirs: &'a [PathBuf],
    xattrs: OverlayXattrs,
    cache: HashMap<PathBuf, Resolved>,
}

impl<'a> Lowers<'a> {
    pub fn new(dirs: &'a [PathBuf], xattrs: OverlayXattrs) -> Lowers<'a> {
        Lowers {
            dirs,
            xattrs,
            cache: HashMap::new(),
        }
    }

    /// The image's entry at `rel` (relative, `""` the root), if any.
    pub fn lookup(&mut self, rel: &Path) -> Option<LowerEntry> {
        self.resolve(rel);
        self.cache.get(rel).and_then(|r| r.top)
    }

    /// Where the image's entry at `rel` is on the host.
    pub fn host_path(&self, e: &LowerEntry, rel: &Path) -> PathBuf {
        self.dirs[e.layer].join(rel)
    }

    fn resolve(&mut self, rel: &Path) {
        if self.cache.contains_key(rel) {
            return;
        }
        let layers: Vec<usize> = match rel.parent() {
            Some(parent) => {
                self.resolve(parent);
                self.cache[parent].dirs.clone()
            }
            None => (0..self.dirs.len()).collect(),
        };
        let resolved = self.resolve_in(&layers, rel);
        self.cache.insert(rel.to_path_buf(), resolved);
    }

    fn resolve_in(&self, layers: &[usize], rel: &Path) -> Resolved {
        let mut out = Resolved {
            top: None,
            dirs: Vec::new(),
        };
        for &i in layers {
            let full = self.dirs[i].join(rel);
            let Some(st) = lstat(&full) else { continue };
            if self.is_whiteout(&full, &st) {
                break;
            }
            let fmt = st.st_mode & libc::S_IFMT;
            if out.top.is_none() {
                out.top = Some(LowerEntry { layer: i, st });
            }
            if fmt != libc::S_IFDIR {
                break;
            }
            out.dirs.push(i);
            if self.is_opaque(&full) {
                break;
            }
        }
        out
    }

    fn is_whiteout(&self, full: &Path, st: &libc::stat) -> bool {
        let fmt = st.st_mode & libc::S_IFMT;
        (fmt == libc::S_IFCHR && st.st_rdev == 0)
            || (fmt == libc::S_IFREG
                && st.st_size == 0
                && self.overlay_attr(full, b"whiteout").is_some())
    }

    /// Whether the directory at host path `full` (in one of the layers) is opaque.
    pub fn is_opaque(&self, full: &Path) -> bool {
        self.overlay_attr(full, b"opaque").as_deref() == Some(b"y".as_slice())
    }

    fn overlay_attr(&self, full: &Path, name: &[u8]) -> Option<Vec<u8>> {
        let c = CString::new(full.as_os_str().as_bytes()).ok()?;
        let list = xattr::Target::Path(&c).list().ok()?;
        let found = list
            .split(|b| *b == 0)
            .find(|n| self.xattrs.overlay_name(n) == Some(name))?;
        let cname = CString::new(found).ok()?;
        xattr::Target::Path(&c).get(&cname).ok().flatten()
    }

    /// The names the image shows directly below directory `rel` (deleted ones left out).
    pub fn children(&mut self, rel: &Path) -> Vec<PathBuf> {
        self.resolve(rel);
        let layers = self.cache[rel].dirs.clone();
        let mut seen: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
        for i in layers {
            let dir = self.dirs[i].join(rel);
            let Ok(rd) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in rd.flatten() {
                let name = e.file_name().as_bytes().to_vec();
                if seen.contains_key(&name) {
                    continue;
                }
                let full = dir.join(e.file_name());
                let present = lstat(&full).is_some_and(|st| !self.is_whiteout(&full, &st));
                seen.insert(name, present);
            }
        }
        seen.into_iter()
            .filter(|(_, present)| *present)
            .map(|(n, _)| rel.join(OsStr::from_bytes(&n)))
            .collect()
    }

    /// The container's xattrs of the image's entry (overlayfs' own left out), sorted.
    pub fn xattrs(&self, e: &LowerEntry, rel: &Path) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let full = self.host_path(e, rel);
        let c = CString::new(full.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let t = xattr::Target::Path(&c);
        let mut out = Vec::new();
        for name in t.list()?.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            if name.starts_with(b"trusted.overlay.") || name.starts_with(b"user.overlay.") {
                continue;
            }
            let Ok(cname) = CString::new(name) else {
                continue;
            };
            if let Some(v) = t.get(&cname)? {
                out.push((name.to_vec(), v));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Other names of the image's file `e` at `rel` in the same directory of its layer, that
    /// sort before it (at most [`MAX_SIBLINGS`] entries are looked at).
    pub fn same_file_before(&self, e: &LowerEntry, rel: &Path) -> Vec<PathBuf> {
        let (Some(parent), Some(name)) = (rel.parent(), rel.file_name()) else {
            return Vec::new();
        };
        let Ok(rd) = std::fs::read_dir(self.dirs[e.layer].join(parent)) else {
            return Vec::new();
        };
        let mut out: Vec<PathBuf> = rd
            .take(MAX_SIBLINGS)
            .flatten()
            .filter(|d| d.file_name().as_os_str() < name)
            .filter(|d| {
                lstat(&d.path()).is_some_and(|st| {
                    st.st_ino == e.st.st_ino && st.st_mode & libc::S_IFMT == libc::S_IFREG
                })
            })
            .map(|d| parent.join(d.file_name()))
            .collect();
        out.sort();
        out
    }

    /// The image's regular file at `rel`, open for reading.
    pub fn open(&self, e: &LowerEntry, rel: &Path) -> io::Result<File> {
        crate::sys::beneath::open_regular_nofollow(&self.host_path(e, rel))
    }

    /// The target of the image's symlink at `rel`.
    pub fn readlink(&self, e: &LowerEntry, rel: &Path) -> io::Result<PathBuf> {
        std::fs::read_link(self.host_path(e, rel))
    }
}

fn lstat(p: &Path) -> Option<libc::stat> {
    nix::sys::stat::lstat(p).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_lookup_over_layers() {
        let t = tempfile::tempdir().unwrap();
        let (top, bottom) = (t.path().join("top"), t.path().join("bottom"));
        for d in [&top, &bottom] {
            std::fs::create_dir_all(d.join("etc")).unwrap();
        }
        std::fs::write(bottom.join("etc/a"), "bottom a").unwrap();
        std::fs::write(bottom.join("etc/b"), "bottom b").unwrap();
        std::fs::write(top.join("etc/a"), "top a").unwrap();
        std::fs::create_dir(bottom.join("usr")).unwrap();
        std::fs::write(bottom.join("usr/x"), "x").unwrap();
        // A file over a directory hides it.
        std::fs::write(top.join("usr"), "not a dir").unwrap();
        let dirs = vec![top.clone(), bottom.clone()];
        let mut l = Lowers::new(&dirs, OverlayXattrs::Trusted);
        let a = l.lookup(Path::new("etc/a")).unwrap();
        assert_eq!(a.layer, 0);
        assert_eq!(l.lookup(Path::new("etc/b")).unwrap().layer, 1);
        assert!(l.lookup(Path::new("usr/x")).is_none());
        assert!(l.lookup(Path::new("nothing")).is_none());
        let names = l.children(Path::new("etc"));
        assert_eq!(names, vec![PathBuf::from("etc/a"), PathBuf::from("etc/b")]);
        let mut s = String::new();
        use std::io::Read;
        l.open(&a, Path::new("etc/a"))
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "top a");
    }
}
