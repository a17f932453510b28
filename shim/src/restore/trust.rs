//! The one trust decision for every process restore, whatever brought the image.
//!
//! - crab's checkpoint images (`crabctl export`, and the internal images of fork, rollback
//!   and recover) carry their signature in `.crab-checkpoint/signature.json`, checked by
//!   [`super::intake::take_from_rootfs`];
//! - containerd's own checkpoints (`ctr task checkpoint`, `ctr c checkpoint --task`, the CRI's
//!   CheckpointContainer), which crab's shim dumps through the Task API, carry theirs in the
//!   CRIU directory itself: [`CONTAINERD_SIGNATURE`], a statement naming every other file of
//!   the directory by size and digest, signed with the shim's signing key when it dumps
//!   ([`sign_containerd_checkpoint`]). containerd keeps the directory as it is and hands it
//!   back whole at a restore (`CreateTaskRequest.checkpoint`: `ctr c restore`, `ctr run
//!   --checkpoint`, the CRI's restore of a checkpoint image), where [`containerd_checkpoint`]
//!   decides.
//!
//! Either way an image no trusted key signed is refused by default. `[restore]
//! unsigned_images` may say otherwise: `start-fresh` starts the container as if there were no
//! process image, `kernel-check` (trusted single-host use only) restores it on the kernel
//! check alone ([`super::kernel`]). A signature that does not match what it signs is always
//! refused. Whatever the decision, the kernel check runs on every restore.

use std::{
    collections::BTreeMap,
    fs,
    io::{self, Read},
    path::Path,
};

use crab_runtime_config::UnsignedImages;
use ed25519_dalek::SigningKey;

use crate::checkpoint::provenance::{
    self, FileDigest, HashingReader, ProvenanceError, RootfsBinding, Statement, TrustedKeys,
};

/// The signature file crab adds to a CRIU directory it dumps for containerd (CRIU reads only
/// the files it knows).
pub const CONTAINERD_SIGNATURE: &str = "crab-signature.json";
/// What a containerd checkpoint's statement names in place of `checkpoint.json` (which such
/// a checkpoint has not): the digest of these bytes. A statement signed for one kind of image
/// never verifies as the other.
const CONTAINERD_MARKER: &[u8] = b"crab: a containerd checkpoint, no checkpoint.json\n";

/// Bounds on a CRIU image directory taken from an image.
#[derive(Debug, Clone, Copy)]
pub struct ImageLimits {
    pub max_bytes: u64,
    pub max_files: u64,
}

impl ImageLimits {
    pub const NONE: ImageLimits = ImageLimits {
        max_bytes: u64::MAX,
        max_files: u64::MAX,
    };

    pub fn from_config(c: &crab_runtime_config::RestoreConfig) -> ImageLimits {
        ImageLimits {
            max_bytes: c.max_image_mib.saturating_mul(1 << 20),
            max_files: c.max_image_files,
        }
    }
}

type Bounds = ImageLimits;

/// How a process restore may go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A trusted key signed it, and every file is the signed one. `rootfs`: the image and rw
    /// layer it was dumped on, which the restore must run it on (`None`: the dumping shim
    /// could not tell them, [`sign_containerd_checkpoint`]).
    Signed {
        files: usize,
        bytes: u64,
        rootfs: Option<RootfsBinding>,
    },
    /// Unsigned (or signed by a key not trusted), restored on the kernel check alone
    /// (`unsigned_images = "kernel-check"`).
    KernelCheckOnly { why: String },
    /// Unsigned: the container starts without the process image (`unsigned_images =
    /// "start-fresh"`).
    StartFresh { why: String },
}

