//! A checkpoint as an OCI image (RESTORE.md "Checkpoint image"), as pure data: the base image's
//! layers and config with crab's additions stripped, the manifest and config of the new image,
//! and the checkpoint layer carrying the reserved directory. Nothing here talks to containerd.
//!
//! Everything is deterministic: the same checkpoint exported twice gives the same digests
//! (timestamps come from the checkpoint's manifest, tar entries carry no wall-clock time), so a
//! second export of a checkpoint (a rollback to a turn exported before) finds every blob in
//! the content store already.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::{self, Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use ed25519_dalek::SigningKey;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crab_shim::checkpoint::{
    pages::{self, PagesError},
    provenance::{self, FileDigest, HashingReader, Statement, SIGNATURE_FILE},
    store::{digest_string, Descriptor},
};
use crab_shim::restore::intake::{CheckpointMeta, CRIU_DIR, META_FILE, RESERVED_DIR};

/// The OCI marker that makes its directory opaque: lower layers' entries under it are hidden.
const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";

pub const MEDIA_TYPE_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_TYPE_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_TYPE_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const MEDIA_TYPE_DOCKER_LIST: &str =
    "application/vnd.docker.distribution.manifest.list.v2+json";
/// The checkpoint layer's media type (the store's layers use the same).
pub use crab_shim::checkpoint::store::MEDIA_TYPE_LAYER_ZSTD;

/// Config label: how many of the image's layers are its base image's (the rest are crab's).
pub const LABEL_BASE_LAYERS: &str = "io.crab.checkpoint.base-layers";
/// Config label: `<namespace>/<container>@<seq>` the image was exported from.
pub const LABEL_SOURCE: &str = "io.crab.checkpoint.source";
/// Image label: what the image was built from, exactly (the store's checkpoint record and the
/// signing key's public half, hashed): an internal image with the same identity is not built
/// again (see `Ctl::export_leased`).
pub const LABEL_IDENTITY: &str = "io.crab.checkpoint.identity";

