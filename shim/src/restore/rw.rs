//! What a container's read-write layer changed in its image, told the same way however
//! overlayfs holds the change: the digest a containerd checkpoint's signature binds its rw
//! layer with.
//!
//! containerd's checkpoint of a container (`ctr c checkpoint --rw`, the CRI's checkpoint)
//! carries the container's read-write layer as a tar diff beside the CRIU files, and its
//! restore puts that diff back into the new container's rootfs: `ctr c restore --rw` into the
//! snapshot before Create, the CRI's restore into the mounted rootfs between Create and Start.
//! Neither the diff nor the image it goes on is in the CRIU directory the shim is handed, so
//! the signature crab makes at the dump names both (the image's chain id and [`digest`] of the
//! rw layer, [`crate::checkpoint::provenance::RootfsBinding`]) and the restore checks them: the
//! image at Create, the rw layer at Start, before CRIU runs. A checkpoint's processes never run
//! on files other than those they were dumped with.
//!
//! The same change can sit in an upper directory in more than one way (an opaque directory or
//! a whiteout per image name below it; a directory copied up or not; a whiteout of a name the
//! image never had), so the digest is not of the upper directory but of what it changes: every
//! path where the merged view (upper over the image's layers) differs from the image alone,
//! with the merged entry's type, permission bits, owner, size, content digest, symlink target,
//! device number and xattrs (overlayfs' own left out). Times are left out: applying a tar sets
//! them from the tar, copy-up keeps the image's. A path the merged view no longer has is one
//! record, whatever was below it.
//!
//! The upper directory is the container's: at a dump containerd has paused it, at a restore
//! none of its processes runs yet. Paths are looked up beneath the layer directories without
//! following a symlink to a directory (overlayfs' own lookup, [`Lowers`]), files are opened
//! without following a symlink and only if regular, and both the entries looked at and the
//! bytes hashed are bounded.

use std::{
    collections::BTreeMap,
    io::Read,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

use crate::{
    inspector::fs::OverlayXattrs,
    inspector::lower::{LowerEntry, Lowers},
};

/// Bounds on one digest.
#[derive(Debug, Clone, Copy)]
pub struct RwLimits {
    /// Upper-directory entries (and image names below opaque directories) looked at.
    pub max_entries: u64,
    /// Bytes of file content hashed.
    pub max_bytes: u64,
}

impl Default for RwLimits {
    fn default() -> Self {
        RwLimits {
            max_entries: 1_000_000,
            max_bytes: 64 << 30,
        }
    }
}

/// Why a rw layer's digest could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RwError {
    #[error("its rootfs is not an overlay")]
    NotOverlay,
    #[error("its rootfs overlay has no upper directory")]
    NoUpperDir,
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: xattrs: {source}", path.display())]
    Xattrs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the rw layer has more than {0} entries")]
    TooManyEntries(u64),
    #[error("the rw layer's files hold more than {0} bytes")]
    TooManyBytes(u64),
    #[error("{} changed while it was read", .0.display())]
    Changed(PathBuf),
    /// The digest's blocking task never finished.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RwError + '_ {
    move |source| RwError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A rw layer's digest and what went into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RwDigest {
    /// `sha256:<hex>` over the changes, in path order.
    pub digest: String,
    /// Paths the rw layer changes.
    pub changes: u64,
    /// Bytes of content hashed.
    pub bytes: u64,
}

/// The digest of what the upper directory `upper` changes in the image made of `lowers`
/// (topmost first), as the overlay whose xattrs are `xattrs` shows it.
pub fn digest(
    upper: &Path,
    lowers: &[PathBuf],
    xattrs: OverlayXattrs,
    limits: RwLimits,
) -> Result<RwDigest, RwError> {
    let layers: Vec<PathBuf> = std::iter::once(upper.to_path_buf())
        .chain(lowers.iter().cloned())
        .collect();
    let mut merged = Lowers::new(&layers, xattrs);
    let mut image = Lowers::new(lowers, xattrs);
    let mut walk = Walk {
        limits,
        entries: 0,
        bytes: 0,
        changes: BTreeMap::new(),
    };
    walk.compare(&mut merged, &mut image, Path::new(""))?;
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        let here = upper.join(&rel);
        let listing = std::fs::read_dir(&here).map_err(io_err(&here))?;
        let mut names: Vec<PathBuf> = Vec::new();
        for entry in listing {
            let entry = entry.map_err(io_err(&here))?;
            names.push(rel.join(entry.file_name()));
        }
        // An opaque directory hides every image name below it: each is a change.
        if merged.is_opaque(&here) {
            names.extend(image.children(&rel));
        }
        names.sort();
        names.dedup();
        for p in names {
            walk.count_entry()?;
            walk.compare(&mut merged, &mut image, &p)?;
            let st = std::fs::symlink_metadata(upper.join(&p));
            if st.is_ok_and(|m| m.is_dir()) {
                dirs.push(p);
            }
        }
    }
    let mut h = Sha256::new();
    for (path, state) in &walk.changes {
        h.update(format!("{}:", path.len()).as_bytes());
        h.update(path);
        h.update(state.as_bytes());
        h.update(b"\n");
    }
    Ok(RwDigest {
        digest: format!("sha256:{:x}", h.finalize()),
        changes: walk.changes.len() as u64,
        bytes: walk.bytes,
    })
}