/// The regular files of `dir` (flat, as CRIU writes it) but the signature, each hashed.
pub(crate) fn digests(
    dir: &Path,
    bounds: Bounds,
) -> Result<BTreeMap<String, FileDigest>, ProvenanceError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ProvenanceError::Io { path, source }
    };
    let mut out = BTreeMap::new();
    let mut total = 0u64;
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str().map(str::to_string) else {
            return Err(ProvenanceError::Altered(format!(
                "a file whose name is not UTF-8 ({:?})",
                entry.file_name()
            )));
        };
        if name == CONTAINERD_SIGNATURE {
            continue;
        }
        let path = entry.path();
        if out.len() as u64 >= bounds.max_files {
            return Err(ProvenanceError::Malformed(format!(
                "more than {} files ([restore] max_image_files)",
                bounds.max_files
            )));
        }
        let f = crate::sys::beneath::open_regular_nofollow(&path).map_err(|e| {
            match crate::sys::beneath::is_refused(&e) {
                true => ProvenanceError::Altered(format!("{name} is not a regular file")),
                false => ProvenanceError::Io {
                    path: path.clone(),
                    source: e,
                },
            }
        })?;
        let left = bounds.max_bytes.saturating_sub(total);
        let mut r = HashingReader::new(f.take(left.saturating_add(1)));
        io::copy(&mut r, &mut io::sink()).map_err(io_err(&path))?;
        let d = r.finish();
        total = total.saturating_add(d.size);
        if total > bounds.max_bytes {
            return Err(ProvenanceError::Malformed(format!(
                "more than {} bytes ([restore] max_image_mib)",
                bounds.max_bytes
            )));
        }
        out.insert(name, d);
    }
    Ok(out)
}

/// Signs the CRIU directory `dir` that the shim just dumped for containerd, with the rootfs
/// its processes ran on (`rootfs`, when the shim could tell it: an overlay the engine
/// describes): writes [`CONTAINERD_SIGNATURE`] into it. Returns the number of files signed.
pub fn sign_containerd_checkpoint(
    dir: &Path,
    key: &SigningKey,
    rootfs: Option<RootfsBinding>,
) -> Result<usize, ProvenanceError> {
    let bounds = Bounds {
        max_bytes: u64::MAX,
        max_files: u64::MAX,
    };
    let criu = digests(dir, bounds)?;
    let n = criu.len();
    let statement = Statement {
        checkpoint_json: provenance::sha256(CONTAINERD_MARKER),
        criu,
        layers: None,
        rootfs,
    };
    let path = dir.join(CONTAINERD_SIGNATURE);
    let tmp = dir.join(format!(".{CONTAINERD_SIGNATURE}.tmp"));
    fs::write(&tmp, provenance::sign(key, statement))
        .and_then(|()| fs::rename(&tmp, &path))
        .map_err(|source| ProvenanceError::Io { path, source })?;
    Ok(n)
}

