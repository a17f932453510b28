//! Provenance of checkpoint images: who made this image, and is it what they made?
//!
//! `crabctl export` (and the internal images of fork, rollback and recover) signs what it
//! exports with crab's signing key: an ed25519 signature over a statement that names the
//! digest of `checkpoint.json` and the size and digest of every file of the CRIU image. The
//! signature travels in the image as `.crab-checkpoint/signature.json`. On Create the shim
//! restores processes only from an image whose statement a trusted key signed and whose
//! files are exactly the ones the statement names; anything else is refused with the reason
//! ("checkpoint image not signed by a trusted key", "... altered after signing: ...").
//!
//! Keys are files, so that a Kubernetes Secret mounted on every node can carry a cluster key:
//! - the signing key: `ed25519-private:<64 hex digits>` (the 32-byte seed), mode 0600,
//!   generated on first use where none exists (`[restore] signing_key`, by default
//!   `<store.state_dir>/keys/checkpoint-signing.key`); its public half is written next to
//!   it (`.pub`) for sharing;
//! - trusted public keys: `ed25519:<64 hex digits>`, one per line (`#` comments), in the
//!   files `[restore] trusted_keys` names; the signing key's own public half is trusted too
//!   unless `trust_signing_key = false`.

use std::{
    collections::BTreeMap,
    fs,
    io::{self, Read, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The signature file in the reserved directory of a checkpoint image.
pub const SIGNATURE_FILE: &str = "signature.json";
/// The signature format this crab writes and the only one it reads.
pub const SIGNATURE_FORMAT: u32 = 1;
/// A signature file names each CRIU file once; far below this.
pub const SIGNATURE_MAX: u64 = 4 << 20;
/// What a signature signs: this, then the statement's JSON. A signature made for anything
/// else (another program, another format) can never verify as one of these.
const DOMAIN: &[u8] = b"crab checkpoint image signature v1\n";
const PUBLIC_PREFIX: &str = "ed25519:";
const PRIVATE_PREFIX: &str = "ed25519-private:";

#[derive(Debug, thiserror::Error)]
pub enum ProvenanceError {
    #[error("checkpoint image not signed by a trusted key: {0}")]
    Untrusted(String),
    #[error("checkpoint image altered after signing: {0}")]
    Altered(String),
    #[error("checkpoint image layers cannot be checked against its signature: {0}")]
    Layers(String),
    #[error("checkpoint image signature is malformed: {0}")]
    Malformed(String),
    #[error("checkpoint signing key {path}: {reason}")]
    Key { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A file of the CRIU image as the signer saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// `sha256:<hex>`.
    pub sha256: String,
    pub size: u64,
}

/// What a signature vouches for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Statement {
    /// `sha256:<hex>` of `checkpoint.json` as it is in the image.
    pub checkpoint_json: String,
    /// Every file of the CRIU image by name (none without a process image).
    pub criu: BTreeMap<String, FileDigest>,
    /// The diff_ids of the image's layers below the checkpoint layer, oldest first: the
    /// files the signed processes run on ([`crate::restore::layers`]). Every image crabctl
    /// signs names them; a containerd checkpoint (restored on its container's own image) does
    /// not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<String>>,
    /// What a containerd checkpoint's processes ran on (crab's own images name their layers
    /// instead, and carry their files in the checkpoint layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<RootfsBinding>,
}

/// The rootfs a containerd checkpoint was dumped on: its image and its rw layer, which the
/// checkpoint carries beside the CRIU files (`crate::restore::rw`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RootfsBinding {
    /// Chain id of the image's layers (`sha256:<hex>`).
    pub image: String,
    /// The digest of what the rw layer changes in the image (`sha256:<hex>`).
    pub rw: String,
}

impl Statement {
    /// The bytes signed: [`DOMAIN`] and the statement's JSON, compact with every object's keys
    /// in sorted order (the fields are declared sorted, the file map is a `BTreeMap`): the
    /// same statement always gives the same bytes, and another implementation can make them.
    fn message(&self) -> Vec<u8> {
        let mut m = DOMAIN.to_vec();
        m.extend(serde_json::to_vec(self).expect("a statement serializes"));
        m
    }
}

/// `signature.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureFile {
    pub format: u32,
    /// The public key that made the signature, `ed25519:<hex>` (which key to check with; the
    /// key must also be trusted).
    pub key: String,
    pub statement: Statement,
    /// The ed25519 signature of the statement, hex.
    pub signature: String,
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    digest_string(Sha256::digest(bytes).as_slice())
}