/// zstd level of the checkpoint layer (as the store's layers).
const ZSTD_LEVEL: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("base image {what}: {reason}")]
    BadBase { what: &'static str, reason: String },
    #[error("checkpoint layer: {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checkpoint layer: {path} is {found}: a CRIU image holds plain files only")]
    NotPlain { path: PathBuf, found: &'static str },
    #[error("checkpoint layer: process image: {0}")]
    Pages(#[from] PagesError),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An OCI content descriptor as manifests carry it; fields this code does not know (urls,
/// platform, ...) are kept as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OciDescriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl OciDescriptor {
    pub fn new(media_type: &str, digest: &str, size: u64) -> OciDescriptor {
        OciDescriptor {
            media_type: media_type.to_string(),
            digest: digest.to_string(),
            size,
            extra: serde_json::Map::new(),
        }
    }
}

impl From<&Descriptor> for OciDescriptor {
    fn from(d: &Descriptor) -> Self {
        OciDescriptor::new(&d.media_type, &d.digest, d.size)
    }
}

/// What a checkpoint image starts from: the base image's layers (with their diff ids) and
/// its config, without anything crab added when the image is itself a checkpoint image.
#[derive(Debug, Clone, PartialEq)]
pub struct Base {
    pub layers: Vec<OciDescriptor>,
    pub diff_ids: Vec<String>,
    pub config: Value,
}

fn bad(what: &'static str) -> impl Fn(String) -> ImageError {
    move |reason| ImageError::BadBase { what, reason }
}

/// The image config's labels (`config.Labels`), if any.
pub fn config_labels(config: &Value) -> BTreeMap<String, String> {
    config["config"]["Labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// The base of a new checkpoint image from an image's manifest and config. A checkpoint image
/// (label [`LABEL_BASE_LAYERS`]) contributes only its first base-layers layers, and its config
/// loses the diff ids, history entries and labels crab added, so checkpoint images never nest.
pub fn base_of(manifest: &Value, config: &Value) -> Result<Base, ImageError> {
    let layers: Vec<OciDescriptor> = serde_json::from_value(manifest["layers"].clone())
        .map_err(|e| bad("manifest")(format!("layers: {e}")))?;
    let diff_ids: Vec<String> = serde_json::from_value(config["rootfs"]["diff_ids"].clone())
        .map_err(|e| bad("config")(format!("rootfs.diff_ids: {e}")))?;
    if layers.len() != diff_ids.len() {
        return Err(bad("config")(format!(
            "{} layers in the manifest but {} diff ids",
            layers.len(),
            diff_ids.len()
        )));
    }
    let keep = match config_labels(config).get(LABEL_BASE_LAYERS) {
        None => layers.len(),
        Some(n) => n
            .parse::<usize>()
            .ok()
            .filter(|n| *n <= layers.len())
            .ok_or_else(|| {
                bad("config")(format!(
                    "label {LABEL_BASE_LAYERS}={n:?} for an image of {} layers",
                    layers.len()
                ))
            })?,
    };
    let mut config = config.clone();
    config["rootfs"]["diff_ids"] = json!(diff_ids[..keep]);
    if let Some(history) = config["history"].as_array() {
        config["history"] = Value::Array(history_for_layers(history, keep));
    }
    if let Some(process) = config["config"].as_object_mut() {
        if let Some(labels) = process.get_mut("Labels").and_then(Value::as_object_mut) {
            labels.remove(LABEL_BASE_LAYERS);
            labels.remove(LABEL_SOURCE);
            if labels.is_empty() {
                process.remove("Labels");
            }
        }
    }
    Ok(Base {
        layers: layers[..keep].to_vec(),
        diff_ids: diff_ids[..keep].to_vec(),
        config,
    })
}

/// The history entries that describe the first `layers` layers: up to the one of the last
/// kept layer, with the empty-layer entries (config changes) that follow it.
fn history_for_layers(history: &[Value], layers: usize) -> Vec<Value> {
    let mut seen = 0;
    history
        .iter()
        .take_while(|h| {
            let empty = h["empty_layer"].as_bool().unwrap_or(false);
            if !empty {
                seen += 1;
            }
            empty || seen <= layers
        })
        .cloned()
        .collect()
}

/// A layer blob: digest and size as stored, digest of its uncompressed tar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    pub digest: String,
    pub diff_id: String,
    pub size: u64,
}

/// What the new image says about where it came from.
#[derive(Debug, Clone)]
pub struct Provenance<'a> {
    /// `<namespace>/<container>@<seq>`.
    pub source: &'a str,
    pub turn_id: &'a str,
    /// RFC 3339; the checkpoint's own time, so exports are reproducible.
    pub created: &'a str,
}

/// A checkpoint image: its manifest and config blobs and the layers they name (oldest first).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointImage {
    pub manifest: Vec<u8>,
    pub config: Vec<u8>,
    pub layers: Vec<OciDescriptor>,
    pub diff_ids: Vec<String>,
    pub base_layers: usize,
}

impl CheckpointImage {
    pub fn manifest_digest(&self) -> String {
        sha256_of(&self.manifest)
    }

    pub fn config_digest(&self) -> String {
        sha256_of(&self.config)
    }

    /// The content labels of the manifest that keep its config and layers from containerd's
    /// garbage collector while the manifest is referenced.
    pub fn manifest_gc_labels(&self) -> HashMap<String, String> {
        let mut labels = HashMap::from([(
            "containerd.io/gc.ref.content.config".to_string(),
            self.config_digest(),
        )]);
        for (i, l) in self.layers.iter().enumerate() {
            labels.insert(
                format!("containerd.io/gc.ref.content.l.{i}"),
                l.digest.clone(),
            );
        }
        labels
    }

    /// The chain id of every layer prefix: the names of the committed snapshots.
    pub fn chain_ids(&self) -> Vec<String> {
        chain_ids(&self.diff_ids)
    }
}

/// Builds the image: base layers + the checkpoint's fs layers + the checkpoint layer; the
/// base config with extended `rootfs.diff_ids`, appended history and crab's labels (its
/// Entrypoint, Cmd, Env, WorkingDir and User stay as they are).
pub fn build(
    base: &Base,
    fs_layers: &[Descriptor],
    checkpoint_layer: &LayerBlob,
    from: &Provenance<'_>,
) -> CheckpointImage {
    assemble(base, fs_layers, Some(checkpoint_layer), from)
}

/// A plain image of a checkpoint's files: base layers + the fs layers, the base config with
/// extended `rootfs.diff_ids` and history, without the checkpoint layer or crab's labels (so
/// nothing takes it for a checkpoint image: a container started from it starts its command,
/// and as a base it is whole).
pub fn build_files(
    base: &Base,
    fs_layers: &[Descriptor],
    from: &Provenance<'_>,
) -> CheckpointImage {
    assemble(base, fs_layers, None, from)
}

/// [`build`] with the checkpoint layer, [`build_files`] without.
fn assemble(
    base: &Base,
    fs_layers: &[Descriptor],
    checkpoint_layer: Option<&LayerBlob>,
    from: &Provenance<'_>,
) -> CheckpointImage {
    let mut layers = base.layers.clone();
    layers.extend(fs_layers.iter().map(OciDescriptor::from));
    let mut diff_ids = base.diff_ids.clone();
    diff_ids.extend(fs_layers.iter().map(|d| d.diff_id.clone()));
    if let Some(c) = checkpoint_layer {
        layers.push(OciDescriptor::new(MEDIA_TYPE_LAYER_ZSTD, &c.digest, c.size));
        diff_ids.push(c.diff_id.clone());
    }

    let mut config = base.config.clone();
    if !config.is_object() {
        config = json!({});
    }
    config["created"] = json!(from.created);
    config["rootfs"] = json!({"type": "layers", "diff_ids": diff_ids});
    let mut history = config["history"].as_array().cloned().unwrap_or_default();
    let n = fs_layers.len();
    for i in 0..n {
        let what = format!(
            "crab: fs layer {} of {n} of checkpoint {}",
            i + 1,
            from.source
        );
        history.push(json!({
            "created": from.created,
            "created_by": match checkpoint_layer {
                Some(_) => what,
                None => format!("{what} (turn {:?}), files only", from.turn_id),
            },
        }));
    }
    if checkpoint_layer.is_some() {
        history.push(json!({
            "created": from.created,
            "created_by": format!("crab: checkpoint {} (turn {:?})", from.source, from.turn_id),
            "comment": format!("{RESERVED_DIR}/ holds the checkpoint; crab hides it on start"),
        }));
    }
    config["history"] = Value::Array(history);
    if checkpoint_layer.is_some() {
        if !config["config"].is_object() {
            config["config"] = json!({});
        }
        if !config["config"]["Labels"].is_object() {
            config["config"]["Labels"] = json!({});
        }
        let labels = &mut config["config"]["Labels"];
        labels[LABEL_BASE_LAYERS] = json!(base.layers.len().to_string());
        labels[LABEL_SOURCE] = json!(from.source);
    }
    let config = serde_json::to_vec(&config).expect("a JSON value serializes");
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": OciDescriptor::new(MEDIA_TYPE_CONFIG, &sha256_of(&config), config.len() as u64),
        "layers": layers,
    });
    CheckpointImage {
        manifest: serde_json::to_vec(&manifest).expect("a JSON value serializes"),
        config,
        layers,
        diff_ids,
        base_layers: base.layers.len(),
    }
}