/// Decides whether containerd's checkpoint in `dir` may be restored (see the module doc).
/// `trusted` is asked only when there is a signature to check.
pub fn containerd_checkpoint(
    dir: &Path,
    trusted: &dyn Fn() -> Result<TrustedKeys, ProvenanceError>,
    unsigned: UnsignedImages,
    bounds: Bounds,
) -> Result<Decision, ProvenanceError> {
    let sig_path = dir.join(CONTAINERD_SIGNATURE);
    let verified = match fs::symlink_metadata(&sig_path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ProvenanceError::Untrusted(format!(
            "containerd's checkpoint carries no signature ({CONTAINERD_SIGNATURE}): it was not \
             dumped by a crab shim"
        ))),
        Err(source) => {
            return Err(ProvenanceError::Io {
                path: sig_path,
                source,
            })
        }
        Ok(_) => {
            let f = crate::sys::beneath::open_regular_nofollow(&sig_path)
                .map_err(|e| ProvenanceError::Malformed(format!("{CONTAINERD_SIGNATURE}: {e}")))?;
            let mut bytes = Vec::new();
            f.take(provenance::SIGNATURE_MAX)
                .read_to_end(&mut bytes)
                .map_err(|source| ProvenanceError::Io {
                    path: sig_path.clone(),
                    source,
                })?;
            trusted()?.verify(&bytes, CONTAINERD_MARKER)
        }
    };
    let statement = match verified {
        Ok(s) => s,
        Err(e @ ProvenanceError::Untrusted(_)) => {
            return match unsigned {
                UnsignedImages::Refuse => Err(e),
                UnsignedImages::StartFresh => Ok(Decision::StartFresh { why: e.to_string() }),
                UnsignedImages::KernelCheck => Ok(Decision::KernelCheckOnly { why: e.to_string() }),
            }
        }
        Err(e) => return Err(e),
    };
    let found = digests(dir, bounds)?;
    provenance::check_files(&statement, &found)?;
    Ok(Decision::Signed {
        files: found.len(),
        bytes: found.values().map(|d| d.size).sum(),
        rootfs: statement.rootfs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds {
        max_bytes: 1 << 20,
        max_files: 100,
    };

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn trusting(k: &SigningKey) -> impl Fn() -> Result<TrustedKeys, ProvenanceError> + '_ {
        move || {
            let mut t = TrustedKeys::new();
            t.add(k.verifying_key(), "test");
            Ok(t)
        }
    }

    fn image() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("core-1.img"), b"core").unwrap();
        fs::write(d.path().join("pages-1.img"), vec![7u8; 8192]).unwrap();
        d
    }

    #[test]
    fn a_signed_checkpoint_passes_and_any_change_is_refused() {
        let (d, k) = (image(), key(1));
        assert_eq!(sign_containerd_checkpoint(d.path(), &k, None).unwrap(), 2);
        let ok = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, BOUNDS);
        assert_eq!(
            ok.unwrap(),
            Decision::Signed {
                files: 2,
                bytes: 8196,
                rootfs: None,
            }
        );
        // The rootfs binding comes back as signed.
        let bound = RootfsBinding {
            image: format!("sha256:{}", "a".repeat(64)),
            rw: format!("sha256:{}", "b".repeat(64)),
        };
        sign_containerd_checkpoint(d.path(), &k, Some(bound.clone())).unwrap();
        let ok = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, BOUNDS);
        assert!(
            matches!(ok, Ok(Decision::Signed { rootfs: Some(ref b), .. }) if *b == bound),
            "{ok:?}"
        );
        // Altered, added, removed: refused whatever unsigned_images says.
        for (what, edit) in [
            (
                "core-1.img",
                Box::new(|p: &Path| fs::write(p.join("core-1.img"), b"CORE").unwrap())
                    as Box<dyn Fn(&Path)>,
            ),
            (
                "was not signed",
                Box::new(|p: &Path| fs::write(p.join("mm-1.img"), b"x").unwrap()),
            ),
            (
                "missing",
                Box::new(|p: &Path| fs::remove_file(p.join("pages-1.img")).unwrap()),
            ),
        ] {
            let (d, k) = (image(), key(1));
            sign_containerd_checkpoint(d.path(), &k, None).unwrap();
            edit(d.path());
            let e =
                containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::KernelCheck, BOUNDS)
                    .unwrap_err();
            assert!(matches!(e, ProvenanceError::Altered(_)), "{what}: {e}");
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
    }

    #[test]
    fn unsigned_or_untrusted_checkpoints_follow_the_configuration() {
        let (d, k) = (image(), key(1));
        let e = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, BOUNDS)
            .unwrap_err();
        assert!(e.to_string().contains("carries no signature"), "{e}");
        assert!(matches!(
            containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::StartFresh, BOUNDS),
            Ok(Decision::StartFresh { .. })
        ));
        assert!(matches!(
            containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::KernelCheck, BOUNDS),
            Ok(Decision::KernelCheckOnly { .. })
        ));
        // Signed by another key: untrusted, the same three answers.
        sign_containerd_checkpoint(d.path(), &key(2), None).unwrap();
        let e = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, BOUNDS)
            .unwrap_err();
        assert!(matches!(e, ProvenanceError::Untrusted(_)), "{e}");
        // A crab image's statement (over a checkpoint.json) does not verify here.
        let mut files = digests(d.path(), BOUNDS).unwrap();
        files.retain(|_, _| true);
        let bytes = provenance::sign(
            &k,
            Statement {
                checkpoint_json: provenance::sha256(b"{}"),
                criu: files,
                layers: None,
                rootfs: None,
            },
        );
        fs::write(d.path().join(CONTAINERD_SIGNATURE), bytes).unwrap();
        let e = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::KernelCheck, BOUNDS)
            .unwrap_err();
        assert!(matches!(e, ProvenanceError::Altered(_)), "{e}");
    }

    #[test]
    fn hostile_directories_are_refused_or_bounded() {
        let (d, k) = (image(), key(1));
        sign_containerd_checkpoint(d.path(), &k, None).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", d.path().join("fdinfo-2.img")).unwrap();
        let e = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, BOUNDS)
            .unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let (d, k) = (image(), key(1));
        sign_containerd_checkpoint(d.path(), &k, None).unwrap();
        let small = Bounds {
            max_bytes: 4096,
            max_files: 100,
        };
        let e = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, small)
            .unwrap_err();
        assert!(e.to_string().contains("max_image_mib"), "{e}");
        let few = Bounds {
            max_bytes: 1 << 20,
            max_files: 1,
        };
        let e = containerd_checkpoint(d.path(), &trusting(&k), UnsignedImages::Refuse, few)
            .unwrap_err();
        assert!(e.to_string().contains("max_image_files"), "{e}");
    }
}