fn digest_string(d: &[u8]) -> String {
    format!("sha256:{}", hex(d))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        let digit = |c: u8| (c as char).to_digit(16);
        out[i] = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(out)
}

/// A public key as written in key files and signatures.
pub fn public_key_string(key: &VerifyingKey) -> String {
    format!("{PUBLIC_PREFIX}{}", hex(key.as_bytes()))
}

fn parse_public_key(s: &str) -> Option<VerifyingKey> {
    let bytes = unhex::<32>(s.strip_prefix(PUBLIC_PREFIX)?)?;
    VerifyingKey::from_bytes(&bytes).ok()
}

/// A digest of a file being read: wraps a reader, counts and hashes what passes through.
pub struct HashingReader<R> {
    inner: R,
    hash: Sha256,
    len: u64,
    /// Time spent hashing (what verifying adds to a read that happens anyway).
    hashing: std::time::Duration,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hash: Sha256::new(),
            len: 0,
            hashing: std::time::Duration::ZERO,
        }
    }

    pub fn hashing_time(&self) -> std::time::Duration {
        self.hashing
    }

    pub fn finish(self) -> FileDigest {
        FileDigest {
            sha256: digest_string(self.hash.finalize().as_slice()),
            size: self.len,
        }
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let t = std::time::Instant::now();
        self.hash.update(&buf[..n]);
        self.hashing += t.elapsed();
        self.len += n as u64;
        Ok(n)
    }
}

/// Signs `statement` with `key`: the bytes of `signature.json`.
pub fn sign(key: &SigningKey, statement: Statement) -> Vec<u8> {
    let signature = key.sign(&statement.message());
    let file = SignatureFile {
        format: SIGNATURE_FORMAT,
        key: public_key_string(&key.verifying_key()),
        statement,
        signature: hex(&signature.to_bytes()),
    };
    let mut out = serde_json::to_vec_pretty(&file).expect("a signature file serializes");
    out.push(b'\n');
    out
}

/// The public keys a restore trusts, each with where it came from (for logs and errors).
#[derive(Debug, Clone, Default)]
pub struct TrustedKeys {
    keys: Vec<(VerifyingKey, String)>,
}

impl TrustedKeys {
    pub fn new() -> Self {
        TrustedKeys::default()
    }