/// Sets the image config's process to the container's (its runtime spec `spec`), so that an
/// image run without a command (`docker run IMG`, `ctr run IMG ID`) starts what the container
/// ran, even when the base image had no `Cmd`: `Cmd` is the spec's `process.args` (after the
/// base's `Entrypoint` when the args begin with it, else the `Entrypoint` is dropped), `Env`
/// the spec's environment without the `HOSTNAME=<hostname>` the runtime sets for each
/// container, `WorkingDir` its `cwd`. A spec without args leaves the config as it is.
pub fn set_process(config: &mut Value, spec: &Value) {
    let strings = |v: &Value| -> Option<Vec<String>> {
        v.as_array()?
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let process = &spec["process"];
    let Some(args) = strings(&process["args"]).filter(|a| !a.is_empty()) else {
        return;
    };
    if !config.is_object() {
        *config = json!({});
    }
    if !config["config"].is_object() {
        config["config"] = json!({});
    }
    let c = &mut config["config"];
    let entrypoint = strings(&c["Entrypoint"]).unwrap_or_default();
    if !entrypoint.is_empty() && args.starts_with(&entrypoint) {
        c["Cmd"] = json!(args[entrypoint.len()..]);
    } else {
        c["Entrypoint"] = Value::Null;
        c["Cmd"] = json!(args);
    }
    if let Some(env) = strings(&process["env"]) {
        let own_hostname = spec["hostname"]
            .as_str()
            .filter(|h| !h.is_empty())
            .map(|h| format!("HOSTNAME={h}"));
        let env: Vec<String> = env
            .into_iter()
            .filter(|e| Some(e) != own_hostname.as_ref())
            .collect();
        c["Env"] = json!(env);
    }
    if let Some(cwd) = process["cwd"].as_str().filter(|d| d.starts_with('/')) {
        c["WorkingDir"] = json!(cwd);
    }
}

/// The base of a checkpoint image of a container without an image: `layers` (bottom first,
/// with their diff ids) read from its rootfs, and a config holding nothing else.
pub fn rootfs_base(layers: Vec<(OciDescriptor, String)>) -> Base {
    let (os, arch) = host_platform();
    let n = layers.len();
    let history: Vec<Value> = (1..=n)
        .map(|i| json!({"created_by": format!("crab: layer {i} of {n} of the container's rootfs")}))
        .collect();
    let (layers, diff_ids): (Vec<_>, Vec<_>) = layers.into_iter().unzip();
    Base {
        config: json!({
            "architecture": arch,
            "os": os,
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": history,
        }),
        layers,
        diff_ids,
    }
}

/// Compresses the tar `input` into a zstd layer blob written to `out`.
pub fn compress_layer(mut input: impl Read, out: impl Write) -> io::Result<LayerBlob> {
    let mut encoder = zstd::stream::write::Encoder::new(Hashing::new(out), ZSTD_LEVEL)?;
    let mut diff = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        diff.update(&buf[..n]);
        encoder.write_all(&buf[..n])?;
    }
    let mut hashing = encoder.finish()?;
    hashing.flush()?;
    Ok(LayerBlob {
        digest: digest_string(hashing.hash),
        diff_id: digest_string(diff),
        size: hashing.len,
    })
}

/// OCI chain ids of every prefix: chain(0) = diff(0); chain(n) = sha256(chain(n-1) + " " + diff(n))
/// (the shim's, which checks them at a restore).
pub use crab_shim::restore::layers::chain_ids;

/// The platform a manifest list entry must have for this host (Go's GOARCH names).
pub fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    ("linux", arch)
}

/// From an image index, the manifest descriptor for this host (else the first one).
pub fn pick_manifest(index: &Value) -> Result<OciDescriptor, ImageError> {
    let manifests: Vec<Value> = index["manifests"].as_array().cloned().unwrap_or_default();
    let (os, arch) = host_platform();
    let pick = manifests
        .iter()
        .find(|m| m["platform"]["os"] == os && m["platform"]["architecture"] == arch)
        .or_else(|| manifests.first())
        .ok_or_else(|| bad("index")("no manifests".into()))?;
    serde_json::from_value(pick.clone()).map_err(|e| bad("index")(e.to_string()))
}