struct Walk {
    limits: RwLimits,
    entries: u64,
    bytes: u64,
    /// Path (bytes) → the merged view's entry there, for every path it changes.
    changes: BTreeMap<Vec<u8>, String>,
}

impl Walk {
    fn count_entry(&mut self) -> Result<(), RwError> {
        self.entries += 1;
        match self.entries > self.limits.max_entries {
            true => Err(RwError::TooManyEntries(self.limits.max_entries)),
            false => Ok(()),
        }
    }

    /// Records `rel` if the merged view has something else there than the image.
    fn compare(
        &mut self,
        merged: &mut Lowers,
        image: &mut Lowers,
        rel: &Path,
    ) -> Result<(), RwError> {
        let m = merged.lookup(rel);
        let i = image.lookup(rel);
        // Found below the upper directory: the image's own entry (an upper directory that is
        // opaque cuts every layer below it, so the lookups went through the same layers).
        if m.is_some_and(|e| e.layer > 0) {
            return Ok(());
        }
        let m_state = self.state(merged, m, rel)?;
        let same = match (m, i) {
            (None, None) => true,
            (Some(a), Some(b)) if head(&a.st) == head(&b.st) => {
                m_state == self.state(image, Some(b), rel)?
            }
            _ => false,
        };
        if !same {
            self.changes
                .insert(rel.as_os_str().as_bytes().to_vec(), m_state);
        }
        Ok(())
    }

    /// One line saying what `view` has at `rel` (`e`, its lookup).
    fn state(
        &mut self,
        view: &Lowers,
        e: Option<LowerEntry>,
        rel: &Path,
    ) -> Result<String, RwError> {
        let Some(e) = e else {
            return Ok("-".into());
        };
        let host = view.host_path(&e, rel);
        let st = &e.st;
        let xattrs = view.xattrs(&e, rel).map_err(|source| RwError::Xattrs {
            path: host.clone(),
            source,
        })?;
        let mut x = Sha256::new();
        for (name, value) in &xattrs {
            x.update(format!("{}:{}:", name.len(), value.len()).as_bytes());
            x.update(name);
            x.update(value);
        }
        let (fmt, mode) = (st.st_mode & libc::S_IFMT, st.st_mode & 0o7777);
        let owner = format!(
            "{:o} {} {} x{}",
            mode,
            st.st_uid,
            st.st_gid,
            hex8(&x.finalize())
        );
        Ok(match fmt {
            libc::S_IFDIR => format!("d {owner}"),
            libc::S_IFREG => {
                let size = st.st_size as u64;
                self.bytes += size;
                if self.bytes > self.limits.max_bytes {
                    return Err(RwError::TooManyBytes(self.limits.max_bytes));
                }
                let f = crate::sys::beneath::open_regular_nofollow(&host).map_err(io_err(&host))?;
                let mut h = Sha256::new();
                let mut buf = vec![0u8; 1 << 16];
                let mut r = f.take(size + 1);
                let mut read = 0u64;
                loop {
                    let n = r.read(&mut buf).map_err(io_err(&host))?;
                    if n == 0 {
                        break;
                    }
                    read += n as u64;
                    h.update(&buf[..n]);
                }
                if read != size {
                    return Err(RwError::Changed(host));
                }
                format!("f {owner} {size} {:x}", h.finalize())
            }
            libc::S_IFLNK => {
                let target = std::fs::read_link(&host).map_err(io_err(&host))?;
                format!("l {owner} {}", hex(target.as_os_str().as_bytes()))
            }
            _ => format!("o{:o} {owner} {}", fmt, st.st_rdev),
        })
    }
}