    pub fn add(&mut self, key: VerifyingKey, origin: impl Into<String>) {
        if !self.keys.iter().any(|(k, _)| *k == key) {
            self.keys.push((key, origin.into()));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Adds every key of a public key file (`ed25519:<hex>` lines, `#` comments, blank lines).
    pub fn add_file(&mut self, path: &Path) -> Result<(), ProvenanceError> {
        let text = read_small(path, 1 << 20)?;
        let text = String::from_utf8(text).map_err(|_| ProvenanceError::Key {
            path: path.to_path_buf(),
            reason: "not text".into(),
        })?;
        let mut found = 0;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let key = parse_public_key(line).ok_or_else(|| ProvenanceError::Key {
                path: path.to_path_buf(),
                reason: format!(
                    "line {}: not a public key (`{PUBLIC_PREFIX}` and 64 hex digits)",
                    n + 1
                ),
            })?;
            self.add(key, format!("{}:{}", path.display(), n + 1));
            found += 1;
        }
        if found == 0 {
            return Err(ProvenanceError::Key {
                path: path.to_path_buf(),
                reason: "holds no public key".into(),
            });
        }
        Ok(())
    }

    /// Checks `signature_json` (the image's `signature.json`) against these keys and
    /// `checkpoint_json` (the image's description, as read): the statement it vouches for,
    /// whose CRIU files the caller must then match.
    pub fn verify(
        &self,
        signature_json: &[u8],
        checkpoint_json: &[u8],
    ) -> Result<Statement, ProvenanceError> {
        let file: SignatureFile = serde_json::from_slice(signature_json)
            .map_err(|e| ProvenanceError::Malformed(e.to_string()))?;
        if file.format != SIGNATURE_FORMAT {
            return Err(ProvenanceError::Malformed(format!(
                "format {}, this crab reads {SIGNATURE_FORMAT}",
                file.format
            )));
        }
        let key = parse_public_key(&file.key).ok_or_else(|| {
            ProvenanceError::Malformed(format!("key {:?} is not an ed25519 public key", file.key))
        })?;
        if !self.keys.iter().any(|(k, _)| *k == key) {
            let trusted: Vec<String> = self
                .keys
                .iter()
                .map(|(k, from)| format!("{} from {from}", public_key_string(k)))
                .collect();
            return Err(ProvenanceError::Untrusted(format!(
                "it was signed by {}, which is not among the {} trusted key(s) of the crab \
                 config this runtime reads ({}): start it with the runtime (and crab config) \
                 whose signing key made it, or add that public key to [restore] trusted_keys \
                 in this one",
                file.key,
                self.keys.len(),
                match trusted.is_empty() {
                    true => "none".to_string(),
                    false => trusted.join(", "),
                }
            )));
        }
        let signature = unhex::<64>(&file.signature)
            .map(|b| Signature::from_bytes(&b))
            .ok_or_else(|| {
                ProvenanceError::Malformed("the signature is not 64 hex bytes".into())
            })?;
        key.verify_strict(&file.statement.message(), &signature)
            .map_err(|_| {
                ProvenanceError::Altered(format!(
                    "the signature by {} does not match what it signs",
                    file.key
                ))
            })?;
        let actual = sha256(checkpoint_json);
        if actual != file.statement.checkpoint_json {
            return Err(ProvenanceError::Altered(format!(
                "checkpoint.json is {actual}, the signed one {}",
                file.statement.checkpoint_json
            )));
        }
        Ok(file.statement)
    }
}

/// Checks the CRIU files found in an image (name, digest as read) against a verified
/// statement: the same names, sizes and digests, nothing more, nothing less.
pub fn check_files(
    statement: &Statement,
    found: &BTreeMap<String, FileDigest>,
) -> Result<(), ProvenanceError> {
    check_digests(statement, found)?;
    if let Some(name) = statement.criu.keys().find(|n| !found.contains_key(*n)) {
        return Err(ProvenanceError::Altered(format!(
            "criu/{name} was signed but is missing"
        )));
    }
    Ok(())
}

/// Checks the digests of some of an image's CRIU files (`found`, as read) against a verified
/// statement: each must be signed and equal to what was signed. With [`check_sizes`] over the
/// whole listing, what a restore checks of an image whose page files are verified later
/// ([`super::restore::Verification`]).
pub fn check_digests(
    statement: &Statement,
    found: &BTreeMap<String, FileDigest>,
) -> Result<(), ProvenanceError> {
    for (name, d) in found {
        match statement.criu.get(name) {
            None => {
                return Err(ProvenanceError::Altered(format!(
                    "criu/{name} was not signed"
                )))
            }
            Some(signed) if signed != d => {
                return Err(ProvenanceError::Altered(format!(
                    "criu/{name} is {} bytes {}, the signed one {} bytes {}",
                    d.size, d.sha256, signed.size, signed.sha256
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Checks the CRIU files found in an image by name and size only (`found`, as listed, not
/// read) against a verified statement: what a restore checks of an image whose verified copy
/// it takes from the restore cache, never reading these files.
pub fn check_sizes(
    statement: &Statement,
    found: &BTreeMap<String, u64>,
) -> Result<(), ProvenanceError> {
    for (name, size) in found {
        match statement.criu.get(name) {
            None => {
                return Err(ProvenanceError::Altered(format!(
                    "criu/{name} was not signed"
                )))
            }
            Some(signed) if signed.size != *size => {
                return Err(ProvenanceError::Altered(format!(
                    "criu/{name} is {size} bytes, the signed one {} bytes",
                    signed.size
                )))
            }
            Some(_) => {}
        }
    }
    if let Some(name) = statement.criu.keys().find(|n| !found.contains_key(*n)) {
        return Err(ProvenanceError::Altered(format!(
            "criu/{name} was signed but is missing"
        )));
    }
    Ok(())
}

/// The keys `config` trusts: the files of `[restore] trusted_keys`, and the signing key's
/// public half unless `trust_signing_key = false` (none yet if it was never generated).
pub fn trusted_keys(config: &crab_runtime_config::Config) -> Result<TrustedKeys, ProvenanceError> {
    let mut t = TrustedKeys::new();
    if config.restore.trust_signing_key {
        let path = config.signing_key_path();
        if let Some(k) = read_signing_key(&path)? {
            t.add(k.verifying_key(), path.display().to_string());
        }
    }
    for p in &config.restore.trusted_keys {
        t.add_file(p)?;
    }
    Ok(t)
}

fn read_small(path: &Path, max: u64) -> Result<Vec<u8>, ProvenanceError> {
    let io = |source| ProvenanceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = crate::sys::beneath::open_regular_nofollow(path).map_err(|e| {
        if crate::sys::beneath::is_refused(&e) {
            ProvenanceError::Key {
                path: path.to_path_buf(),
                reason: "not a regular file".into(),
            }
        } else {
            io(e)
        }
    })?;
    let md = f.metadata().map_err(io)?;
    check_key_owner(path, &md)?;
    if md.len() > max {
        return Err(ProvenanceError::Key {
            path: path.to_path_buf(),
            reason: format!("not a regular file of at most {max} bytes"),
        });
    }
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out).map_err(io)?;
    Ok(out)
}

/// A key file decides what this host restores: it, and every directory above it, must be the
/// host's (owned by root, or by this process's user) and writable by no one else (a directory
/// writable by others must be sticky, as `/tmp`), or a local user could put a key of their own
/// in its place.
fn check_key_owner(path: &Path, md: &fs::Metadata) -> Result<(), ProvenanceError> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let owned = |uid: u32| uid == 0 || uid == me;
    let refuse = |what: &Path, m: &fs::Metadata| ProvenanceError::Key {
        path: path.to_path_buf(),
        reason: format!(
            "{} is owned by uid {} with mode {:o}: key files and their directories must be \
             owned by root and writable by no one else",
            what.display(),
            m.uid(),
            m.mode() & 0o7777
        ),
    };
    if !owned(md.uid()) || md.mode() & 0o022 != 0 {
        return Err(refuse(path, md));
    }
    let mut dir = path.parent();
    while let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
        let m = fs::metadata(d).map_err(|source| ProvenanceError::Io {
            path: d.to_path_buf(),
            source,
        })?;
        let others_write = m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0;
        if !owned(m.uid()) || others_write {
            return Err(refuse(d, &m));
        }
        dir = d.parent();
    }
    Ok(())
}

/// Reads the signing key at `path`, if there is one. A key file others may read is refused:
/// whoever can read it can sign images this host restores as its own.
pub fn read_signing_key(path: &Path) -> Result<Option<SigningKey>, ProvenanceError> {
    let key_err = |reason: String| ProvenanceError::Key {
        path: path.to_path_buf(),
        reason,
    };
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ProvenanceError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
        Ok(md) if md.permissions().mode() & 0o077 != 0 => {
            return Err(key_err(format!(
                "mode {:o}: a signing key must be readable by its owner only (chmod 600)",
                md.permissions().mode() & 0o777
            )))
        }
        Ok(_) => {}
    }
    let text = read_small(path, 4096)?;
    let text = std::str::from_utf8(&text).map_err(|_| key_err("not text".into()))?;
    let seed = text
        .trim()
        .strip_prefix(PRIVATE_PREFIX)
        .and_then(unhex::<32>)
        .ok_or_else(|| {
            key_err(format!(
                "not a signing key (`{PRIVATE_PREFIX}` and 64 hex digits)"
            ))
        })?;
    Ok(Some(SigningKey::from_bytes(&seed)))
}

/// The signing key at `path`, generated (mode 0600, its directory 0700, the public half
/// written to `<path>.pub`) where there is none. Two processes generating at once agree on
/// one key: the file is linked into place only if still absent.
pub fn signing_key(path: &Path) -> Result<SigningKey, ProvenanceError> {
    if let Some(key) = read_signing_key(path)? {
        return Ok(key);
    }
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| ProvenanceError::Io { path: p, source }
    };
    let dir = path.parent().ok_or_else(|| ProvenanceError::Key {
        path: path.to_path_buf(),
        reason: "has no directory".into(),
    })?;
    fs::create_dir_all(dir).map_err(io(dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io(dir))?;
    let mut seed = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut seed))
        .map_err(io(Path::new("/dev/urandom")))?;
    let key = SigningKey::from_bytes(&seed);
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = fs::remove_file(&tmp);
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io(&tmp))?;
        writeln!(f, "{PRIVATE_PREFIX}{}", hex(&seed)).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {}
        // Another process won the race: its key is the key.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return read_signing_key(path)?.ok_or_else(|| ProvenanceError::Key {
                path: path.to_path_buf(),
                reason: "vanished while being created".into(),
            })
        }
        Err(e) => return Err(io(path)(e)),
    }
    let public = path.with_extension("pub");
    let text = format!(
        "# crab checkpoint signing key of this host: trust it elsewhere with [restore] trusted_keys\n{}\n",
        public_key_string(&key.verifying_key())
    );
    fs::write(&public, text).map_err(io(&public))?;
    log::info!(
        "generated the checkpoint signing key {} ({})",
        path.display(),
        public_key_string(&key.verifying_key())
    );
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn statement() -> Statement {
        Statement {
            checkpoint_json: sha256(b"{\"format\":1}"),
            criu: BTreeMap::from([
                (
                    "core-1.img".to_string(),
                    FileDigest {
                        size: 3,
                        sha256: sha256(b"abc"),
                    },
                ),
                (
                    "inventory.img".to_string(),
                    FileDigest {
                        size: 1,
                        sha256: sha256(b"i"),
                    },
                ),
            ]),
            layers: Some(vec![sha256(b"base layer")]),
            rootfs: None,
        }
    }

    fn key(byte: u8) -> SigningKey {
        SigningKey::from_bytes(&[byte; 32])
    }

    fn ring(keys: &[&SigningKey]) -> TrustedKeys {
        let mut t = TrustedKeys::new();
        for k in keys {
            t.add(k.verifying_key(), "test");
        }
        t
    }

    #[test]
    fn a_signed_statement_verifies_with_a_trusted_key() {
        let k = key(1);
        let sig = sign(&k, statement());
        let got = ring(&[&key(9), &k])
            .verify(&sig, b"{\"format\":1}")
            .unwrap();
        assert_eq!(got, statement());
        check_files(&got, &statement().criu).unwrap();
    }

    #[test]
    fn the_signed_bytes_are_the_statement_with_sorted_keys() {
        let st = statement();
        let sorted = serde_json::to_vec(&serde_json::to_value(&st).unwrap()).unwrap();
        assert_eq!(st.message(), [DOMAIN, &sorted[..]].concat());
    }

    #[test]
    fn an_untrusted_key_is_refused_by_name() {
        let sig = sign(&key(1), statement());
        let err = ring(&[&key(2)])
            .verify(&sig, b"{\"format\":1}")
            .unwrap_err();
        assert!(matches!(err, ProvenanceError::Untrusted(_)), "{err}");
        assert!(
            err.to_string().contains("not signed by a trusted key"),
            "{err}"
        );
        let err = TrustedKeys::new()
            .verify(&sig, b"{\"format\":1}")
            .unwrap_err();
        assert!(matches!(err, ProvenanceError::Untrusted(_)), "{err}");
    }

    #[test]
    fn any_change_after_signing_is_refused() {
        let k = key(1);
        let t = ring(&[&k]);
        let sig = sign(&k, statement());
        // The description changed.
        let err = t.verify(&sig, b"{\"format\":2}").unwrap_err();
        assert!(matches!(err, ProvenanceError::Altered(_)), "{err}");
        // The statement inside the signature file changed (a file's digest swapped in).
        let mut file: SignatureFile = serde_json::from_slice(&sig).unwrap();
        file.statement.criu.get_mut("core-1.img").unwrap().sha256 = sha256(b"evil");
        let forged = serde_json::to_vec(&file).unwrap();
        let err = t.verify(&forged, b"{\"format\":1}").unwrap_err();
        assert!(matches!(err, ProvenanceError::Altered(_)), "{err}");
        // Another layer named below the checkpoint layer, or none.
        for layers in [Some(vec![sha256(b"attacker's layer")]), None] {
            let mut file: SignatureFile = serde_json::from_slice(&sig).unwrap();
            file.statement.layers = layers;
            let forged = serde_json::to_vec(&file).unwrap();
            let err = t.verify(&forged, b"{\"format\":1}").unwrap_err();
            assert!(matches!(err, ProvenanceError::Altered(_)), "{err}");
        }
        // A CRIU file changed, was added or is missing.
        let mut found = statement().criu;
        found.get_mut("core-1.img").unwrap().sha256 = sha256(b"abd");
        assert!(matches!(
            check_files(&statement(), &found),
            Err(ProvenanceError::Altered(_))
        ));
        let mut found = statement().criu;
        found.insert(
            "pages-9.img".into(),
            FileDigest {
                size: 0,
                sha256: sha256(b""),
            },
        );
        let err = check_files(&statement(), &found).unwrap_err();
        assert!(
            err.to_string().contains("pages-9.img was not signed"),
            "{err}"
        );
        let mut found = statement().criu;
        found.remove("inventory.img");
        let err = check_files(&statement(), &found).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn malformed_signature_files_are_refused() {
        let k = key(1);
        let t = ring(&[&k]);
        let good: serde_json::Value = serde_json::from_slice(&sign(&k, statement())).unwrap();
        let mut cases = vec![b"not json".to_vec(), b"{}".to_vec()];
        for (field, value) in [
            ("format", serde_json::json!(2)),
            ("key", serde_json::json!("rsa:abcd")),
            ("signature", serde_json::json!("zz")),
            ("extra", serde_json::json!(1)),
        ] {
            let mut v = good.clone();
            v[field] = value;
            cases.push(serde_json::to_vec(&v).unwrap());
        }
        for case in cases {
            let err = t.verify(&case, b"{\"format\":1}").unwrap_err();
            assert!(
                matches!(err, ProvenanceError::Malformed(_)),
                "{}: {err}",
                String::from_utf8_lossy(&case)
            );
        }
    }

    #[test]
    fn signing_keys_are_generated_once_private_and_shared_as_public_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys/checkpoint-signing.key");
        let k = signing_key(&path).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::metadata(path.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        // Generated once: the second call reads it.
        assert_eq!(signing_key(&path).unwrap().to_bytes(), k.to_bytes());
        // The public file is a trusted-keys file.
        let mut t = TrustedKeys::new();
        t.add_file(&path.with_extension("pub")).unwrap();
        t.verify(&sign(&k, statement()), b"{\"format\":1}").unwrap();
        // A key others can read is refused.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_signing_key(&path).unwrap_err();
        assert!(err.to_string().contains("chmod 600"), "{err}");
    }

    #[test]
    fn bad_key_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("trusted.pub");
        fs::write(&p, "# none\n\n").unwrap();
        let err = TrustedKeys::new().add_file(&p).unwrap_err();
        assert!(err.to_string().contains("holds no public key"), "{err}");
        fs::write(&p, "ed25519:1234\n").unwrap();
        let err = TrustedKeys::new().add_file(&p).unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        let err = TrustedKeys::new()
            .add_file(&dir.path().join("absent.pub"))
            .unwrap_err();
        assert!(matches!(err, ProvenanceError::Io { .. }), "{err}");
    }

    /// Issue 24, item 7: a key file someone else could replace is no key.
    #[test]
    fn key_files_others_could_replace_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let k = SigningKey::from_bytes(&[3; 32]);
        let keys = dir.path().join("keys");
        fs::create_dir(&keys).unwrap();
        let p = keys.join("trusted.pub");
        fs::write(&p, format!("{}\n", public_key_string(&k.verifying_key()))).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
        TrustedKeys::new().add_file(&p).unwrap();
        // Group-writable file, others-writable directory, a file owned by another user.
        fs::set_permissions(&p, fs::Permissions::from_mode(0o664)).unwrap();
        let err = TrustedKeys::new().add_file(&p).unwrap_err();
        assert!(err.to_string().contains("writable by no one else"), "{err}");
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
        fs::set_permissions(&keys, fs::Permissions::from_mode(0o777)).unwrap();
        let err = TrustedKeys::new().add_file(&p).unwrap_err();
        assert!(
            err.to_string().contains(&keys.display().to_string()),
            "{err}"
        );
        // Sticky (as /tmp): others cannot replace root's file.
        fs::set_permissions(&keys, fs::Permissions::from_mode(0o1777)).unwrap();
        TrustedKeys::new().add_file(&p).unwrap();
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            let err = TrustedKeys::new().add_file(&p).unwrap_err();
            assert!(err.to_string().contains("uid 65534"), "{err}");
        }
    }
}