/// Writes `w` to `out` while hashing it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Hashing<W> {
    fn new(inner: W) -> Self {
        Hashing {
            inner,
            hash: Sha256::new(),
            len: 0,
        }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Where the CRIU image of a checkpoint is: its directory in the store (recipes instead of
/// pages files) and the store's chunk directory.
#[derive(Debug, Clone, Copy)]
pub struct CriuSource<'a> {
    pub dir: &'a Path,
    pub chunks: &'a Path,
}

/// Writes the checkpoint layer (tar, zstd) to `out`: `.crab-checkpoint/checkpoint.json` and,
/// with a process image, `.crab-checkpoint/criu/` holding the CRIU image with its pages files
/// rebuilt from their recipes. Entries are owned by root, modes 0700/0600, mtime 0.
pub fn write_checkpoint_layer(
    meta: &CheckpointMeta,
    below: &[String],
    criu: Option<CriuSource<'_>>,
    signer: &SigningKey,
    out: impl Write,
) -> Result<LayerBlob, ImageError> {
    let compressed = Hashing::new(out);
    let layer_path = Path::new("<checkpoint layer>");
    let encoder =
        zstd::stream::write::Encoder::new(compressed, ZSTD_LEVEL).map_err(io_err(layer_path))?;
    let mut tar = tar::Builder::new(Hashing::new(encoder));
    let root = Path::new(RESERVED_DIR);
    append(&mut tar, &root.join(""), None, layer_path)?;
    // Opaque: whatever lower layers (the container's own fs layers, which the agent wrote)
    // hold under the reserved directory is hidden, never merged into the checkpoint.
    append(
        &mut tar,
        &root.join(OPAQUE_WHITEOUT),
        Some((0, &mut io::empty())),
        layer_path,
    )?;
    let mut json = serde_json::to_vec_pretty(meta).expect("checkpoint meta serializes");
    json.push(b'\n');
    append(
        &mut tar,
        &root.join(META_FILE),
        Some((json.len() as u64, &mut &json[..])),
        layer_path,
    )?;
    let criu_files = match criu {
        Some(criu) => append_criu_image(&mut tar, &root.join(CRIU_DIR), criu)?,
        None => BTreeMap::new(),
    };
    // Last: the signature over the description, every CRIU file as written above and the
    // layers the image has below this one (`below`: their diff_ids, oldest first).
    let signature = provenance::sign(
        signer,
        Statement {
            checkpoint_json: provenance::sha256(&json),
            criu: criu_files,
            layers: Some(below.to_vec()),
            rootfs: None,
        },
    );
    append(
        &mut tar,
        &root.join(SIGNATURE_FILE),
        Some((signature.len() as u64, &mut &signature[..])),
        layer_path,
    )?;
    let uncompressed = tar.into_inner().map_err(io_err(layer_path))?;
    let diff_id = digest_string(uncompressed.hash);
    let mut compressed = uncompressed.inner.finish().map_err(io_err(layer_path))?;
    compressed.flush().map_err(io_err(layer_path))?;
    Ok(LayerBlob {
        digest: digest_string(compressed.hash),
        diff_id,
        size: compressed.len,
    })
}

/// `sha256:<hex>` of `data`.
pub fn sha256_of(data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(data);
    digest_string(h)
}

/// One tar entry: a directory (`data` None, `path` ending in `/`) or a file.
fn append<W: Write>(
    tar: &mut tar::Builder<W>,
    path: &Path,
    data: Option<(u64, &mut dyn Read)>,
    context: &Path,
) -> Result<(), ImageError> {
    let mut h = tar::Header::new_gnu();
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    match data {
        None => {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o700);
            h.set_size(0);
            tar.append_data(&mut h, path, io::empty())
        }
        Some((len, reader)) => {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o600);
            h.set_size(len);
            // tar pads a short reader with zeros silently: count what was really read.
            let mut counted = Counted {
                inner: reader.take(len),
                n: 0,
            };
            tar.append_data(&mut h, path, &mut counted).and_then(|()| {
                if counted.n == len {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("{} bytes of {len}", counted.n),
                    ))
                }
            })
        }
    }
    .map_err(|e| {
        if e.get_ref().is_some_and(|inner| inner.is::<PagesError>()) {
            let inner = e.into_inner().expect("checked").downcast::<PagesError>();
            ImageError::Pages(*inner.expect("checked"))
        } else {
            io_err(context)(e)
        }
    })
}