/// Type, permissions, owner and size: what differs before any content is read.
fn head(st: &libc::stat) -> (u32, u32, u32, i64) {
    (
        st.st_mode,
        st.st_uid,
        st.st_gid,
        st.st_size * i64::from(st.st_mode & libc::S_IFMT == libc::S_IFREG),
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|c| format!("{c:02x}")).collect()
}

fn hex8(b: &[u8]) -> String {
    hex(&b[..8])
}

#[cfg(test)]
mod tests {
    use std::{ffi::CString, fs, os::unix::fs::PermissionsExt};

    use super::*;

    fn limits() -> RwLimits {
        RwLimits::default()
    }

    fn whiteout(p: &Path) {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        assert_eq!(
            // SAFETY: a NUL-terminated path that lives across the call.
            unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, 0) },
            0,
            "mknod {}",
            p.display()
        );
    }

    fn opaque(p: &Path) {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        let name = CString::new("trusted.overlay.opaque").unwrap();
        assert_eq!(
            // SAFETY: NUL-terminated path and name, a 1-byte value, all live across the call.
            unsafe { libc::setxattr(c.as_ptr(), name.as_ptr(), b"y".as_ptr().cast(), 1, 0) },
            0
        );
    }

    /// An image of one layer: /etc/conf, /app/a, /app/b, /bin/tool.
    fn image() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for dir in ["etc", "app", "bin"] {
            fs::create_dir(d.path().join(dir)).unwrap();
        }
        fs::write(d.path().join("etc/conf"), b"conf").unwrap();
        fs::write(d.path().join("app/a"), b"a").unwrap();
        fs::write(d.path().join("app/b"), b"b").unwrap();
        fs::write(d.path().join("bin/tool"), b"tool").unwrap();
        d
    }

    fn of(upper: &Path, lower: &Path) -> RwDigest {
        digest(
            upper,
            &[lower.to_path_buf()],
            OverlayXattrs::Trusted,
            limits(),
        )
        .unwrap()
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn an_empty_upper_and_copied_up_directories_change_nothing() {
        let img = image();
        let empty = tempfile::tempdir().unwrap();
        let none = of(empty.path(), img.path());
        assert_eq!(none.changes, 0);
        // A directory copied up with the image's metadata, a file copied up unchanged.
        let up = tempfile::tempdir().unwrap();
        fs::create_dir(up.path().join("etc")).unwrap();
        fs::set_permissions(
            up.path().join("etc"),
            fs::metadata(img.path().join("etc")).unwrap().permissions(),
        )
        .unwrap();
        fs::write(up.path().join("etc/conf"), b"conf").unwrap();
        fs::set_permissions(
            up.path().join("etc/conf"),
            fs::metadata(img.path().join("etc/conf"))
                .unwrap()
                .permissions(),
        )
        .unwrap();
        let copied = of(up.path(), img.path());
        assert_eq!((copied.digest, copied.changes), (none.digest, 0));
    }

    #[test]
    fn content_mode_and_new_files_each_change_the_digest() {
        let img = image();
        let base = |f: &dyn Fn(&Path)| {
            let up = tempfile::tempdir().unwrap();
            fs::create_dir(up.path().join("app")).unwrap();
            fs::set_permissions(
                up.path().join("app"),
                fs::metadata(img.path().join("app")).unwrap().permissions(),
            )
            .unwrap();
            f(up.path());
            of(up.path(), img.path())
        };
        let new_file = base(&|u| fs::write(u.join("app/c"), b"c").unwrap());
        assert_eq!(new_file.changes, 1);
        let other_content = base(&|u| fs::write(u.join("app/c"), b"C").unwrap());
        assert_ne!(new_file.digest, other_content.digest);
        let other_mode = base(&|u| {
            fs::write(u.join("app/c"), b"c").unwrap();
            fs::set_permissions(u.join("app/c"), fs::Permissions::from_mode(0o4755)).unwrap();
        });
        assert_ne!(new_file.digest, other_mode.digest);
        let symlink =
            base(&|u| std::os::unix::fs::symlink("/etc/shadow", u.join("app/c")).unwrap());
        assert_ne!(new_file.digest, symlink.digest);
        // The same change made twice gives the same digest.
        assert_eq!(
            new_file,
            base(&|u| fs::write(u.join("app/c"), b"c").unwrap())
        );
    }

    #[test]
    fn an_opaque_directory_and_a_whiteout_per_name_are_the_same_change() {
        if !is_root() {
            eprintln!("skipped: whiteouts and trusted xattrs need root");
            return;
        }
        let img = image();
        // `rm -rf /app; mkdir /app; echo n > /app/n` as overlayfs holds it: an opaque /app.
        let a = tempfile::tempdir().unwrap();
        fs::create_dir(a.path().join("app")).unwrap();
        opaque(&a.path().join("app"));
        fs::write(a.path().join("app/n"), b"n").unwrap();
        // As a tar applied through the merged view holds it: /app copied up, a whiteout for
        // each image name, the new file; and a whiteout of a name the image never had.
        let b = tempfile::tempdir().unwrap();
        fs::create_dir(b.path().join("app")).unwrap();
        whiteout(&b.path().join("app/a"));
        whiteout(&b.path().join("app/b"));
        whiteout(&b.path().join("app/never"));
        fs::write(b.path().join("app/n"), b"n").unwrap();
        for u in [a.path(), b.path()] {
            fs::set_permissions(
                u.join("app"),
                fs::metadata(img.path().join("app")).unwrap().permissions(),
            )
            .unwrap();
        }
        let (da, db) = (of(a.path(), img.path()), of(b.path(), img.path()));
        assert_eq!(da.changes, 3, "a, b gone, n new");
        assert_eq!(da, db);
        // A deleted file is a change: its whiteout left out is another rw layer.
        let c = tempfile::tempdir().unwrap();
        fs::create_dir(c.path().join("app")).unwrap();
        fs::set_permissions(
            c.path().join("app"),
            fs::metadata(img.path().join("app")).unwrap().permissions(),
        )
        .unwrap();
        whiteout(&c.path().join("app/a"));
        fs::write(c.path().join("app/n"), b"n").unwrap();
        assert_ne!(of(c.path(), img.path()).digest, da.digest);
    }

    #[test]
    fn a_directory_replaced_by_a_file_is_one_change() {
        if !is_root() {
            eprintln!("skipped: whiteouts need root");
            return;
        }
        let img = image();
        let up = tempfile::tempdir().unwrap();
        fs::write(up.path().join("app"), b"now a file").unwrap();
        let d = of(up.path(), img.path());
        assert_eq!(d.changes, 1);
        // Removed instead: one record too, and another digest.
        let gone = tempfile::tempdir().unwrap();
        whiteout(&gone.path().join("app"));
        let g = of(gone.path(), img.path());
        assert_eq!(g.changes, 1);
        assert_ne!(g.digest, d.digest);
    }

    #[test]
    fn xattrs_count_and_overlayfs_own_do_not() {
        if !is_root() {
            eprintln!("skipped: trusted xattrs need root");
            return;
        }
        let img = image();
        let with = |name: &str| {
            let up = tempfile::tempdir().unwrap();
            fs::write(up.path().join("x"), b"x").unwrap();
            if !name.is_empty() {
                let c = CString::new(up.path().join("x").as_os_str().as_bytes()).unwrap();
                let n = CString::new(name).unwrap();
                assert_eq!(
                    // SAFETY: NUL-terminated path and name, a 1-byte value, all live.
                    unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), b"v".as_ptr().cast(), 1, 0) },
                    0
                );
            }
            of(up.path(), img.path())
        };
        let plain = with("");
        assert_eq!(with("trusted.overlay.origin"), plain);
        assert_ne!(with("trusted.crab-test").digest, plain.digest);
    }

    #[test]
    fn bounds_are_errors() {
        let img = image();
        let up = tempfile::tempdir().unwrap();
        for i in 0..5 {
            fs::write(up.path().join(format!("f{i}")), vec![b'x'; 100]).unwrap();
        }
        let few = RwLimits {
            max_entries: 3,
            ..limits()
        };
        let e = digest(
            up.path(),
            &[img.path().to_path_buf()],
            OverlayXattrs::Trusted,
            few,
        )
        .unwrap_err();
        assert!(matches!(e, RwError::TooManyEntries(3)), "{e}");
        assert_eq!(e.to_string(), "the rw layer has more than 3 entries");
        let small = RwLimits {
            max_bytes: 250,
            ..limits()
        };
        let e = digest(
            up.path(),
            &[img.path().to_path_buf()],
            OverlayXattrs::Trusted,
            small,
        )
        .unwrap_err();
        assert!(matches!(e, RwError::TooManyBytes(250)), "{e}");
        assert!(e.to_string().contains("more than 250 bytes"), "{e}");
    }
}