struct Counted<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// The CRIU image directory under `at`: its plain files as they are, its pages recipes as the
/// pages files they stand for (a pages file materialized next to its recipe is the same data:
/// the recipe wins). Temp files (dot names) are left out; anything but a plain file is an error.
fn append_criu_image<W: Write>(
    tar: &mut tar::Builder<W>,
    at: &Path,
    criu: CriuSource<'_>,
) -> Result<BTreeMap<String, FileDigest>, ImageError> {
    append(tar, &at.join(""), None, criu.dir)?;
    let readers = pages::materialized_readers(criu.dir, criu.chunks)?;
    let mut names: Vec<String> = Vec::new();
    for entry in fs::read_dir(criu.dir).map_err(io_err(criu.dir))? {
        let entry = entry.map_err(io_err(criu.dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with('.') || pages::is_recipe(&name) {
            continue;
        }
        let kind = entry.file_type().map_err(io_err(&path))?;
        if !kind.is_file() {
            let found = if kind.is_dir() {
                "a directory"
            } else if kind.is_symlink() {
                "a symlink"
            } else {
                "not a regular file"
            };
            return Err(ImageError::NotPlain { path, found });
        }
        if !readers.iter().any(|r| r.name() == name) {
            names.push(name);
        }
    }
    let mut readers: BTreeMap<String, pages::PagesReader> = readers
        .into_iter()
        .map(|r| (r.name().to_string(), r))
        .collect();
    names.extend(readers.keys().cloned());
    names.sort();
    let mut digests = BTreeMap::new();
    for name in names {
        let dest = at.join(&name);
        let digest = match readers.get_mut(&name) {
            Some(r) => {
                let len = r.len();
                let mut hashing = HashingReader::new(r);
                append(
                    tar,
                    &dest,
                    Some((len, &mut hashing as &mut dyn Read)),
                    &criu.dir.join(&name),
                )?;
                hashing.finish()
            }
            None => {
                let path = criu.dir.join(&name);
                let f = fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(io_err(&path))?;
                let len = f.metadata().map_err(io_err(&path))?.len();
                let mut hashing = HashingReader::new(f);
                append(
                    tar,
                    &dest,
                    Some((len, &mut hashing as &mut dyn Read)),
                    &path,
                )?;
                hashing.finish()
            }
        };
        digests.insert(name, digest);
    }
    Ok(digests)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crab_shim::checkpoint::store::MEDIA_TYPE_LAYER_TAR;
    use crab_shim::restore::intake::{ProcessMeta, Source, META_FORMAT};

    fn hexd(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn agent_image() -> (Value, Value) {
        let manifest = json!({
            "schemaVersion": 2,
            "config": {"mediaType": MEDIA_TYPE_CONFIG, "digest": hexd('c'), "size": 500},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": hexd('a'), "size": 1000,
                        "annotations": {"x": "y"}}],
        });
        let config = json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/usr/bin"], "Entrypoint": ["/init"], "Cmd": ["bash"], "WorkingDir": "/app", "User": "1000"},
            "rootfs": {"type": "layers", "diff_ids": [hexd('d')]},
            "history": [{"created_by": "add layer"}, {"created_by": "config", "empty_layer": true}],
        });
        (manifest, config)
    }

    fn layer(c: char) -> Descriptor {
        Descriptor {
            digest: hexd(c),
            diff_id: hexd(c.to_ascii_uppercase()),
            size: 10,
            media_type: MEDIA_TYPE_LAYER_ZSTD.into(),
        }
    }

    fn provenance() -> Provenance<'static> {
        Provenance {
            source: "ns/c@3",
            turn_id: "t3",
            created: "2026-01-01T00:00:00.000Z",
        }
    }

    fn checkpoint_blob() -> LayerBlob {
        LayerBlob {
            digest: hexd('e'),
            diff_id: hexd('f'),
            size: 77,
        }
    }

    #[test]
    fn builds_on_the_base_and_keeps_its_process_settings() {
        let (manifest, config) = agent_image();
        let base = base_of(&manifest, &config).unwrap();
        assert_eq!(base.layers.len(), 1);
        assert_eq!(base.layers[0].extra["annotations"], json!({"x": "y"}));
        let img = build(
            &base,
            &[layer('1'), layer('2')],
            &checkpoint_blob(),
            &provenance(),
        );
        let m: Value = serde_json::from_slice(&img.manifest).unwrap();
        let c: Value = serde_json::from_slice(&img.config).unwrap();
        assert_eq!(m["mediaType"], MEDIA_TYPE_MANIFEST);
        assert_eq!(m["config"]["digest"].as_str().unwrap(), img.config_digest());
        assert_eq!(m["config"]["size"], img.config.len());
        let layers = m["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 4);
        assert_eq!(
            layers[0]["annotations"],
            json!({"x": "y"}),
            "base descriptors kept as they are"
        );
        assert_eq!(layers[1]["digest"], hexd('1'));
        assert_eq!(layers[3]["digest"], hexd('e'));
        assert_eq!(layers[3]["mediaType"], MEDIA_TYPE_LAYER_ZSTD);
        assert_eq!(
            c["rootfs"]["diff_ids"],
            json!([
                hexd('d'),
                hexd('1').to_uppercase().replace("SHA256", "sha256"),
                hexd('2').to_uppercase().replace("SHA256", "sha256"),
                hexd('f')
            ])
        );
        for key in ["Env", "Entrypoint", "Cmd", "WorkingDir", "User"] {
            assert_eq!(c["config"][key], config["config"][key], "{key}");
        }
        assert_eq!(c["config"]["Labels"][LABEL_BASE_LAYERS], "1");
        assert_eq!(c["config"]["Labels"][LABEL_SOURCE], "ns/c@3");
        assert_eq!(c["created"], "2026-01-01T00:00:00.000Z");
        let history = c["history"].as_array().unwrap();
        assert_eq!(history.len(), 2 + 3);
        assert!(history[4]["created_by"]
            .as_str()
            .unwrap()
            .contains("ns/c@3"));
        let labels = img.manifest_gc_labels();
        assert_eq!(
            labels["containerd.io/gc.ref.content.config"],
            img.config_digest()
        );
        assert_eq!(labels["containerd.io/gc.ref.content.l.3"], hexd('e'));
        assert_eq!(labels.len(), 5);
        assert_eq!(img.chain_ids()[0], hexd('d'));
        assert_eq!(img.chain_ids().len(), 4);
        // Deterministic: the same checkpoint gives the same image.
        assert_eq!(
            build(
                &base,
                &[layer('1'), layer('2')],
                &checkpoint_blob(),
                &provenance()
            ),
            img
        );
    }

    #[test]
    fn a_files_only_image_is_a_plain_image_whole_as_a_base() {
        let (manifest, config) = agent_image();
        let base = base_of(&manifest, &config).unwrap();
        let img = build_files(&base, &[layer('1'), layer('2')], &provenance());
        let m: Value = serde_json::from_slice(&img.manifest).unwrap();
        let c: Value = serde_json::from_slice(&img.config).unwrap();
        let layers = m["layers"].as_array().unwrap();
        // The base and the fs layers, no checkpoint layer.
        assert_eq!(layers.len(), 3);
        assert_eq!(layers[2]["digest"], hexd('2'));
        assert_eq!(c["rootfs"]["diff_ids"].as_array().unwrap().len(), 3);
        for key in ["Env", "Entrypoint", "Cmd", "WorkingDir", "User"] {
            assert_eq!(c["config"][key], config["config"][key], "{key}");
        }
        // No crab label: nothing takes it for a checkpoint image, and as a base it is whole.
        assert!(
            c["config"]["Labels"].get(LABEL_BASE_LAYERS).is_none(),
            "{c}"
        );
        assert!(c["config"]["Labels"].get(LABEL_SOURCE).is_none(), "{c}");
        let again = base_of(&m, &c).unwrap();
        assert_eq!(again.layers.len(), 3);
        let history = c["history"].as_array().unwrap();
        assert_eq!(history.len(), 2 + 2);
        assert!(history[3]["created_by"]
            .as_str()
            .unwrap()
            .contains("files only"));
    }

    #[test]
    fn a_checkpoint_image_as_base_contributes_only_its_base() {
        let (manifest, config) = agent_image();
        let base = base_of(&manifest, &config).unwrap();
        let first = build(&base, &[layer('1')], &checkpoint_blob(), &provenance());
        let m: Value = serde_json::from_slice(&first.manifest).unwrap();
        let c: Value = serde_json::from_slice(&first.config).unwrap();
        let mut again = base_of(&m, &c).unwrap();
        assert_eq!(again.config["created"], "2026-01-01T00:00:00.000Z");
        again.config.as_object_mut().unwrap().remove("created");
        assert_eq!(
            again, base,
            "crab's layers, history and labels are stripped"
        );
        let mut labelled = config.clone();
        labelled["config"]["Labels"] = json!({"keep": "me"});
        let img = build(
            &base_of(&manifest, &labelled).unwrap(),
            &[],
            &checkpoint_blob(),
            &provenance(),
        );
        let c: Value = serde_json::from_slice(&img.config).unwrap();
        assert_eq!(c["config"]["Labels"]["keep"], "me");
        let stripped = base_of(&serde_json::from_slice(&img.manifest).unwrap(), &c).unwrap();
        assert_eq!(
            config_labels(&stripped.config),
            BTreeMap::from([("keep".to_string(), "me".to_string())])
        );
    }

    #[test]
    fn bad_bases_are_named() {
        let (manifest, mut config) = agent_image();
        config["rootfs"]["diff_ids"] = json!([]);
        assert!(base_of(&manifest, &config)
            .unwrap_err()
            .to_string()
            .contains("1 layers in the manifest but 0 diff ids"));
        let (manifest, mut config) = agent_image();
        config["config"]["Labels"] = json!({LABEL_BASE_LAYERS: "7"});
        assert!(base_of(&manifest, &config)
            .unwrap_err()
            .to_string()
            .contains(LABEL_BASE_LAYERS));
        let index = json!({"manifests": [
            {"mediaType": MEDIA_TYPE_MANIFEST, "digest": hexd('1'), "size": 1, "platform": {"os": "linux", "architecture": "s390x"}},
            {"mediaType": MEDIA_TYPE_MANIFEST, "digest": hexd('2'), "size": 1, "platform": {"os": "linux", "architecture": host_platform().1}},
        ]});
        assert_eq!(pick_manifest(&index).unwrap().digest, hexd('2'));
        assert!(pick_manifest(&json!({"manifests": []})).is_err());
    }

    #[test]
    fn the_config_runs_the_containers_process() {
        let spec = json!({
            "hostname": "3f4e2b0c9d1a",
            "process": {
                "args": ["/init", "sleep", "infinity"],
                "env": ["PATH=/bin", "HOSTNAME=3f4e2b0c9d1a", "A=1", "HOSTNAME=other"],
                "cwd": "/work",
            },
        });
        // The base's Entrypoint begins the args: kept, Cmd the rest.
        let (_, mut config) = agent_image();
        set_process(&mut config, &spec);
        let c = &config["config"];
        assert_eq!(c["Entrypoint"], json!(["/init"]));
        assert_eq!(c["Cmd"], json!(["sleep", "infinity"]));
        assert_eq!(c["Env"], json!(["PATH=/bin", "A=1", "HOSTNAME=other"]));
        assert_eq!(c["WorkingDir"], "/work");
        assert_eq!(c["User"], "1000", "the rest stays");
        // Another Entrypoint is dropped: the args alone are the command.
        let mut other = spec.clone();
        other["process"]["args"] = json!(["python3", "-m", "http.server"]);
        let (_, mut config) = agent_image();
        set_process(&mut config, &other);
        assert_eq!(config["config"]["Entrypoint"], Value::Null);
        assert_eq!(config["config"]["Cmd"], other["process"]["args"]);
        // A base without any process settings (a rootfs base: Docker's) gets them all.
        let mut bare = rootfs_base(vec![]).config;
        set_process(&mut bare, &spec);
        assert_eq!(bare["config"]["Cmd"], spec["process"]["args"]);
        assert_eq!(bare["config"]["Entrypoint"], Value::Null);
        let mut not_object = json!("x");
        set_process(&mut not_object, &spec);
        assert_eq!(not_object["config"]["WorkingDir"], "/work");
        // A spec without args (or none) changes nothing; junk is ignored, never a panic.
        for junk in [
            json!({}),
            json!({"process": {"args": []}}),
            json!({"process": {"args": [1, 2]}}),
            json!({"process": "x"}),
            json!([1]),
        ] {
            let (_, mut config) = agent_image();
            let before = config.clone();
            set_process(&mut config, &junk);
            assert_eq!(config, before, "{junk}");
        }
        let mut odd = spec.clone();
        odd["process"]["cwd"] = json!("relative");
        odd["process"]["env"] = json!("PATH=/x");
        let (_, mut config) = agent_image();
        set_process(&mut config, &odd);
        assert_eq!(config["config"]["WorkingDir"], "/app");
        assert_eq!(config["config"]["Env"], json!(["PATH=/usr/bin"]));
    }

    #[test]
    fn a_rootfs_base_and_its_compressed_layers() {
        let tar = b"not really a tar, but bytes".repeat(100);
        let mut out = Vec::new();
        let blob = compress_layer(&tar[..], &mut out).unwrap();
        assert_eq!(blob.size, out.len() as u64);
        assert_eq!(blob.digest, sha256_of(&out));
        assert_eq!(blob.diff_id, sha256_of(&tar));
        assert_eq!(zstd::decode_all(&out[..]).unwrap(), tar);
        let base_layer = |c: char| {
            (
                OciDescriptor::new(MEDIA_TYPE_LAYER_ZSTD, &hexd(c), 5),
                hexd(c.to_ascii_uppercase()),
            )
        };
        let base = rootfs_base(vec![base_layer('1'), base_layer('2')]);
        assert_eq!(base.layers.len(), 2);
        assert_eq!(base.config["rootfs"]["diff_ids"], json!(base.diff_ids));
        assert_eq!(base.config["history"].as_array().unwrap().len(), 2);
        assert_eq!(base.config["os"], "linux");
        // A checkpoint image on it is a valid base again (history and layers agree).
        let img = build(&base, &[layer('3')], &checkpoint_blob(), &provenance());
        let again = base_of(
            &serde_json::from_slice(&img.manifest).unwrap(),
            &serde_json::from_slice(&img.config).unwrap(),
        )
        .unwrap();
        assert_eq!(again.layers, base.layers);
    }

    fn meta(process: bool) -> CheckpointMeta {
        CheckpointMeta {
            format: META_FORMAT,
            source: Source {
                namespace: "ns".into(),
                container: "c".into(),
                seq: 3,
                turn_id: "t3".into(),
            },
            fs_layers: vec![layer('1')],
            process: process.then(|| ProcessMeta { pids: vec![1, 9] }),
            created_at: "2026-01-01T00:00:00.000Z".into(),
            volumes: Vec::new(),
            annotations: Default::default(),
        }
    }

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[3; 32])
    }

    fn trusted() -> provenance::TrustedKeys {
        let mut t = provenance::TrustedKeys::new();
        t.add(key().verifying_key(), "test");
        t
    }

    /// The layer's entries: path -> (type, mode, mtime, data).
    fn entries(blob: &[u8]) -> BTreeMap<String, (tar::EntryType, u32, u64, Vec<u8>)> {
        let tar = zstd::decode_all(blob).unwrap();
        let mut out = BTreeMap::new();
        for e in tar::Archive::new(&tar[..]).entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().to_string_lossy().into_owned();
            let h = e.header().clone();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
            out.insert(
                path,
                (h.entry_type(), h.mode().unwrap(), h.mtime().unwrap(), data),
            );
        }
        out
    }

    #[test]
    fn fs_only_checkpoint_layer_holds_the_description() {
        let mut out = Vec::new();
        let blob = write_checkpoint_layer(&meta(false), &[], None, &key(), &mut out).unwrap();
        assert_eq!(blob.size, out.len() as u64);
        assert_eq!(blob.digest, sha256_of(&out));
        assert_eq!(
            blob.diff_id,
            sha256_of(&zstd::decode_all(&out[..]).unwrap())
        );
        let e = entries(&out);
        assert_eq!(
            e.keys().collect::<Vec<_>>(),
            [
                ".crab-checkpoint/",
                ".crab-checkpoint/.wh..wh..opq",
                ".crab-checkpoint/checkpoint.json",
                ".crab-checkpoint/signature.json",
            ]
        );
        // Signed: the signature vouches for the description and no CRIU file.
        let statement = trusted()
            .verify(
                &e[".crab-checkpoint/signature.json"].3,
                &e[".crab-checkpoint/checkpoint.json"].3,
            )
            .unwrap();
        assert!(statement.criu.is_empty());
        assert_eq!(e[".crab-checkpoint/"].0, tar::EntryType::Directory);
        let (kind, mode, mtime, json) = &e[".crab-checkpoint/checkpoint.json"];
        assert_eq!((*kind, *mode, *mtime), (tar::EntryType::Regular, 0o600, 0));
        let parsed = CheckpointMeta::parse(Path::new("x"), json).unwrap();
        assert_eq!(parsed, meta(false));
        let v: Value = serde_json::from_slice(json).unwrap();
        assert_eq!(v["process"], Value::Null);
        assert_eq!(v["source"]["container"], "c");
        assert_eq!(v["fs_layers"][0]["diff_id"], hexd('1'));
        // Deterministic.
        let mut again = Vec::new();
        assert_eq!(
            write_checkpoint_layer(&meta(false), &[], None, &key(), &mut again).unwrap(),
            blob
        );
        assert_eq!(
            MEDIA_TYPE_LAYER_TAR,
            "application/vnd.oci.image.layer.v1.tar"
        );
    }

    #[test]
    fn process_checkpoint_layer_carries_the_criu_image_with_pages_materialized() {
        let tmp = tempfile::tempdir().unwrap();
        let (img, chunks) = (tmp.path().join("proc"), tmp.path().join("chunks"));
        fs::create_dir_all(&img).unwrap();
        let pages_data: Vec<u8> = (0..3 * pages::CHUNK_SIZE + 5)
            .map(|i| (i % 251) as u8)
            .collect();
        fs::write(img.join("pages-1.img"), &pages_data).unwrap();
        fs::write(img.join("pagemap-1.img"), b"map").unwrap();
        fs::write(img.join("inventory.img"), b"inv").unwrap();
        fs::write(img.join("descriptors.json"), b"[]").unwrap();
        pages::dedup(&img, &chunks).unwrap();
        fs::write(img.join(".leftover.tmp"), b"x").unwrap();
        let mut out = Vec::new();
        write_checkpoint_layer(
            &meta(true),
            &[],
            Some(CriuSource {
                dir: &img,
                chunks: &chunks,
            }),
            &key(),
            &mut out,
        )
        .unwrap();
        let e = entries(&out);
        let names: Vec<&str> = e.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                ".crab-checkpoint/",
                ".crab-checkpoint/.wh..wh..opq",
                ".crab-checkpoint/checkpoint.json",
                ".crab-checkpoint/criu/",
                ".crab-checkpoint/criu/descriptors.json",
                ".crab-checkpoint/criu/inventory.img",
                ".crab-checkpoint/criu/pagemap-1.img",
                ".crab-checkpoint/criu/pages-1.img",
                ".crab-checkpoint/signature.json",
            ]
        );
        // The signature names every CRIU file as written, the pages materialized.
        let statement = trusted()
            .verify(
                &e[".crab-checkpoint/signature.json"].3,
                &e[".crab-checkpoint/checkpoint.json"].3,
            )
            .unwrap();
        let files: Vec<&str> = statement.criu.keys().map(String::as_str).collect();
        assert_eq!(
            files,
            [
                "descriptors.json",
                "inventory.img",
                "pagemap-1.img",
                "pages-1.img"
            ]
        );
        assert_eq!(statement.criu["pages-1.img"].sha256, sha256_of(&pages_data));
        assert_eq!(statement.criu["pages-1.img"].size, pages_data.len() as u64);
        assert_eq!(e[".crab-checkpoint/criu/pages-1.img"].3, pages_data);
        assert_eq!(e[".crab-checkpoint/criu/inventory.img"].3, b"inv");
        assert!(
            img.join("pages-1.img.recipe").exists() && !img.join("pages-1.img").exists(),
            "the store is unchanged"
        );
        // Materialized in place too: still one entry.
        pages::materialize(&img, &chunks).unwrap();
        let mut again = Vec::new();
        write_checkpoint_layer(
            &meta(true),
            &[],
            Some(CriuSource {
                dir: &img,
                chunks: &chunks,
            }),
            &key(),
            &mut again,
        )
        .unwrap();
        assert_eq!(again, out);
        // A missing chunk fails the layer.
        for f in fs::read_dir(&chunks).unwrap() {
            fs::remove_file(f.unwrap().path()).unwrap();
        }
        let e = write_checkpoint_layer(
            &meta(true),
            &[],
            Some(CriuSource {
                dir: &img,
                chunks: &chunks,
            }),
            &key(),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(matches!(e, ImageError::Pages(_)), "{e}");
        // Anything but plain files is refused.
        fs::remove_file(img.join("pages-1.img.recipe")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", img.join("evil.img")).unwrap();
        let e = write_checkpoint_layer(
            &meta(true),
            &[],
            Some(CriuSource {
                dir: &img,
                chunks: &chunks,
            }),
            &key(),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                ImageError::NotPlain {
                    found: "a symlink",
                    ..
                }
            ),
            "{e}"
        );
    }
}
